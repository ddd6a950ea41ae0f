"""Data planning per rank against dp 1 to 16: every rank planning every sample (before) against
planning split over DP (after), and against a source that knows its samples' sizes.

    python benchmarks/host_data.py   # the committed run (best of 2): ~12 minutes on 2 busy cores
    python benchmarks/host_data.py --samples 32 --dp 1 2 4 --repeats 1 --out-dir DIR  # a trial

The data of ``benchmarks/data.py`` (JPEG photos of 320x240 to 1920x1080 pixels, videos as
frame folders, text-only samples) planned by the tiny Qwen3-VL checkpoint's processor (chat
template, tokenizer, image headers): rows of 4096 tokens, packing windows of 64 samples, 16
rows a step over all DP ranks (R = 16 / dp each), the same steps at every dp.

The DP ranks of one CP slice run as threads of this process, each with its own ``RankLoader``
(the same code as ``cpvlm train``), exchanging through queues instead of a gloo group (the
plans are pickled as they would be for the wire); a rank's planning time is its thread's CPU
seconds for the steps (``time.thread_time``: planning, packing, dealing, pickling), best of the
repeats. Columns:
- before: every rank plans every sample (``exchange=None``, what every rank did before);
- split: DP rank d plans window positions d, d + dp, ..., the metas and then the plans are
  exchanged (``DPExchange``'s protocol);
- metas: the source knows each sample's ``SampleMeta`` (a prepared cache): a rank plans only
  the samples of its own rows.
plan calls are counted (``RowStream.plan_calls``); ratios are to dp 1, ideal 1/dp.
"""

from __future__ import annotations

import pickle
import tempfile
import threading
import time
from pathlib import Path

from _common import parser, print_table, write_json

SEQ_LEN, WINDOW, ROWS_PER_STEP = 4096, 64, 16


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


def _rank_work(encoder, source, dp, d, steps, exchange, out):
    from cpvlm.data import RankLoader, RowStream

    stream = RowStream(source, encoder.plan, seq_len=SEQ_LEN, window=WINDOW, seed=0)
    loader = RankLoader(
        stream, encoder.decode, encoder.ids, rows_per_step=ROWS_PER_STEP // dp,
        dp_rank=d, dp_size=dp, exchange=exchange,
    )  # fmt: skip
    jobs = loader._jobs()  # the sampler: planning, packing, the deal; no decoding
    t0 = time.thread_time()
    docs = sum(len(next(jobs).row.docs) for _ in range(steps * ROWS_PER_STEP // dp))
    out[d] = (time.thread_time() - t0, stream.plan_calls, docs)


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
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = p.parse_args()
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
        results = []
        for dp in args.dp:
            row = {"dp": dp}
            for mode, src in (("before", source), ("split", source), ("metas", known)):
                best = None
                for _ in range(args.repeats):
                    got = _run(encoder, src, dp, args.steps, mode)
                    seconds = max(g[0] for g in got)
                    best = got if best is None or seconds < max(g[0] for g in best) else best
                row[f"{mode}_s"] = max(g[0] for g in best)
                row[f"{mode}_calls"] = max(g[1] for g in best)
                if mode != "before":
                    row[f"{mode}_calls_mean"] = sum(g[1] for g in best) / len(best)
            row["docs"] = sum(g[2] for g in got)
            results.append(row)
    base = results[0] if results[0]["dp"] == 1 else None
    for r in results:
        r["ideal"] = 1 / r["dp"]
        for mode in ("before", "split", "metas"):
            if base:
                r[f"{mode}_ratio"] = r[f"{mode}_s"] / base[f"{mode}_s"]
        if base:
            r["split_vs_ideal"] = r["split_ratio"] * r["dp"]
            r["metas_vs_ideal"] = r["metas_ratio"] * r["dp"]
    cols = ["dp", "before_s", "split_s", "metas_s", "before_calls", "split_calls", "metas_calls"]
    cols += ["ideal", "split_ratio", "metas_ratio", "split_vs_ideal", "metas_vs_ideal"]
    print_table(results, cols, "data planning per rank (slowest rank; CPU s of the steps)")
    write_json(
        args.out_dir,
        "host_data",
        {
            "seq_len": SEQ_LEN,
            "window": WINDOW,
            "rows_per_step": ROWS_PER_STEP,
            "steps": args.steps,
            "samples": args.samples,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
