"""Data planning per rank against dp 1 to 16: every rank planning every sample (before) against
planning split over DP (after), and against a source that knows its samples' sizes.

    python benchmarks/host_data.py   # the committed run (best of 3): ~15 minutes on 2 busy cores
    python benchmarks/host_data.py --quick --out-dir DIR  # dp 1 2 4, one repeat: a trial

The data of ``benchmarks/data.py`` (JPEG photos of 320x240 to 1920x1080 pixels, videos as
frame folders, text-only samples) planned by the tiny Qwen3-VL checkpoint's processor (chat
template, tokenizer, image headers): rows of 4096 tokens, packing windows of 64 samples, 16
rows a step over all DP ranks (R = 16 / dp each), the same steps at every dp.

The DP ranks of one CP slice run as threads of this process, each with its own ``RankLoader``
(the same code as ``cpvlm train``), exchanging through queues instead of a gloo group (the
plans are pickled as they would be for the wire); a rank's planning time is its thread's CPU
seconds for the steps (``time.thread_time``: planning, packing, dealing, pickling), best of the
repeats (the repeats go round every dp and mode in turn, so that a slow spell of a shared
machine falls on all of them). Milliseconds per rank and step window, the slowest rank. Columns:
- before: every rank plans every sample (``exchange=None``, what every rank did before);
- split: DP rank d plans window positions d, d + dp, ..., the metas and then the plans are
  exchanged (``DPExchange``'s protocol);
- metas: the source knows each sample's ``SampleMeta`` (a prepared cache): a rank plans only
  the samples of its own rows.
``split_plan_ms``: of ``split_ms``, the time in the processor's ``plan`` alone (no exchange, no
packing or pickling). plan calls are counted (``RowStream.plan_calls``); ``*_ratio``: to dp 1,
ideal 1/dp; ``*_vs_ideal``: ratio x dp (1 is exactly 1/dp; the issue asks 0.8..1.2 at dp <= 8).
"""

from __future__ import annotations

import pickle
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

    def rank_view(self, rank: int):
        ex = self

        class View:
            size = ex.size

            def gather(self, obj):
                ex._slots[rank] = pickle.dumps(obj)
                ex._barrier.wait()
                out = [pickle.loads(b) for b in ex._slots]
                ex._barrier.wait()
                return out

            def swap(self, outgoing):
                ex._slots[rank] = [None if o is None else pickle.dumps(o) for o in outgoing]
                ex._barrier.wait()
                out = [None if s[rank] is None else pickle.loads(s[rank]) for s in ex._slots]
                ex._barrier.wait()
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


def _rank_work(encoder, source, dp, d, steps, exchange, out):
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
    else:  # no exchange: each rank alone, one after the other
        for d in range(dp if mode == "metas" else 1):
            _rank_work(encoder, source, dp, d, steps, None, out)
        out = [x for x in out if x is not None]
    return out


def main():
    from data import MAX_PIXELS, VIDEO_MAX_PIXELS, make_data
    from transformers import AutoConfig

    from cpvlm.data import open_source
    from cpvlm.data.rows import meta_of
    from cpvlm.integrations.hf.processor import ChatEncoder
    from cpvlm.integrations.hf.tiny_checkpoint import make_tiny_checkpoint

    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dp", type=int, nargs="+", default=DP)
    p.add_argument("--quick", action="store_true", help="dp 1 2 4, one repeat")
    args = p.parse_args()
    if args.quick:
        args.dp, args.repeats = [1, 2, 4], 1
    modes = ("before", "split", "metas")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        jsonl = make_data(root / "data", args.samples)
        ckpt = make_tiny_checkpoint(root / "ckpt", "qwen3_vl")
        encoder = ChatEncoder(
            ckpt, AutoConfig.from_pretrained(ckpt), max_pixels=MAX_PIXELS,
            video_max_pixels=VIDEO_MAX_PIXELS,
        )  # fmt: skip
        source = open_source(str(jsonl))
        metas = [meta_of(encoder.plan(source[i])) for i in range(len(source))]
        known = KnownMetas(source, metas)
        best: dict = {}  # (dp, mode): the ranks' results of the run whose slowest rank was fastest
        for _ in range(args.repeats):
            for dp in args.dp:
                for mode, src in zip(modes, (source, source, known)):
                    got = _run(encoder, src, dp, args.steps, mode)
                    old = best.get((dp, mode))
                    if old is None or max(g[0] for g in got) < max(g[0] for g in old):
                        best[dp, mode] = got
        results = []
        for dp in args.dp:
            row = {"dp": dp}
            for mode in modes:
                got = best[dp, mode]
                row[f"{mode}_ms"] = 1e3 * max(g[0] for g in got)
                row[f"{mode}_calls"] = max(g[1] for g in got)
                if mode != "before":
                    row[f"{mode}_calls_mean"] = sum(g[1] for g in got) / len(got)
                if mode == "split":
                    row["split_plan_ms"] = 1e3 * max(g[3] for g in got)
            row["docs"] = sum(g[2] for g in best[dp, "split"])
            results.append(row)
    base = results[0] if results[0]["dp"] == 1 else None
    for r in results:
        r["ideal"] = 1 / r["dp"]
        if not base:
            continue
        for mode in ("before", "split", "split_plan", "metas"):
            r[f"{mode}_ratio"] = r[f"{mode}_ms"] / base[f"{mode}_ms"]
        for mode in ("split", "split_plan", "metas"):
            r[f"{mode}_vs_ideal"] = r[f"{mode}_ratio"] * r["dp"]
    cols = ["dp", "before_ms", "split_ms", "split_plan_ms", "metas_ms"]
    cols += ["before_calls", "split_calls", "metas_calls", "ideal"]
    cols += ["before_ratio", "split_ratio", "metas_ratio"]
    cols += ["split_vs_ideal", "split_plan_vs_ideal", "metas_vs_ideal"]
    print_table(results, cols, "data planning per rank (slowest rank; CPU ms of the steps)")
    if base:
        near = [r for r in results if r["dp"] <= 8]
        worst = max(near, key=lambda r: abs(r["split_vs_ideal"] - 1))
        print(
            f"split planning vs 1/dp at dp <= 8: worst {worst['split_vs_ideal']:.2f} at dp "
            f"{worst['dp']} ({'within' if abs(worst['split_vs_ideal'] - 1) <= 0.2 else 'outside'}"
            " 20%)"
        )
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
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
