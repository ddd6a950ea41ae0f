"""Per-rank memory of real model sizes at 32k to 1M tokens, cp 1 to 64, from simulated ranks.

    python benchmarks/scale.py --quick     # Qwen3-VL-8B, text, 32k, cp 1..8 (one config each)
    python benchmarks/scale.py             # the four published configs, 32k/128k/512k/1M tokens,
                                           # text and video-heavy, cp 1..64 (hours on 2 cores)

Every row is one rank of the real step (``cpvlm.simulate``: ContextParallelVLM + FSDP2 over
dp x cp on fake tensors, bf16 compute on float32 master weights, AdamW, activation
checkpointing, loss chunk 1024, ring attention), on GPUs of 80 GB; dp = 1 (FSDP2 shards over the
cp ranks). Columns: the steady-state peak (GiB), its activations, params+grads+optimizer, the
longest sequence that fits 80 GB at that cp (activations linear in S from the simulated point),
"act x cp": activations times cp over the cp=1 figure (1.00 = the physical 1/cp), and "bound":
"weights" where params+grads+optimizer take more than half the GPU, else "activations".
Writes scale.json and scale.png (peak per cp, one line per model and length).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parser, print_table, write_json  # noqa: E402

GPU_GIB = 80 * 10**9 / 2**30  # an "80 GB" GPU
LENGTHS = {"32k": 32768, "128k": 131072, "512k": 524288, "1M": 1048576}
MODELS = ("qwen3-vl-8b", "qwen2.5-vl-72b", "qwen3.5-9b", "gemma3-27b")
CPS = (1, 2, 4, 8, 16, 32, 64)
# No peer maximum is listed: none could be checked against its source offline.
PEERS: dict = {}


def spec_for(kind: str, seq_len: int):
    from cpvlm.simulate import SequenceSpec

    if kind == "text":
        return SequenceSpec(seq_len)
    frames = max(2, int(seq_len * 0.9) // 196 * 2)  # 90% video: 448x448 frames, 196 tokens/2
    return SequenceSpec(seq_len, videos=((frames, 448, 448),))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="Qwen3-VL-8B, text, 32k, cp 1..8")
    args = p.parse_args()
    from cpvlm.simulate import Setup, load_config, simulate_step

    G = 2**30
    grid = (
        [("qwen3-vl-8b", "text", "32k", cp) for cp in (1, 2, 4, 8)]
        if args.quick
        else [
            (m, k, n, cp) for m in MODELS for k in ("text", "video") for n in LENGTHS for cp in CPS
        ]
    )
    rows, base = [], {}
    for model, kind, name, cp in grid:
        config = load_config(model)
        seq = LENGTHS[name]
        setup = Setup(dp=1, cp=cp, activation_checkpointing=True, loss_chunk=1024)
        try:
            m = simulate_step(config, spec_for(kind, seq), setup)
        except (ValueError, RuntimeError, NotImplementedError) as err:
            rows.append(
                {"model": model, "seq": kind + " " + name, "cp": cp, "error": str(err)[:120]}
            )
            continue
        fixed = m.params + m.grads + m.optimizer
        act = m.steady_peak - fixed
        key = (model, kind, name)
        base.setdefault(key, (cp, act))
        cp0, act0 = base[key]
        budget = GPU_GIB * G
        rows.append(
            {
                "model": model,
                "seq": f"{kind} {name}",
                "cp": cp,
                "peak_GiB": m.steady_peak / G,
                "acts_GiB": act / G,
                "weights_GiB": fixed / G,
                "fits": m.steady_peak <= budget,
                "longest": int(seq * (budget - fixed) / act) if budget > fixed else 0,
                "act_x_cp": act * cp / (act0 * cp0),
                "bound": "weights" if fixed > budget / 2 else "activations",
                "sim_s": m.seconds,
            }
        )
        print_table(rows[-1:], list(rows[-1]), "")
    cols = [
        "model",
        "seq",
        "cp",
        "peak_GiB",
        "acts_GiB",
        "weights_GiB",
        "fits",
        "longest",
        "act_x_cp",
        "bound",
        "sim_s",
    ]
    print_table(
        [r for r in rows if "error" not in r], cols, "per-rank memory, 80 GB GPUs (simulated)"
    )
    write_json(
        args.out_dir, "scale_quick" if args.quick else "scale", {"rows": rows, "peers": PEERS}
    )
    _plot(rows, args.out_dir / ("scale_quick.png" if args.quick else "scale.png"))


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
        if "error" not in r:
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
