"""Per-rank memory of real model sizes at 32k to 1M tokens, cp 1 to 64, from simulated ranks.

    python benchmarks/scale.py --quick     # Qwen3-VL-8B, text, 32k, cp 1..8 (one config each)
    python benchmarks/scale.py             # the four published configs, 32k/128k/512k/1M tokens,
                                           # text and video-heavy, cp 1..64 (hours on 2 cores)

Every row is one rank of the real step (``cpvlm.simulate``: ContextParallelVLM + FSDP2 over
dp x cp on fake tensors, bf16 compute on float32 master weights, AdamW, activation
checkpointing, loss chunk 1024, ring attention), on GPUs of 80 GB; dp = 1 (FSDP2 shards over the
cp ranks). Columns: the peak of a later step's forward + backward (optimizer state held; GiB),
its activations (that peak less params+grads+optimizer), the bytes saved for backward,
params+grads+optimizer, the optimizer step's peak (foreach AdamW: params, grads, 2 states and
one temporary of the grads' size; the peak column is the larger of it and forward + backward), the longest sequence that fits 80 GB at that cp (activations linear in S from
the simulated point), "saved x cp": the saved bytes times cp over the first cp's (1.00 = the
physical 1/cp), and "bound": "weights" where params+grads+optimizer take more than half the GPU,
else "activations". --models/--kinds/--lengths/--cps choose the grid, --budget-s stops starting
points (those left are listed "not run"); the JSON is rewritten after every point.
Writes scale.json and scale.png (peak per cp, one line per model and length).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Clock, parser, print_table, write_json  # noqa: E402

GPU_GIB = 80 * 10**9 / 2**30  # an "80 GB" GPU
LENGTHS = {"32k": 32768, "128k": 131072, "512k": 524288, "1M": 1048576}
MODELS = ("qwen3-vl-8b", "qwen2.5-vl-72b", "qwen3.5-9b", "gemma3-27b")
CPS = (1, 2, 4, 8, 16, 32, 64)
# A peer's published maximum sequence for the same model and GPU count: none found (searched:
# ring attention, USP, LongVILA, torchtitan CP, Megatron CP). The nearest, for another model
# and GPU count, is listed as such and not put beside our rows.
PEERS: dict = {
    "same_model_and_gpus": [],
    "nearest": [
        {
            "peer": "LongVILA (MM-SP)",
            "model": "LongVILA-8B (VILA, 8B LLM)",
            "gpus": 256,
            "max_seq": 2_097_152,
            "note": "2M-token training on 256 GPUs without gradient checkpointing",
            "source": "arXiv 2408.10188, abstract",
        }
    ],
}


def spec_for(kind: str, seq_len: int):
    from cpvlm.simulate import SequenceSpec

    if kind == "text":
        return SequenceSpec(seq_len)
    frames = max(2, int(seq_len * 0.9) // 196 * 2)  # 90% video: 448x448 frames, 196 tokens/2
    return SequenceSpec(seq_len, videos=((frames, 448, 448),))


def _row(model, kind, name, cp, m, base) -> dict:
    G = 2**30
    budget = GPU_GIB * G
    seq = LENGTHS[name]
    fixed = m.params + m.grads + m.optimizer
    fwd_bwd = m.steady_peak  # a later step's peak: forward + backward with the state held
    act = fwd_bwd - fixed
    cp0, saved0 = base.setdefault((model, kind, name), (cp, m.saved))
    return {
        "model": model,
        "seq": f"{kind} {name}",
        "cp": cp,
        "status": "simulated",
        "peak_GiB": fwd_bwd / G,
        "acts_GiB": act / G,
        "saved_GiB": m.saved / G,
        "weights_GiB": fixed / G,
        "opt_step_GiB": m.peak_opt / G,
        "fits": fwd_bwd <= budget,
        "longest": int(seq * (budget - fixed) / act) if budget > fixed and act > 0 else 0,
        "saved_x_cp": m.saved * cp / (saved0 * cp0),
        "bound": "weights" if fixed > budget / 2 else "activations",
        "sim_s": m.seconds,
    }


COLS = [
    "model",
    "seq",
    "cp",
    "peak_GiB",
    "acts_GiB",
    "saved_GiB",
    "weights_GiB",
    "opt_step_GiB",
    "fits",
    "longest",
    "saved_x_cp",
    "bound",
    "sim_s",
]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="Qwen3-VL-8B, text, 32k, cp 1..8")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--kinds", nargs="+", default=["text", "video"], choices=["text", "video"])
    p.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    p.add_argument("--cps", nargs="+", type=int, default=list(CPS))
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new point after this many seconds; the rest are listed as not run",
    )
    args = p.parse_args()
    from cpvlm.simulate import Setup, load_config, simulate_step

    if args.quick:
        args.models, args.kinds, args.lengths, args.cps = (
            ["qwen3-vl-8b"],
            ["text"],
            ["32k"],
            [1, 2, 4, 8],
        )
    grid = [
        (m, k, n, cp)
        for m in args.models
        for k in args.kinds
        for n in args.lengths
        for cp in args.cps
    ]
    stem = "scale_quick" if args.quick else "scale"
    clock, configs, caches, rows, base = Clock(), {}, {}, [], {}
    for model, kind, name, cp in grid:
        point = {"model": model, "seq": f"{kind} {name}", "cp": cp}
        if args.budget_s is not None and clock.wall() > args.budget_s:
            rows.append({**point, "status": "not run (time budget)"})
            continue
        if model not in configs:
            configs[model] = load_config(model)
            caches[model] = {}
        setup = Setup(dp=1, cp=cp, activation_checkpointing=True, loss_chunk=1024)
        try:
            m = simulate_step(configs[model], spec_for(kind, LENGTHS[name]), setup, caches[model])
        except (ValueError, RuntimeError, NotImplementedError, MemoryError) as err:
            rows.append({**point, "status": "error", "error": str(err)[:200]})
            print(f"{model} {kind} {name} cp {cp}: {str(err)[:200]}", flush=True)
        else:
            rows.append(_row(model, kind, name, cp, m, base))
            print_table(rows[-1:], COLS, "")
            sys.stdout.flush()
        # Written after every point: a run stopped part way keeps what it simulated.
        write_json(args.out_dir, stem, {"gpu_GiB": GPU_GIB, "rows": rows, "peers": PEERS})
    done = [r for r in rows if r["status"] == "simulated"]
    print_table(done, COLS, "per-rank memory, 80 GB GPUs (simulated)")
    print(f"{len(done)} of {len(grid)} points simulated", flush=True)
    write_json(args.out_dir, stem, {"gpu_GiB": GPU_GIB, "rows": rows, "peers": PEERS})
    _plot(rows, args.out_dir / f"{stem}.png")


def _plot(rows, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = {}
    for r in rows:
        if r.get("status") == "simulated":
            lines.setdefault((r["model"], r["seq"]), []).append((r["cp"], r["peak_GiB"]))
    for (model, seq), pts in lines.items():
        ax.plot(*zip(*sorted(pts)), marker="o", label=f"{model} {seq}")
    ax.axhline(GPU_GIB, color="k", linestyle="--", linewidth=1, label="80 GB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cp")
    ax.set_ylabel("per-rank peak (GiB)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path.name}")


if __name__ == "__main__":
    main()
