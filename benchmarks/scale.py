"""Per-rank memory of real model sizes at 32k to 1M tokens, cp 1 to 64, from simulated ranks.

    python benchmarks/scale.py --quick     # Qwen3-VL-8B, text, 32k, cp 1..8 (one config each)
    python benchmarks/scale.py             # the four published configs, 32k/128k/512k/1M tokens,
                                           # text and video-heavy, cp 1..64 (hours on 2 cores)

Every row is one rank of the real step (``cpvlm.simulate``: ContextParallelVLM + FSDP2 over
dp x cp on fake tensors, bf16 compute on float32 master weights, AdamW, activation
checkpointing, loss chunk 1024, ring attention), on GPUs of 80 GB; dp = 1 (FSDP2 shards over the
cp ranks). Columns: the peak of a later step's forward + backward (optimizer state held; GiB),
its activations (that peak less params+grads+optimizer), the bytes saved for backward and their
part that is the model's activations ("saved_act": less the lm_head's gathered weight and the
loss's tensors, which do not shrink with cp), params+grads+optimizer, the optimizer step's peak
(foreach AdamW: params, grads, 2 states and one temporary of the grads' size; the peak column is
the larger of it and forward + backward), the longest sequence that fits 80 GB at that cp
(activations linear in S from the simulated point), "saved_act_x_cp": the saved activations times
cp over the sequence's cp-2 point's (``_ratios``; 1.00 = the physical 1/cp), "bound": "weights" where
params+grads+optimizer take more than half the GPU, else "activations", and the simulation's CPU
seconds with the 1-minute load average. Layers are simulated as ``cpvlm.simulate.depth`` says
(a few, the rest added; --full-depth: every layer, written to scale_full_depth.json).
--models/--kinds/--lengths/--cps choose the grid, --budget-s stops starting points (those left
are listed "not run"); the JSON is rewritten after every point; --replot redraws the plot from it.
Writes scale.json and scale.png (peak per cp, one line per model and length).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Clock, parser, print_table, pyplot, save_figure, write_json  # noqa: E402

GPU_GIB = 80 * 10**9 / 2**30  # an "80 GB" GPU
LENGTHS = {"32k": 32768, "128k": 131072, "512k": 524288, "1M": 1048576}
MODELS = ("qwen3-vl-8b", "qwen2.5-vl-72b", "qwen3.5-9b", "gemma3-27b")
CPS = (1, 2, 4, 8, 16, 32, 64)
# Peers' published maximum sequences (model, GPUs, source): benchmarks/results/scale_peers.json,
# read at every write so that the table's peers can be filled in while a grid runs.
PEERS_FILE = Path(__file__).resolve().parent / "results" / "scale_peers.json"


def peers() -> dict:
    return json.loads(PEERS_FILE.read_text()) if PEERS_FILE.exists() else {}


def spec_for(kind: str, seq_len: int, config):
    """The row of ``kind`` at ``seq_len`` tokens for ``config``'s model: text only, or 90% video
    of 448x448 frames (sized by the model's patch and merge: 196 tokens a frame pair for Qwen3-VL
    and Qwen3.5, 256 for Qwen2.5-VL). A family without videos (Gemma 3) gets the frames as
    images (``image_size`` a side, ``mm_tokens_per_image`` tokens each), 90% of the row."""
    from cpvlm.hf import adapter_for
    from cpvlm.simulate import SequenceSpec

    if kind == "text":
        return SequenceSpec(seq_len)
    vision = int(seq_len * 0.9)
    vc = config.vision_config
    adapter = adapter_for(config)
    if not adapter.takes_videos:  # the frames as images of the tower's fixed size
        side = vc.image_size
        return SequenceSpec(
            seq_len, images=((side, side),) * max(1, vision // config.mm_tokens_per_image)
        )
    per_pair = (448 // vc.patch_size // adapter.merge_size) ** 2
    return SequenceSpec(seq_len, videos=((max(2, vision // per_pair * 2), 448, 448),))


def _row(model, kind, name, cp, m, cpu_s) -> dict:
    G = 2**30
    budget = GPU_GIB * G
    seq = LENGTHS[name]
    fixed = m.params + m.grads + m.optimizer
    fwd_bwd = m.steady_peak  # a later step's peak: forward + backward with the state held
    act = fwd_bwd - fixed
    return {
        "model": model,
        "seq": f"{kind} {name}",
        "cp": cp,
        "status": "simulated",
        "peak_GiB": fwd_bwd / G,
        "acts_GiB": act / G,
        "saved_GiB": m.saved / G,
        "saved_act_GiB": m.saved_activations / G,
        "saved_head_GiB": (m.saved_gathered + m.loss_saved) / G,
        "weights_GiB": fixed / G,
        "opt_step_GiB": m.peak_opt / G,
        "fits": fwd_bwd <= budget,
        # 0 where the weights or the optimizer step alone exceed the GPU (no sequence fits)
        "longest": int(seq * (budget - fixed) / act) if max(fixed, m.peak_opt) < budget else 0,
        "bound": "weights" if fixed > budget / 2 else "activations",
        "sim_s": m.seconds,
        "sim_cpu_s": cpu_s,
        "load1": os.getloadavg()[0],
        "memory": m.as_dict(),
    }


COLS = [
    "model",
    "seq",
    "cp",
    "peak_GiB",
    "acts_GiB",
    "saved_GiB",
    "saved_act_GiB",
    "weights_GiB",
    "opt_step_GiB",
    "fits",
    "longest",
    "saved_act_x_cp",
    "bound",
    "sim_cpu_s",
    "load1",
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
    p.add_argument(
        "--full-depth",
        action="store_true",
        help="simulate every layer (Setup.reduced_depth=False): the reference of the extrapolation",
    )
    p.add_argument(
        "--depth-fit",
        choices=["affine", "add"],
        default="add",
        help="how the layers left out are added (Setup.depth_fit; cpvlm/simulate/depth.py)",
    )
    p.add_argument(
        "--replot", action="store_true", help="redraw the plot from the JSON (and its peers)"
    )
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="fold the simulated rows of these scale JSONs (runs of parts of the grid) into "
        "OUT_DIR's, replacing its rows of the same model, sequence and cp, then replot",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print docs/benchmarks.md's scale tables from the JSON",
    )
    args = p.parse_args()
    if args.merge or args.markdown:
        path = args.out_dir / "scale.json"
        rows = json.loads(path.read_text())["rows"] if path.exists() else []
        if args.merge:
            rows = merge(rows, [json.loads(f.read_text())["rows"] for f in args.merge])
            write_json(args.out_dir, "scale", {"gpu_GiB": GPU_GIB, "rows": rows, "peers": peers()})
            _plot(rows, args.out_dir / "scale.png")
        if args.markdown:
            print(markdown(rows))
        return
    from cpvlm.simulate import Setup, load_config, simulate_step

    if args.quick:
        args.models, args.kinds, args.lengths, args.cps = (
            ["qwen3-vl-8b"],
            ["text"],
            ["32k"],
            [1, 2, 4, 8],
        )
    stem = "scale_quick" if args.quick else "scale_full_depth" if args.full_depth else "scale"
    if args.replot:
        rows = json.loads((args.out_dir / f"{stem}.json").read_text())["rows"]
        write_json(args.out_dir, stem, {"gpu_GiB": GPU_GIB, "rows": rows, "peers": peers()})
        _plot(rows, args.out_dir / f"{stem}.png")
        return
    # Model by model; within one, length by length, text then video, cp ascending.
    grid = [
        (m, k, n, cp)
        for m in args.models
        for n in args.lengths
        for k in args.kinds
        for cp in args.cps
    ]
    clock, configs, caches, rows = Clock(), {}, {}, []
    for model, kind, name, cp in grid:
        point = {"model": model, "seq": f"{kind} {name}", "cp": cp}
        if args.budget_s is not None and clock.wall() > args.budget_s:
            rows.append({**point, "status": "not run (time budget)"})
            continue
        if model not in configs:
            configs[model] = load_config(model)
            caches[model] = {}
        setup = Setup(
            dp=1,
            cp=cp,
            activation_checkpointing=True,
            loss_chunk=1024,
            reduced_depth=not args.full_depth,
            depth_fit=args.depth_fit,
        )
        cpu = time.process_time()
        try:
            m = simulate_step(
                configs[model], spec_for(kind, LENGTHS[name], configs[model]), setup, caches[model]
            )
        except (ValueError, RuntimeError, NotImplementedError, MemoryError) as err:
            rows.append({**point, "status": "error", "error": str(err)[:200]})
            print(f"{model} {kind} {name} cp {cp}: {str(err)[:200]}", flush=True)
        else:
            row = _row(model, kind, name, cp, m, time.process_time() - cpu)
            rows.append({**row, "depth": "full" if args.full_depth else args.depth_fit})
            _ratios(rows)
            print_table(rows[-1:], COLS, "")
            sys.stdout.flush()
        # Written after every point: a run stopped part way keeps what it simulated.
        write_json(args.out_dir, stem, {"gpu_GiB": GPU_GIB, "rows": rows, "peers": peers()})
    done = [r for r in rows if r["status"] == "simulated"]
    print_table(done, COLS, "per-rank memory, 80 GB GPUs (simulated)")
    print(f"{len(done)} of {len(grid)} points simulated", flush=True)
    write_json(args.out_dir, stem, {"gpu_GiB": GPU_GIB, "rows": rows, "peers": peers()})
    _plot(rows, args.out_dir / f"{stem}.png")


def _key(row: dict) -> tuple:
    return row["model"], row["seq"], row["cp"]


def _ratios(rows: list[dict]) -> None:
    """Set every simulated row's ``saved_act_x_cp`` to its saved activations x cp over its
    sequence's cp-2 row's (cp 2 rather than cp 1: at world size 1 FSDP2 makes the head's bf16
    copy outside its all-gather region, so cp 1 counts it as an activation), or over the
    smallest cp simulated when cp 2 is not; runs of parts of the grid then agree."""
    done = [r for r in rows if r.get("status") == "simulated"]
    base = {}
    for r in sorted(done, key=lambda r: (r["cp"] != 2, r["cp"])):
        base.setdefault((r["model"], r["seq"]), r["saved_act_GiB"] * r["cp"])
    for r in done:
        r["saved_act_x_cp"] = r["saved_act_GiB"] * r["cp"] / base[(r["model"], r["seq"])]


def merge(rows: list[dict], parts: list[list[dict]]) -> list[dict]:
    """``rows`` with every simulated row of ``parts`` in place of its (model, seq, cp) row (or
    added), in the grid's order: model, length, text then video, cp ascending."""
    by_key = {_key(r): r for r in rows}
    for part in parts:
        by_key.update({_key(r): r for r in part if r.get("status") == "simulated"})

    def order(key):
        model, seq, cp = key
        kind, length = seq.split()
        rank = MODELS.index(model) if model in MODELS else len(MODELS)
        return rank, model, LENGTHS[length], kind != "text", cp

    out = [by_key[k] for k in sorted(by_key, key=order)]
    _ratios(out)
    return out


