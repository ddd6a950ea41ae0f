"""`cpvlm train` at a fixed global batch: tokens/s and memory per rank, where a step's time goes.

    python benchmarks/train.py                  # about 3 minutes on 2 idle CPU cores
    python benchmarks/train.py --part profile   # about 2 minutes: CP 1 and 2 under torch.profiler
    python benchmarks/train.py --cp 2 --seq-len 512 --steps 3 --out-dir DIR  # a trial run

Part "sweep" (the default; ``train.json``, and ``train.png`` where matplotlib is installed), CP
1, 2, 4 and the modes. Every row is one run of the trainer as a user starts it, in its own
processes: ``python -m cpvlm.train --seq-len 8192 --steps 10 --cp N [--vision ...] [--attn ...]``
(tiny Qwen3-VL, float32, synthetic image/video/text data, FSDP2 over the CP ranks, dp = 1,
``--pack-window 1024`` so that the ~70-token samples fill the rows), read back from its
``metrics.jsonl``. The global batch is the same in every row: one packed row of 8192
tokens per step, split over the CP ranks. Rows: the CP sweep with the defaults (vision route, ring
attention), then at the largest CP the other vision modes (allgather, replicate) and the
all-gather attention. At CP = 1 the modes are all the same single-rank computation.

Columns:
- tok/s: real tokens per second of wall time, the median over the steps after ``WARMUP`` (the
  first steps pay one-time setup); "x ref" is the ratio to the reference row (CP = 1 for the
  sweep, the default route + ring row at the same CP for the modes).
- base_MiB: a rank's resident memory when training starts (interpreter, torch, the model, the
  process group), ``mem_start_mib`` of step 1; the same at every CP.
- step1_MiB: what the first step adds at its peak on a rank, ``mem_peak_mib - mem_start_mib`` of
  step 1 (each the max over ranks): activations, gradients, optimizer state, communication
  buffers, in a process whose allocator has not yet kept freed memory.
- short_MiB: step1_MiB of the same run with rows of ``SHORT_SEQ_LEN`` tokens, and seq_MiB =
  step1_MiB - short_MiB: the part that grows with the sequence. Its "x ref" against ideal = 1/cp
  is the scaling figure. short_MiB (library and allocator working memory, gradients and
  optimizer state of this 0.25M-parameter model) does not shrink with CP, nor does the part of
  seq_MiB that every rank of a row holds whole: the row's inputs (pixels, ids; ~5 MiB at 8192).
- train_MiB: the peak over all steps minus base_MiB, the memory the job needed. On CPU it creeps
  up over the steps as the allocator keeps freed memory, more where more was freed, so its
  ratios sit above step1's.
The memory is the process's resident set (VmHWM, reset every step; see
``cpvlm.train.metrics.StepMemory``): CPU has no allocator counter. For exact per-rank tensor bytes
of one forward+backward, see benchmarks/memory.py.

Threads: the launcher gives each rank max(1, cores // ranks) torch threads. On this 2-core
machine CP = 1 is one process with 2 threads, CP = 2 two processes with 1 thread each, CP = 4
four processes with 1 thread each sharing the 2 cores. So tok/s compares the overhead of CP (its
collectives, smaller kernels, 2x oversubscription at CP = 4) at a fixed core count, not scaling
over more devices. The load average of the machine is recorded before and after: other work on
the machine makes tok/s noisy, the memory much less so.

Part "profile" (``train_profile.json``): each CP size is one run of the trainer's own loop
(``cpvlm.train.loop.train_rank``, the run of the sweep: tiny Qwen3-VL, float32, synthetic data,
one packed row of ``--seq-len`` tokens per step, FSDP2 over the CP ranks, the launcher's threads
per rank) in fresh processes under ``torch.profiler``. The loop and ``ContextParallelVLM`` mark
their phases with ``record_function`` ("cpvlm.*" ranges); every profiled operator's own time (its
time minus its children's) is put in one bucket by where it ran:

- data: waiting for the loader's rows (and the agreement on decode failures);
- prepare: positions, labels and the plan on the full integer sequence (replicated on every
  rank), and sharding them;
- vision: the tower and EncoderDataParallel's collectives, forward and backward (backward ops are
  matched to their forward op by autograd's sequence number);
- attention compute / attention comm: the CP attention's kernels, and its sends, receives and
  waits (what the ring did not hide behind compute);
- decoder: everything else in the text model and lm head, forward and backward (linear layers,
  norms, rotary, the MLP);
- loss: the token-mean cross-entropy;
- fsdp: FSDP2's parameter all-gathers, gradient reduce-scatters and their copies;
- optimizer: gradient norm, clipping, AdamW;
- stats: the step's statistics all-reduce and the memory probe;
- python: time inside the step that no operator accounts for (the interpreter between ops, module
  hooks, transformers' own Python).

The profiler adds a few microseconds per operator, the same at every CP. Times are wall-clock
on the rank's main thread; with other work on the machine a rank waits for a core inside any
bucket, so the load average is printed with the figures. Per bucket the table gives
milliseconds per step (median over the measured steps of the mean over ranks) and the CP=2 -
CP=1 difference; tokens/s and the profile come from the same steps. The per-rank figures and the
own time of every range (the Python between the ops inside it, or a wait) go to
``train_profile.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import cores, parser, print_table, pyplot, save_figure, write_json

SEQ_LEN = 8192
STEPS = 10
WARMUP = 2  # steps left out of the throughput: the first pays process and kernel warm-up
SHORT_SEQ_LEN = 256  # one-step runs that measure what does not grow with the sequence
PACK_WINDOW = 1024  # samples packed together: ~9 rows of 8192 tokens, so rows are ~95% full
QUIET_LOAD = 1.0  # a 1-minute load average above this disturbs tok/s: say so
DEFAULTS = {"vision": "route", "attn": "ring"}
MODES = [{"vision": "allgather"}, {"vision": "replicate"}, {"attn": "allgather"}]
PARTS = {  # part -> (default --cp, default --steps)
    "sweep": ([1, 2, 4], STEPS),
    "profile": ([1, 2], 6),
}


def flags(run: dict, seq_len: int, steps: int) -> list[str]:
    return [
        "--cp", str(run["cp"]), "--vision", run["vision"], "--attn", run["attn"],
        "--seq-len", str(seq_len), "--steps", str(steps), "--device", "cpu",
        "--pack-window", str(PACK_WINDOW),
        "--layout", "balanced",  # as the README table was measured (the default: head_tail)
    ]  # fmt: skip


def train(run: dict, seq_len: int, steps: int) -> list[dict]:
    """One `cpvlm train` run in fresh processes; its metrics.jsonl records."""
    with tempfile.TemporaryDirectory(prefix="cpvlm-bench-train-") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "cpvlm.train", *flags(run, seq_len, steps), "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd[1:])} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def first_step_mib(records: list[dict]) -> float:
    return records[0]["mem_peak_mib"] - records[0]["mem_start_mib"]


def summarize(run: dict, records: list[dict]) -> dict:
    steady = records[WARMUP:]
    base = records[0]["mem_start_mib"]
    peak = max(r["mem_peak_mib"] for r in records)
    return {
        **run,
        "ranks": records[0]["ranks"],
        "threads/rank": max(1, cores() // records[0]["ranks"]),
        "tok/s": statistics.median(r["tokens_per_s"] for r in steady),
        "tok/s_min": min(r["tokens_per_s"] for r in steady),
        "tok/s_max": max(r["tokens_per_s"] for r in steady),
        "s/step": statistics.median(r["step_time_s"] for r in steady),
        "base_MiB": base,
        "step1_MiB": first_step_mib(records),
        "peak_MiB": peak,
        "train_MiB": peak - base,
        "loss_last": records[-1]["loss"],
        "steps_measured": len(steady),
    }


def with_ratios(row: dict, ref: dict) -> dict:
    return {
        **row,
        "ref": ref["name"],
        "tok/s x ref": row["tok/s"] / ref["tok/s"],
        "step1 x ref": row["step1_MiB"] / ref["step1_MiB"],
        "train x ref": row["train_MiB"] / ref["train_MiB"],
    }


def plot(sweep: list[dict], modes: list[dict], short_len: int, title: str, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    from matplotlib.patches import Patch

    rows = sweep + modes[1:]
    labels = [f"CP{r['cp']}\nvision {r['vision']}\nattn {r['attn']}" for r in rows]
    x = list(range(len(rows)))
    colors = ["tab:blue"] * len(sweep) + ["tab:green"] * (len(rows) - len(sweep))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(14, 5))
    tok = [r["tok/s"] for r in rows]
    err = [[r["tok/s"] - r["tok/s_min"] for r in rows], [r["tok/s_max"] - r["tok/s"] for r in rows]]
    ax_t.bar(x, tok, color=colors)
    ax_t.errorbar(x, tok, yerr=err, fmt="none", ecolor="black", capsize=3)
    ax_t.set_ylabel("tokens/s, whole job (median; bars: min-max)")
    ax_t.set_title("throughput at a fixed global batch")
    n = len(sweep)
    short = [r["short_MiB"] for r in sweep]
    ax_m.bar(range(n), short, color="lightgray", label=f"same run at {short_len} tokens")
    ax_m.bar(range(n), [r["seq_MiB"] for r in sweep], bottom=short, color="tab:blue")
    ax_m.bar(x[n:], [r["step1_MiB"] for r in rows[n:]], color="tab:green")
    ideal = [b + sweep[0]["seq_MiB"] * r["ideal"] for b, r in zip(short, sweep)]
    ax_m.plot(range(n), ideal, "k_", markersize=30, mew=2, label="gray + CP=1's blue / cp")
    ax_m.plot(x, [r["train_MiB"] for r in rows], "kx", label="peak over all steps")
    for i, r in enumerate(rows):
        ratio = r["seq x ref"] if i < n else r["step1 x ref"]
        ax_m.text(i, r["step1_MiB"], f"{ratio:.2f}x", ha="center", va="bottom")
    base = max(r["base_MiB"] for r in rows)
    ax_m.set_ylabel("MiB per rank above the start (peak RSS, max over ranks)")
    ax_m.set_title(f"memory per rank, step 1 (base ~{base:.0f} MiB/process not shown)")
    handles = [Patch(color="tab:blue", label="CP sweep, grows with the sequence: ratio to CP=1")]
    if len(modes) > 1:
        handles.append(Patch(color="tab:green", label=f"modes: ratio to {modes[0]['name']}"))
    handles += ax_m.get_legend_handles_labels()[0]
    ax_m.legend(handles=handles, loc="upper right", fontsize=8)
    for ax in (ax_t, ax_m):
        ax.set_xticks(x, labels, fontsize=7.5)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def sweep_main(args) -> None:
    top = max(args.cp)
    runs = [{"cp": cp, **DEFAULTS} for cp in args.cp]
    runs += [{"cp": top, **DEFAULTS, **mode} for mode in MODES] if top > 1 else []
    load_before = os.getloadavg()
    if load_before[0] > QUIET_LOAD:
        print(f"note: load average {load_before[0]:.1f} on {cores()} cores: other work will "
              "disturb tok/s (CP=1's 2 threads most)", flush=True)  # fmt: skip
    t_start = time.perf_counter()
    rows = []
    for run in runs:
        t0 = time.perf_counter()
        row = summarize(run, train(run, args.seq_len, args.steps))
        row["name"] = f"CP{run['cp']} {run['vision']} {run['attn']}"
        row["command"] = "cpvlm train " + " ".join(flags(run, args.seq_len, args.steps))
        rows.append(row)
        print(f"{row['name']}: {row['tok/s']:,.0f} tok/s, peak {row['peak_MiB']:.0f} MiB, "
              f"run {time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
    for row in rows[: len(args.cp)]:
        t0 = time.perf_counter()
        row["short_MiB"] = first_step_mib(train(row, args.short_seq_len, 1))
        row["seq_MiB"] = row["step1_MiB"] - row["short_MiB"]
        print(f"{row['name']} at {args.short_seq_len} tokens: step 1 {row['short_MiB']:.0f} "
              f"MiB, run {time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
    load_after = os.getloadavg()

    first = rows[0]
    sweep = [with_ratios(r, first) for r in rows[: len(args.cp)]]
    for r in sweep:
        r["ideal"] = first["cp"] / r["cp"]
        r["seq x ref"] = r["seq_MiB"] / first["seq_MiB"]
    ref = sweep[-1]
    modes = [with_ratios(r, ref) for r in [ref, *rows[len(args.cp) :]]]

    n = cores()
    setting = (
        f"{n} cores, {os.cpu_count()} CPUs; threads per rank = max(1, {n} // ranks); "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print()
    print(f"cpvlm train, qwen3-vl-tiny float32, one row of {args.seq_len} tokens per step "
          f"(fixed global batch), {args.steps} steps, tok/s = median of the last "
          f"{args.steps - WARMUP}; {setting}")  # fmt: skip
    print()
    print_table(
        sweep,
        ["cp", "ranks", "threads/rank", "tok/s", "tok/s x ref", "base_MiB", "step1_MiB",
         "short_MiB", "seq_MiB", "seq x ref", "ideal", "train_MiB", "train x ref"],
        title=f"CP sweep (vision {DEFAULTS['vision']}, attn {DEFAULTS['attn']}); "
        f"x ref = ratio to CP=1; seq_MiB = step1_MiB - short_MiB (the same run at "
        f"{args.short_seq_len} tokens); ideal = 1/cp",
    )  # fmt: skip
    if len(modes) > 1:
        print()
        print_table(
            modes,
            ["cp", "vision", "attn", "tok/s", "tok/s x ref", "step1_MiB", "step1 x ref",
             "train_MiB", "train x ref"],
            title=f"modes at CP={top}; x ref = ratio to {ref['name']}",
        )  # fmt: skip
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s")

    write_json(
        args.out_dir,
        "train",
        {
            "config": {
                "model": "qwen3-vl-tiny",
                "dtype": "float32",
                "data": "synthetic",
                "seq_len": args.seq_len,
                "short_seq_len": args.short_seq_len,
                "rows_per_step": 1,
                "steps": args.steps,
                "warmup_steps": WARMUP,
                "data_parallel": "fsdp (over the cp ranks; dp = 1)",
                "cores": n,
                "threads_per_rank": "max(1, cores // ranks) (cpvlm.train.launcher)",
                "load_average_before": load_before,
                "load_average_after": load_after,
                "tok/s": "median over steps after warm-up of real tokens / step wall time",
                "memory": "process resident set per rank (VmHWM reset each step), max over ranks; "
                "step1_MiB = peak - start of step 1; short_MiB = step1_MiB of the same run "
                "at short_seq_len; seq_MiB = step1_MiB - short_MiB; train_MiB = peak over all "
                "steps - start of step 1",
            },
            "sweep": sweep,
            "modes": modes,
        },
    )
    plot(
        sweep,
        modes,
        args.short_seq_len,
        f"cpvlm train, qwen3-vl-tiny fp32, {args.seq_len} tokens/step at every CP; {setting}",
        args.out_dir / "train.png",
    )


# ---- part "profile": where a step's time goes ----------------------------------------------

BUCKETS = (
    "data", "prepare", "vision", "attention compute", "attention comm", "decoder", "loss",
    "fsdp", "optimizer", "stats", "other comm", "python",
)  # fmt: skip
COMM = (
    "gloo", "c10d", "nccl", "all_reduce", "allreduce", "all_gather", "allgather",
    "reduce_scatter", "alltoall", "all_to_all", "send", "recv", "barrier", "broadcast",
    "record_param_comms", "cpvlm.attention.wait",
)  # fmt: skip
PHASES = {  # innermost cpvlm range -> bucket
    "cpvlm.data": "data",
    "cpvlm.labels": "prepare",
    "cpvlm.prepare": "prepare",
    "cpvlm.vision": "vision",
    "cpvlm.attention": "attention compute",
    "cpvlm.attention.backward": "attention compute",
    "cpvlm.decoder": "decoder",
    "cpvlm.loss": "loss",
    "cpvlm.optimizer": "optimizer",
    "cpvlm.stats": "stats",
}
OWN_TIME = {"cpvlm.data": "data", "cpvlm.attention.wait": "attention comm"}


def _is_comm(name: str) -> bool:
    low = name.lower()
    return any(c in low for c in COMM)


def _bucket(name: str, ctx: str | None, fsdp: bool) -> str:
    """The bucket of one operator's own time, from its name and the ranges it runs in."""
    if fsdp:
        return "fsdp"
    if _is_comm(name):
        if ctx == "attention compute":
            return "attention comm"
        return ctx if ctx in ("vision", "data", "stats", "optimizer", "prepare") else "other comm"
    return ctx or "decoder"


