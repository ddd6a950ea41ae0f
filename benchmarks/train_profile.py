"""Where a `cpvlm train` step spends its time, per rank, at CP=1 and CP=2 on the same cores.

    python benchmarks/train_profile.py      # about 2 minutes on 2 idle CPU cores

Each CP size is one run of the trainer's own loop (``cpvlm.train.loop.train_rank``, the run of
benchmarks/train.py: tiny Qwen3-VL, float32, synthetic data, one packed row of ``--seq-len``
tokens per step, FSDP2 over the CP ranks, the launcher's threads per rank) in fresh processes
under ``torch.profiler``. The loop and ``ContextParallelVLM`` mark their phases with
``record_function`` ("cpvlm.*" ranges); every profiled operator's own time (its time minus its
children's) is put in one bucket by where it ran:

- data: waiting for the loader's rows (and the agreement on decode failures);
- prepare: positions, labels and the plan on the full integer sequence (replicated on every
  rank), and sharding them;
- vision: the tower and VisionDataParallel's collectives, forward and backward (backward ops are
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
benchmarks/results/train_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

SEQ_LEN = 8192
STEPS = 6
WARMUP = 2  # steps left out: the first pay process, allocator and kernel warm-up
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


def _rank(index: int, cp: int, seq_len: int, steps: int, threads: int, tmp: str) -> None:
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
        data={"seq_len": seq_len, "pack_window": 1024},  # as benchmarks/train.py: full rows
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


def profile_cp(cp: int, seq_len: int, steps: int, cores: int) -> dict:
    """Per-rank profiles of one `cpvlm train` run at ``cp`` (threads as the launcher gives)."""
    import torch.multiprocessing as tmp_mp

    threads = max(1, cores // cp)
    with tempfile.TemporaryDirectory(prefix="cpvlm-train-profile-") as tmp:
        tmp_mp.start_processes(
            _rank, args=(cp, seq_len, steps, threads, tmp), nprocs=cp, start_method="spawn"
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


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
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
                "buckets": "see the module docstring of benchmarks/train_profile.py",
            },
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
