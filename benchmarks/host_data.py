"""Data planning per rank against dp 1 to 16: every rank planning every sample (before) against
planning split over DP (after), and against a source that knows its samples' sizes.

    python benchmarks/host_data.py --steps 24 --repeats 3 --dp 1 2 4 8 16  # the committed run
    python benchmarks/host_data.py --quick --out-dir DIR  # dp 1 2 4, fewer samples: a trial

The data of ``benchmarks/data.py`` (JPEG photos of 320x240 to 1920x1080 pixels, videos as
frame folders, text-only samples; ``--samples`` distinct conversations, cycled by the stream's
epochs) planned by the tiny Qwen3-VL checkpoint's processor (chat template, tokenizer, image
headers): rows of 4096 tokens, packing windows of 64 samples, 16 rows a step over all DP ranks
(R = 16 / dp each), the same ``--steps`` at every dp: ~``--steps`` x 16 rows, about 3 samples a
row, so that even a dp-16 rank plans dozens of samples, not a handful.

The DP ranks of one CP slice run as threads of this process (every rank, dp 1 included), each with its own ``RankLoader``
(the same code as ``cpvlm train``), exchanging through queues instead of a gloo group (the
plans are pickled as they would be for the wire). A rank's time is its thread's CPU seconds for
the steps (``time.thread_time``: planning, packing, dealing, pickling; waiting is not counted);
one rank runs at a time: a rank holds a turn (one lock) from its start to its end and gives it up
only while it waits at an exchange, so that ranks never interleave between exchanges (as ranks on
their own hosts do not; threads interleaving call by call measured a plan call 20 to 50% dearer at
dp 2 to 16 than at dp 1 on a quiet machine), and the process is pinned to one core (``--no-pin``
leaves it on all: threads moved between cores find their caches cold). Each (dp, mode) is run
``--repeats`` times, the repeats going round every dp and mode in turn (a slow spell of a shared
machine falls on all of them); a rank's figure is its best over the repeats (``_best``). Columns:
- before: every rank plans every sample (``exchange=None``, what every rank did before);
- split: each DP rank plans the share of a window that ``plan_split`` deals it by estimated
  planning cost (``JsonlSource.plan_cost``: bytes and media references, known before planning),
  the metas and then the plans (``pack_plans``) are exchanged (``DPExchange``'s protocol);
- metas: the source knows each sample's ``SampleMeta`` (a prepared cache): a rank plans only
  the samples of its own rows.
``*_max_ms`` / ``*_mean_ms``: the slowest rank's and the ranks' mean milliseconds for the steps;
``split_plan_max_ms``: of those, the time in the processor's ``plan`` alone; ``*_calls``: plan calls
of the busiest rank (``RowStream.plan_calls``); ``plan_call_ms``: CPU ms per plan call (all ranks'
plan time over all their calls, split mode: the same samples at every dp, so a figure that moves
with dp says the machine, not the split, changed); ``split_imbalance``: slowest rank over mean
(samples differ tenfold in cost, 1 to 15 ms, text to 2500-token photo sets and videos; the deal
follows an estimate of that cost, not the cost); ``*_ratio``: to dp 1, ideal 1/dp; ``*_vs_ideal``: ratio x dp (1 is exactly 1/dp; the
issue asks 0.8..1.2 at dp <= 8), of the slowest rank (``max``) and of the mean rank (``mean``).
``load``: ``os.getloadavg()`` (1 min) at the start and end of the run.
"""

from __future__ import annotations

import gc
import os
import pickle
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import parser, print_table, write_json

SEQ_LEN, WINDOW, ROWS_PER_STEP, DP = 4096, 64, 16, [1, 2, 4, 8, 16]


class ThreadExchange:
    """``DPExchange``'s gather and swap between threads (one per DP rank), payloads pickled."""

    def __init__(self, size: int):
        self.size, self._barrier = size, threading.Barrier(size)
        self._slots: list = [None] * size

    def _wait(self):
        """The barrier, the rank's turn given up while it waits (``TURN``)."""
        TURN.release()
        try:
            self._barrier.wait()
        finally:
            TURN.acquire()

    def rank_view(self, rank: int):
        ex = self

        class View:
            size = ex.size

            def gather(self, obj):
                ex._slots[rank] = pickle.dumps(obj)
                ex._wait()
                out = [pickle.loads(b) for b in ex._slots]
                ex._wait()
                return out

            def swap(self, outgoing):
                ex._slots[rank] = [None if o is None else pickle.dumps(o) for o in outgoing]
                ex._wait()
                out = [None if s[rank] is None else pickle.loads(s[rank]) for s in ex._slots]
                ex._wait()
                return out

        return View()