def _self_us(e) -> float:
    return e.cpu_time_total - sum(c.cpu_time_total for c in e.cpu_children)


def _walk(e, ctx, fsdp, seq_ctx, out, backward):
    """Add ``e``'s own time and its children's to ``out`` (bucket -> us)."""
    name = e.name
    if name in PHASES:
        ctx = PHASES[name]
    if name.startswith("FSDP::"):
        fsdp = True
    if name.startswith("autograd::engine::evaluate_function"):
        # A backward node: the bucket of the forward op that made it.
        backward = True
        ctx = seq_ctx.get(e.sequence_nr, ctx) if ctx != "attention compute" else ctx
    elif not backward and e.sequence_nr >= 0 and ctx is not None:
        seq_ctx.setdefault(e.sequence_nr, ctx)
    if name.startswith("cpvlm.") or name.startswith("FSDP::"):
        # A range's own time: the interpreter between the ops inside it, except where the range
        # is a wait (for the loader's rows, a ring message, an FSDP collective).
        own = OWN_TIME.get(name, "fsdp" if fsdp else "python")
        key = "range " + name.split(" (")[0]  # FSDP names carry the module: one key per kind
        out[key] = out.get(key, 0.0) + _self_us(e)
    else:
        own = _bucket(name, ctx, fsdp)
    out[own] = out.get(own, 0.0) + _self_us(e)
    for c in e.cpu_children:
        _walk(c, ctx, fsdp, seq_ctx, out, backward)