def markdown(rows: list[dict]) -> str:
    """Two tables: the per-rank peak (GiB) of every (model, sequence) at every cp, "-" where
    not simulated and bold where it fits 80 GB; and per model and kind the longest trainable
    sequence at every cp, extrapolated from the longest length simulated at that cp."""
    done = {_key(r): r for r in rows if r.get("status") == "simulated"}
    cps = sorted({r["cp"] for r in rows})
    seqs = list(dict.fromkeys((r["model"], r["seq"]) for r in rows))
    head = (
        "| model | sequence | " + " | ".join(f"cp {c}" for c in cps) + " | activations bound from |"
    )
    lines = [head, "|" + "---|" * (len(cps) + 3)]
    for model, seq in seqs:
        cells, first_act = [], None
        for c in cps:
            r = done.get((model, seq, c))
            if r is None:
                cells.append("-")
                continue
            cells.append(f"**{r['peak_GiB']:.1f}**" if r["fits"] else f"{r['peak_GiB']:.1f}")
            if first_act is None and r["bound"] == "activations":
                first_act = c
        bound = f"cp {first_act}" if first_act else ("-" if "-" in cells else "none")
        lines.append(f"| {model} | {seq} | " + " | ".join(cells) + f" | {bound} |")
    lines += ["", "| model | kind | from | " + " | ".join(f"cp {c}" for c in cps) + " |"]
    lines.append("|" + "---|" * (len(cps) + 3))
    for model in dict.fromkeys(m for m, _ in seqs):
        for kind in ("text", "video"):
            cells, used = [], []
            for c in cps:  # at each cp, from its longest simulated length
                ok = [s for m, s in seqs if m == model and s.startswith(kind)]
                ok = [s for s in ok if (model, s, c) in done]
                if not ok:
                    cells.append("-")
                    continue
                seq = max(ok, key=lambda s: LENGTHS[s.split()[1]])
                used.append(seq.split()[1])
                r = done[(model, seq, c)]
                cells.append(f"{r['longest']:,}" if r["longest"] else "none")
            if used:
                span = "/".join(dict.fromkeys(used))
                lines.append(f"| {model} | {kind} | {span} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(rows, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    models = list(dict.fromkeys(r["model"] for r in rows if r.get("status") == "simulated"))
    if not models:
        print("no simulated point: no plot")
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        lines = {}
        for r in rows:
            if r.get("status") == "simulated" and r["model"] == model:
                lines.setdefault(r["seq"], []).append((r["cp"], r["peak_GiB"]))
        for seq, pts in lines.items():
            style = "-" if seq.startswith("text") else "--"
            ax.plot(*zip(*sorted(pts)), style, marker="o", label=seq)
        ax.axhline(GPU_GIB, color="k", linestyle=":", linewidth=1, label="80 GB")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("cp (dp = 1, FSDP2 over the cp ranks)")
        ax.set_ylabel("per-rank peak (GiB)")
        ax.set_title(f"{model}, simulated rank")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