class KnownMetas:
    """A source that knows its samples' sizes (as a prepared cache does)."""

    def __init__(self, source, metas):
        self.source, self.metas = source, metas

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        return self.source[i]

    def meta(self, i):
        return self.metas[i]


class TimedPlan:
    """``plan`` that adds up the calling thread's CPU seconds in it."""

    def __init__(self, plan):
        self.plan, self.seconds = plan, 0.0

    def __call__(self, record):
        t0 = time.thread_time()
        try:
            return self.plan(record)
        finally:
            self.seconds += time.thread_time() - t0


TURN = threading.Lock()  # the rank that runs; the others wait for it or at an exchange


def _rank_work(encoder, source, dp, d, steps, exchange, out):
    with TURN:
        _rank_steps(encoder, source, dp, d, steps, exchange, out)


def _rank_steps(encoder, source, dp, d, steps, exchange, out):
    from cpvlm.data import RankLoader, RowStream

    plan = TimedPlan(encoder.plan)
    stream = RowStream(source, plan, seq_len=SEQ_LEN, window=WINDOW, seed=0)
    loader = RankLoader(
        stream, encoder.decode, encoder.ids, rows_per_step=ROWS_PER_STEP // dp,
        dp_rank=d, dp_size=dp, exchange=exchange,
    )  # fmt: skip
    jobs = loader._jobs()  # the sampler: planning, packing, the deal; no decoding
    t0 = time.thread_time()
    docs = sum(len(next(jobs).row.docs) for _ in range(steps * ROWS_PER_STEP // dp))
    out[d] = (time.thread_time() - t0, stream.plan_calls, docs, plan.seconds)


def _run(encoder, source, dp, steps, mode):
    gc.collect()  # no collection of an earlier run's garbage inside this one's timings
    out = [None] * dp
    if mode == "split" and dp > 1:
        ex = ThreadExchange(dp)
        threads = [
            threading.Thread(
                target=_rank_work,
                args=(encoder, source, dp, d, steps, ex.rank_view(d), out),
            )
            for d in range(dp)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:  # no exchange: each rank alone, one after the other, in a thread as above (planning
        # in the main thread measured 5 to 20% more CPU per call: dp 1 would not compare)
        for d in range(dp if mode == "metas" else 1):
            t = threading.Thread(target=_rank_work, args=(encoder, source, dp, d, steps, None, out))
            t.start()
            t.join()
        out = [x for x in out if x is not None]
    return out


def _best(runs, field: int) -> list[float]:
    """Each rank's best (least) figure ``field`` over the repeats. A rank's work is the same in
    every repeat, so its least CPU time is the least disturbed measure of it; the slowest rank
    is then the max of these (a max over ranks of single noisy runs would grow with dp by the
    noise alone: this machine's CPU time for the same work varies by up to 30% run to run)."""
    return [min(run[d][field] for run in runs) for d in range(len(runs[0]))]


def _summary(runs, mode: str) -> dict:
    """One (dp, mode) over its repeats: each run is a list of per-rank results
    ``(cpu_s, plan_calls, docs, plan_s)``."""
    cpu = _best(runs, 0)
    out = {
        f"{mode}_max_ms": 1e3 * max(cpu),
        f"{mode}_mean_ms": 1e3 * statistics.mean(cpu),
        f"{mode}_calls": max(r[1] for r in runs[0]),
    }
    if mode == "split":
        plan, calls = _best(runs, 3), [r[1] for r in runs[0]]
        out["split_plan_max_ms"] = 1e3 * max(plan)
        out["split_plan_mean_ms"] = 1e3 * statistics.mean(plan)
        out["split_calls_total"] = sum(calls)
        out["plan_call_ms"] = 1e3 * sum(plan) / max(1, sum(calls))
        out["split_imbalance"] = max(cpu) / statistics.mean(cpu)
        out["docs"] = sum(r[2] for r in runs[0])
    return out


def main():
    from data import MAX_PIXELS, VIDEO_MAX_PIXELS, make_data
    from transformers import AutoConfig

    from cpvlm.data import open_source
    from cpvlm.data.rows import meta_of
    from cpvlm.integrations.hf.processor import ChatEncoder
    from cpvlm.integrations.hf.tiny_checkpoint import make_tiny_checkpoint

    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=160, help="distinct conversations")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dp", type=int, nargs="+", default=DP)
    p.add_argument("--quick", action="store_true", help="dp 1 2 4, 48 samples, 4 steps, 2 repeats")
    p.add_argument(
        "--no-pin", action="store_true", help="leave the process on every core it may use"
    )
    args = p.parse_args()
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        # One core for every rank's thread: a thread that the OS moves to the other core finds
        # its caches cold, which measured a plan call 20 to 35% dearer at dp >= 2 than at dp 1
        # (one thread, rarely moved) on this 2-core machine; ranks on their own hosts do not move.
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if args.quick:
        args.dp, args.samples, args.steps, args.repeats = [1, 2, 4], 48, 4, 2
    modes = ("before", "split", "metas")
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        jsonl = make_data(root / "data", args.samples)
        ckpt = make_tiny_checkpoint(root / "ckpt", "qwen3_vl")
        encoder = ChatEncoder(
            ckpt, AutoConfig.from_pretrained(ckpt), max_pixels=MAX_PIXELS,
            video_max_pixels=VIDEO_MAX_PIXELS,
        )  # fmt: skip
        source = open_source(str(jsonl))
        metas = [meta_of(encoder.plan(source[i])) for i in range(len(source))]  # also a warm-up
        known = KnownMetas(source, metas)
        runs: dict = {}  # (dp, mode): the ranks' results of every repeat
        for _ in range(args.repeats):
            for dp in args.dp:
                for mode, src in zip(modes, (source, source, known)):
                    runs.setdefault((dp, mode), []).append(_run(encoder, src, dp, args.steps, mode))
        results = []
        for dp in args.dp:
            row = {"dp": dp}
            for mode in modes:
                row.update(_summary(runs[dp, mode], mode))
            results.append(row)
    load.append(os.getloadavg()[0])
    base = results[0] if results[0]["dp"] == 1 else None
    ratios = ["before_max", "split_max", "split_mean", "split_plan_max", "metas_max"]
    for r in results:
        r["ideal"] = 1 / r["dp"]
        if not base:
            continue
        for name in ratios:
            r[f"{name}_ratio"] = r[f"{name}_ms"] / base[f"{name}_ms"]
        for name in ratios[1:]:
            r[f"{name}_vs_ideal"] = r[f"{name}_ratio"] * r["dp"]
    cols = ["dp", "before_max_ms", "split_max_ms", "split_mean_ms", "split_plan_max_ms"]
    cols += ["metas_max_ms", "before_calls", "split_calls", "metas_calls", "plan_call_ms"]
    cols += ["split_imbalance"]
    print_table(
        results,
        cols,
        "data planning per rank (CPU ms of the steps; each rank's best of the repeats)",
    )
    if base:
        cols = ["dp", "ideal", "before_max_ratio", "split_max_ratio", "split_max_vs_ideal"]
        cols += ["split_mean_vs_ideal", "split_plan_max_vs_ideal", "metas_max_vs_ideal"]
        print_table(results, cols, "against dp 1 (vs_ideal: ratio x dp)")
        near = [r for r in results if r["dp"] <= 8]
        for name in ("split_max", "split_mean"):
            worst = max(near, key=lambda r, n=name: abs(r[f"{n}_vs_ideal"] - 1))
            v = worst[f"{name}_vs_ideal"]
            print(
                f"{name} vs 1/dp at dp <= 8: worst {v:.2f} at dp {worst['dp']} "
                f"({'within' if abs(v - 1) <= 0.2 else 'outside'} 20%)"
            )
    print(f"load average (1 min): {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    write_json(
        args.out_dir,
        "host_data",
        {
            "seq_len": SEQ_LEN,
            "window": WINDOW,
            "rows_per_step": ROWS_PER_STEP,
            "steps": args.steps,
            "samples": args.samples,
            "repeats": args.repeats,
            "pinned_to_one_core": not args.no_pin,
            "load": load,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