def analyse(events) -> list[dict]:
    """Per step (in order): wall ms and ms per bucket."""
    steps = sorted((e for e in events if e.name == "cpvlm.step"), key=lambda e: e.time_range.start)
    result = []
    for step in steps:
        out, seq_ctx = {}, {}
        # Forward ops of this step come before its backward ops: one pass records the forward
        # ranges' sequence numbers, the backward nodes then look theirs up.
        _walk(step, None, False, seq_ctx, out, False)
        row = {b: v / 1e3 for b, v in out.items() if b.startswith("range ")}
        row.update({b: out.get(b, 0.0) / 1e3 for b in BUCKETS})
        row["wall"] = step.cpu_time_total / 1e3
        result.append(row)
    return result


def _profiled_rank(index: int, cp: int, seq_len: int, steps: int, threads: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from cpvlm.train import TrainConfig, launcher
    from cpvlm.train.loop import train_rank

    torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(tmp, "store"), cp)
    dist.init_process_group("gloo", store=store, rank=index, world_size=cp)
    config = TrainConfig().replace(
        model={"name": "qwen3-vl-tiny", "dtype": "float32"},
        parallel={"cp": cp},
        data={"seq_len": seq_len, "pack_window": PACK_WINDOW},  # as the sweep: full rows
        run={"steps": steps, "out": os.path.join(tmp, "run"), "device": "cpu"},
    )
    config, _, _ = launcher.prepare(config, world_size=cp)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_rank(config, torch.device("cpu"))
    rows = analyse(prof.events())
    lines = Path(tmp, "run", "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    Path(tmp, f"rank{index}.json").write_text(json.dumps({"steps": rows, "records": records}))
    dist.destroy_process_group()


def profile_cp(cp: int, seq_len: int, steps: int, n_cores: int) -> dict:
    """Per-rank profiles of one `cpvlm train` run at ``cp`` (threads as the launcher gives)."""
    import torch.multiprocessing as tmp_mp

    threads = max(1, n_cores // cp)
    with tempfile.TemporaryDirectory(prefix="cpvlm-train-profile-") as tmp:
        tmp_mp.start_processes(
            _profiled_rank, args=(cp, seq_len, steps, threads, tmp), nprocs=cp, start_method="spawn"
        )
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(cp)]
    records = ranks[0]["records"][WARMUP:]
    per_bucket = {}
    keys = {k for r in ranks for st in r["steps"] for k in st}
    for b in sorted(keys):
        # the mean over ranks of each step's time (wall: the max), then the median over steps
        agg = max if b == "wall" else statistics.mean
        per_step = [agg(r["steps"][s].get(b, 0.0) for r in ranks) for s in range(WARMUP, steps)]
        per_bucket[b] = statistics.median(per_step)
    return {
        "cp": cp,
        "threads/rank": threads,
        "tok/s": statistics.median(r["tokens_per_s"] for r in records),
        "ms": per_bucket,
        "per_rank": [r["steps"][WARMUP:] for r in ranks],
    }


def profile_main(args) -> None:
    n = cores()
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    runs = [profile_cp(cp, args.seq_len, args.steps, n) for cp in args.cp]
    load_after = os.getloadavg()
    ref = runs[0]
    table = []
    for b in (*BUCKETS, "wall"):
        row = {"bucket": b}
        for r in runs:
            row[f"CP{r['cp']} ms"] = r["ms"][b]
            if r is not ref:
                row[f"CP{r['cp']} - CP{ref['cp']}"] = r["ms"][b] - ref["ms"][b]
        table.append(row)
    setting = (
        f"{n} cores; threads per rank = max(1, {n} // cp); load average {load_before[0]:.1f} "
        f"before, {load_after[0]:.1f} after"
    )
    print(f"cpvlm train step profile, qwen3-vl-tiny float32, {args.seq_len} tokens per step, "
          f"median of steps {WARMUP + 1}..{args.steps}; {setting}\n")  # fmt: skip
    cols = ["bucket", *(k for k in table[0] if k != "bucket")]
    print_table(table, cols, title="ms per step by bucket (mean over ranks; wall: the max)")
    top = runs[-1]
    ranges = sorted(
        ((k, v) for k, v in top["ms"].items() if k.startswith("range ")), key=lambda kv: -kv[1]
    )[:8]
    print()
    print_table(
        [{"range": k.removeprefix("range "), "ms": v} for k, v in ranges],
        ["range", "ms"],
        title=f"CP{top['cp']}: own time of the ranges (Python between ops, or a wait)",
    )
    print()
    print_table(
        [
            {
                "cp": r["cp"],
                "threads/rank": r["threads/rank"],
                "tok/s": r["tok/s"],
                f"x CP{ref['cp']}": r["tok/s"] / ref["tok/s"],
            }
            for r in runs
        ],
        ["cp", "threads/rank", "tok/s", f"x CP{ref['cp']}"],
        title="throughput of the profiled runs (the profiler's per-op cost included)",
    )
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s")
    write_json(
        args.out_dir,
        "train_profile",
        {
            "config": {
                "model": "qwen3-vl-tiny",
                "dtype": "float32",
                "seq_len": args.seq_len,
                "steps": args.steps,
                "warmup_steps": WARMUP,
                "cores": n,
                "load_average_before": load_before,
                "load_average_after": load_after,
                "buckets": "see the module docstring of benchmarks/train.py, part profile",
            },
            "runs": runs,
        },
    )


def main():
    p = parser(__doc__)
    p.add_argument("--part", choices=list(PARTS), default="sweep", help="see the docstring")
    p.add_argument("--cp", type=int, nargs="+", help="CP sizes (sweep: 1 2 4; profile: 1 2)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--steps", type=int, help=f"sweep: {STEPS}; profile: {PARTS['profile'][1]}")
    p.add_argument("--short-seq-len", type=int, default=SHORT_SEQ_LEN, help="sweep only")
    args = p.parse_args()
    cp, steps = PARTS[args.part]
    args.cp = args.cp or cp
    args.steps = args.steps or steps
    if args.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps")
    if args.part == "sweep":
        sweep_main(args)
    else:
        profile_main(args)


if __name__ == "__main__":
    main()
