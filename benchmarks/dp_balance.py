"""DP balance: a step's rows dealt to DP ranks by tokens against by modelled cost, at dp 2, 4, 8,
on a long-tailed mix (a few long videos, many short image chats) and a text-heavy mix.

    python benchmarks/dp_balance.py             # about a minute (modelled costs)
    python benchmarks/dp_balance.py --measure   # and measured step times (~10 CPU minutes)

The rows are the stream ``cpvlm train`` makes (``RowStream``: seeded order, windows of 64
samples packed first-fit decreasing into rows of ``--seq-len`` tokens), from samples whose sizes
(``SampleMeta``) are drawn from the mix; each step takes the next R * dp rows (R rows per DP
rank: batch size x grad accumulation) and deals them by tokens (``dp_split``) or by cost
(``dp_deal``). The cost is ``RowCost`` of Qwen3-VL-8B's shape (text: 36 layers, hidden 4096, MLP
12288, 32 heads of 128, 8 KV heads, vocabulary 151936; vision: 27 blocks of 1152, MLP 4304,
patch 16, merge 2), in forward MACs. Per step: max/mean of the DP ranks' costs; the bound is what
whole rows allow (``deal_bound``: the rank with the costliest row holds R - 1 others). Figures are
means over the steps; "time lost" is sum(max) / sum(mean) - 1, the time the slowest replica makes
the others wait at the gradient sync, in the model.

Measured step time (``--measure``, CPU): the same stream at 1/4 of the size (``--scale 4``: rows
of seq_len / 4 tokens, image and frame sides / 2, text / 4) and a tiny Qwen3-VL whose modelled
shares of vision, attention and per-token decoder work on that stream resemble Qwen3-VL-8B's on
the full one (``TINY``). Each packed row runs as ``cpvlm train`` runs it, through
``ContextParallelVLM`` at cp 1 with its ``doc_lens`` (per-document attention), forward and
backward, timed in CPU seconds (``process_time``, one thread), median of ``--repeats`` taken round
all rows in turn; a DP rank's step time is the sum of its rows' (its rows run one after another,
as gradient accumulation does), so one process measures every rank of dp 2, 4, 8, and all deals
are timed on the same rows. Deals: by tokens (``dp_split``), by the tiny model's ``RowCost``
(what ``cpvlm train`` uses), by that cost plus a per-document constant ("fitted"), and by the
measured times themselves ("oracle", in hindsight: what whole rows allow). The constants come
from ``--calibration`` other rows (another seed's, each cut to a random number of its first
documents), fitted by least squares: seconds = a * MACs + b * documents + c; the same fit over
the parts (``PARTS``: decoder, attention and vision MACs, documents, the row) gives the measured
shares of step time. Figures: mean over steps of max/mean, and the correlation of modelled with
measured rank time over every (step, rank) of the token and cost deals.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time

from _common import parser, print_table, write_json

WINDOW = 64


def qwen3_vl_8b_config():
    from transformers import AutoConfig

    c = AutoConfig.for_model("qwen3_vl")
    t, v = c.text_config, c.vision_config
    t.hidden_size, t.intermediate_size, t.num_hidden_layers = 4096, 12288, 36
    t.num_attention_heads, t.num_key_value_heads, t.head_dim = 32, 8, 128
    t.vocab_size = 151936
    v.depth, v.hidden_size, v.intermediate_size, v.out_hidden_size = 27, 1152, 4304, 4096
    v.patch_size, v.spatial_merge_size = 16, 2
    return c


def _side(rng, lo, hi, scale):
    """An even side in patches, ``2 * randint(lo, hi)`` at scale 1, halved at scale 4."""
    return 2 * max(1, round(rng.randint(lo, hi) / math.sqrt(scale)))


def long_tailed(rng: random.Random, seq_len: int, scale: int = 1):
    """One sample in 40 a long video (12 to 24 frames of 24x32 to 32x48 patches: 1.7k to 4.6k
    tokens), the rest image chats (one or two images of 16x16 to 32x32 patches, 50 to 300 text
    tokens). ``scale``: tokens / scale (sides / sqrt(scale), text / scale)."""
    from cpvlm.data.meta import SampleMeta

    if rng.random() < 1 / 40:
        t = 2 * rng.randint(6, 12)
        h, w = _side(rng, 12, 16, scale), _side(rng, 16, 24, scale)
        tokens = t // 2 * h * w // 4 + rng.randint(50, 300) // scale
        if tokens <= seq_len:
            return SampleMeta(tokens, (), ((t // 2, h, w),))
    grids = tuple(
        (1, _side(rng, 8, 16, scale), _side(rng, 8, 16, scale)) for _ in range(rng.randint(1, 2))
    )
    return SampleMeta(sum(g[1] * g[2] // 4 for g in grids) + rng.randint(50, 300) // scale, grids)


def text_heavy(rng: random.Random, seq_len: int, scale: int = 1):
    """Text documents of log-normal length (median ~700 tokens, a long tail up to the row), one
    in six with an image of 16x16 to 32x32 patches (``scale`` as ``long_tailed``'s)."""
    from cpvlm.data.meta import SampleMeta

    tokens = min(seq_len, max(16, int(rng.lognormvariate(6.5, 1.0)) // scale))
    if rng.random() < 1 / 6:
        g = (1, _side(rng, 8, 16, scale), _side(rng, 8, 16, scale))
        if tokens + g[1] * g[2] // 4 <= seq_len:
            return SampleMeta(tokens + g[1] * g[2] // 4, (g,))
    return SampleMeta(tokens)


MIXES = {"long_tailed": long_tailed, "text_heavy": text_heavy}


class MetaOnly:
    """A source of sizes only: the stream is packed and dealt without planning."""

    def __init__(self, metas):
        self.metas = metas

    def __len__(self):
        return len(self.metas)

    def __getitem__(self, i):
        raise AssertionError("the benchmark never plans a sample")

    def meta(self, i):
        return self.metas[i]


def steps_of(metas, seq_len, per_step, steps, seed=0):
    from cpvlm.data import RowStream

    stream = RowStream(MetaOnly(metas), None, seq_len=seq_len, window=WINDOW, seed=seed)
    slots = stream.slots()
    return [[next(slots).slot for _ in range(per_step)] for _ in range(steps)]


TINY = {
    # text 3 layers of 256 (MLP 768, 2 heads of 32), vocabulary 2048; vision 1 block of 64 (MLP
    # 256), patch 8, merge 2: modelled shares like Qwen3-VL-8B's at scale 4 (chosen from a grid of
    # heads, depths, widths and vocabularies by the sum of share differences on both mixes)
    "text_config": {
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
    },
    "vision_config": {"depth": 1, "hidden_size": 64, "intermediate_size": 256, "num_heads": 2,
                      "out_hidden_size": 256, "deepstack_visual_indexes": [0]},
}  # fmt: skip
# what a row's measured time is fitted on (``row_parts``)
PARTS = ("token", "attention", "vision", "document", "row")


def shares(cost, docs) -> dict:
    """Fractions of the modelled cost of ``docs`` ((meta, tokens) pairs): decoder per token,
    attention pairs, vision tower."""
    token = sum(cost.token * n for _, n in docs)
    pair = sum(cost.pair * (n * (n + 1) // 2) for _, n in docs)
    vision = sum(cost.vision.unit_cost(g) for m, _ in docs for g in m.image_grids + m.video_grids)
    total = token + pair + vision
    return {"token": token / total, "attention": pair / total, "vision": vision / total}


def _stream_docs(mix, seq_len, samples, steps=30, per_step=16):
    """(meta, tokens) of the documents of the first rows of the full-size stream."""
    rng = random.Random(0)
    metas = [MIXES[mix](rng, seq_len) for _ in range(samples)]
    slots = [s for step in steps_of(metas, seq_len, per_step, steps) for s in step]
    return [(m, n) for s in slots for m, n in zip(s.metas, s.lengths, strict=True)]


def slot_cost(cost, slot):
    return sum(cost.sample(m, n) for m, n in zip(slot.metas, slot.lengths, strict=True))


def modelled(cost, mix, dp, rows, seq_len, steps, samples, seed):
    from cpvlm.data.balance import deal_bound, dp_deal, max_over_mean
    from cpvlm.data.packing import dp_split

    rng = random.Random(seed)
    metas = [MIXES[mix](rng, seq_len) for _ in range(samples)]
    out = {"mix": mix, "dp": dp, "R": rows}
    per = {"tokens": [], "cost": [], "bound": []}
    loads = {"tokens": [0.0, 0.0], "cost": [0.0, 0.0]}
    for slots in steps_of(metas, seq_len, rows * dp, steps, seed):
        costs = [slot_cost(cost, s) for s in slots]
        deals = {"tokens": dp_split([s.num_tokens for s in slots], dp), "cost": dp_deal(costs, dp)}
        for k, shares in deals.items():
            per[k].append(max_over_mean(costs, shares))
            rank_loads = [sum(costs[i] for i in s) for s in shares]
            loads[k][0] += max(rank_loads)
            loads[k][1] += sum(rank_loads) / dp
        per["bound"].append(deal_bound(costs, dp))
    out["tokens_max_mean"] = statistics.mean(per["tokens"])
    out["cost_max_mean"] = statistics.mean(per["cost"])
    out["bound"] = statistics.mean(per["bound"])
    out["cost_worst"] = max(per["cost"])
    out["steps_bound_le_1.05"] = sum(b <= 1.05 for b in per["bound"]) / len(per["bound"])
    ok = [c for c, b in zip(per["cost"], per["bound"], strict=True) if b <= 1.05]
    out["cost_where_bound_allows"] = max(ok) if ok else None
    out["tokens_time_lost"] = loads["tokens"][0] / loads["tokens"][1] - 1
    out["cost_time_lost"] = loads["cost"][0] / loads["cost"][1] - 1
    return out


def row_parts(cost, slot) -> list[int]:
    """A row's modelled forward MACs by part (decoder per token, attention pairs, vision tower),
    its document count, and 1 (the row): what its measured time is fitted on (``PARTS``)."""
    docs = list(zip(slot.metas, slot.lengths, strict=True))
    return [
        cost.token * sum(n for _, n in docs),
        cost.pair * sum(n * (n + 1) // 2 for _, n in docs),
        sum(cost.vision.unit_cost(g) for m, _ in docs for g in m.image_grids + m.video_grids),
        len(docs),
        1,
    ]


def fit_parts(parts, seconds) -> list[float]:
    """Least-squares seconds per unit of each of ``PARTS`` (columns scaled for conditioning)."""
    import numpy as np

    x, y = np.array(parts, dtype=float), np.array(seconds)
    norm = np.abs(x).max(axis=0)
    coef, *_ = np.linalg.lstsq(x / norm, y, rcond=None)
    return (coef / norm).tolist()


def _doc_batch(config, meta, n):
    """A one-document batch of ``meta``'s grids and exactly ``n`` tokens where its items allow
    (the synthetic template adds vision start/end tokens: the text makes up the difference)."""
    from cpvlm.hf import SampleSpec, synthetic_batch

    def build(text_len):
        spec = SampleSpec(
            images=tuple((h, w) for _, h, w in meta.image_grids),
            videos=tuple(meta.video_grids),
            text_len=max(1, text_len),
        )
        return synthetic_batch(config, [spec], seed=n)

    vision = sum(t * h * w // 4 for t, h, w in meta.image_grids + meta.video_grids)
    batch = build(n - vision)
    extra = batch["input_ids"].shape[1] - n
    return build(n - vision - extra) if extra else batch


def _row_batch(config, slot):
    """``(batch, doc_lens)``: the packed row ``cpvlm train`` runs for ``slot``."""
    from cpvlm.hf import pack_documents

    parts = [_doc_batch(config, m, n) for m, n in zip(slot.metas, slot.lengths, strict=True)]
    return pack_documents(parts), [p["input_ids"].shape[1] for p in parts]


def time_rows(runner, batches, repeats) -> tuple[list[float], float]:
    """Median CPU seconds of forward + backward of each packed row through ``runner`` (the CP
    model at cp 1), the repeats going round every row in turn (slow spells of a loaded machine
    spread over all rows); and the median spread (max - min) / median of a row's repeats."""
    model = runner.model
    out, spreads = [[] for _ in batches], []
    batch, lens = batches[0]
    runner(**batch, doc_lens=lens).loss.backward()  # warm-up
    for _ in range(repeats):
        for i, (batch, lens) in enumerate(batches):
            model.zero_grad(set_to_none=True)
            start = time.process_time()
            runner(**batch, doc_lens=lens).loss.backward()
            out[i].append(time.process_time() - start)
    medians = [statistics.median(t) for t in out]
    spreads = [(max(t) - min(t)) / m for t, m in zip(out, medians, strict=True)]
    return medians, statistics.median(spreads)


def _pearson(a, b) -> float:
    return statistics.correlation([float(v) for v in a], [float(v) for v in b])


def measured(mix, dps, rows, seq_len, steps, samples, scale, repeats, calibration, seed):
    """Measured step time max/mean across DP ranks at each dp, token deal, cost deal and the
    fitted cost deal (the method in the module docstring); each row timed once for all dp."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText

    from cpvlm.data.balance import dp_deal, max_over_mean
    from cpvlm.data.packing import dp_split
    from cpvlm.data.rows import RowSlot
    from cpvlm.families.qwen3_vl import tiny_qwen3_vl_config
    from cpvlm.hf import ContextParallelVLM, row_cost

    config = tiny_qwen3_vl_config(**copy.deepcopy(TINY))
    cost = row_cost(config)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).train()
    runner = ContextParallelVLM(model, dist.group.WORLD)  # cp 1: the step cpvlm train runs
    rng = random.Random(seed)
    metas = [MIXES[mix](rng, seq_len, scale) for _ in range(samples)]
    stream = [s for step in steps_of(metas, seq_len, rows * max(dps), steps, seed) for s in step]
    # calibration rows: another seed's rows, each cut to a random number of its first documents
    # (tokens, attention, vision and documents then vary apart from each other)
    rng = random.Random(seed + 1)
    metas = [MIXES[mix](rng, seq_len, scale) for _ in range(samples)]
    calib = [s for step in steps_of(metas, seq_len, calibration, 1, seed + 1) for s in step]
    calib = [
        RowSlot(s.positions[:k], s.metas[:k], s.lengths[:k])
        for s in calib
        for k in [rng.randint(1, len(s.metas))]
    ]
    load = os.getloadavg()[0]
    seconds, spread = time_rows(runner, [_row_batch(config, s) for s in calib + stream], repeats)
    load = (load + os.getloadavg()[0]) / 2
    calib_seconds, seconds = seconds[: len(calib)], seconds[len(calib) :]
    coef = fit_parts([row_parts(cost, s) for s in calib], calib_seconds)  # the shares
    parts = [row_parts(cost, s) for s in stream]
    costs = [slot_cost(cost, s) for s in stream]
    totals = [sum(c * p[k] for p in parts) for k, c in enumerate(coef)]
    # the fitted cost model: RowCost's MACs plus a per-document and a per-row constant; the row's
    # drops out of the deal (every rank holds R rows), the document's is in MAC equivalents
    per_mac, per_doc, per_row = fit_parts(
        [[slot_cost(cost, s), len(s.metas), 1] for s in calib], calib_seconds
    )
    doc_macs = per_doc / per_mac
    fitted = [c + doc_macs * len(s.metas) for c, s in zip(costs, stream, strict=True)]
    predicted = [per_mac * f + per_row for f in fitted]
    info = {
        "mix": mix,
        "rows_timed": len(stream),
        "calibration_rows": len(calib),
        "row_seconds_mean": statistics.mean(seconds),
        "repeat_spread": spread,
        "load": load,
        **{f"s_per_{k}": c for k, c in zip(PARTS, coef, strict=True)},
        **{f"measured_{k}": t / sum(totals) for k, t in zip(PARTS, totals, strict=True)},
        "fit_s_per_gmac": per_mac * 1e9,
        "fit_s_per_document": per_doc,
        "fit_s_per_row": per_row,
        "document_over_row_macs": doc_macs / statistics.mean(costs),
        "row_corr_cost": _pearson(costs, seconds),
        "row_corr_fitted": _pearson(predicted, seconds),
    }
    out = []
    for dp in dps:
        names = ("tokens", "cost", "fitted", "oracle")
        per = {f"{n}_{w}": [] for n in names for w in ("measured", "modelled")}
        ranks = {"cost": ([], []), "fitted": ([], [])}  # modelled, measured per (step, rank, deal)
        for k in range(0, len(stream), rows * dp):
            idx = range(k, k + rows * dp)
            deals = {
                "tokens": dp_split([stream[i].num_tokens for i in idx], dp),
                "cost": dp_deal([costs[i] for i in idx], dp),
                "fitted": dp_deal([round(fitted[i]) for i in idx], dp),
                "oracle": dp_deal([round(seconds[i] * 1e6) for i in idx], dp),  # hindsight
            }
            for name, shares_ in deals.items():
                per[f"{name}_measured"].append(max_over_mean([seconds[i] for i in idx], shares_))
                per[f"{name}_modelled"].append(max_over_mean([costs[i] for i in idx], shares_))
                for s in shares_ if name in ("tokens", "cost") else []:
                    for model_, values in (("cost", costs), ("fitted", predicted)):
                        ranks[model_][0].append(sum(values[idx[i]] for i in s))
                        ranks[model_][1].append(sum(seconds[idx[i]] for i in s))
        out.append(
            {
                "mix": mix, "dp": dp, "R": rows, "steps": len(per["cost_measured"]),
                **{k: statistics.mean(v) for k, v in per.items()},
                "rank_corr_cost": _pearson(*ranks["cost"]),
                "rank_corr_fitted": _pearson(*ranks["fitted"]),
            }
        )  # fmt: skip
    docs = [(m, n) for s in stream for m, n in zip(s.metas, s.lengths, strict=True)]
    return out, {**info, **{f"modelled_{k}": v for k, v in shares(cost, docs).items()}}


def main():
    from cpvlm.hf import row_cost

    p = parser(__doc__)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="R per DP rank")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--measure", action="store_true", help="also time the rows (CPU, minutes)")
    p.add_argument("--scale", type=int, default=4, help="measured stream: sizes / scale")
    p.add_argument("--measure-rows", type=int, default=2, help="R per DP rank when timing")
    p.add_argument("--measure-steps", type=int, default=6, help="steps at the largest dp")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calibration", type=int, default=24, help="rows per mix to fit times on")
    args = p.parse_args()
    cost = row_cost(qwen3_vl_8b_config())
    results = [
        modelled(cost, mix, dp, r, args.seq_len, args.steps, args.samples, seed=0)
        for mix in MIXES
        for dp in args.dp
        for r in args.rows
    ]
    cols = ["mix", "dp", "R", "tokens_max_mean", "cost_max_mean", "bound", "cost_worst"]
    cols += ["steps_bound_le_1.05", "cost_where_bound_allows", "tokens_time_lost", "cost_time_lost"]
    print_table(results, cols, "modelled step cost across DP ranks (max/mean, mean over steps)")
    payload = {
        "seq_len": args.seq_len,
        "steps": args.steps,
        "cost": {"token": cost.token, "pair": cost.pair, "vision": repr(cost.vision)},
        "modelled": results,
    }
    if args.measure:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        timed, share_rows = [], []
        for mix in MIXES:
            rows_, info = measured(
                mix, args.dp, args.measure_rows, args.seq_len // args.scale, args.measure_steps,
                args.samples // args.scale, args.scale, args.repeats, args.calibration, seed=0,
            )  # fmt: skip
            timed += rows_
            full = _stream_docs(mix, args.seq_len, args.samples)
            share_rows.append({**info, **{f"8B_{k}": v for k, v in shares(cost, full).items()}})
        dist.destroy_process_group()
        keys = ["token", "attention", "vision"]
        cols = ["mix"] + [f"{w}_{k}" for k in keys for w in ("8B", "modelled", "measured")]
        cols += ["measured_document", "measured_row", "row_corr_cost", "row_corr_fitted"]
        cols += ["fit_s_per_document", "document_over_row_macs"]
        cols += ["repeat_spread", "load"]
        print_table(
            share_rows,
            cols,
            "shares of step time: modelled (Qwen3-VL-8B on the full stream; the tiny model on "
            "the measured one) and measured (fitted on the calibration rows)",
        )
        cols = ["mix", "dp", "R", "steps", "tokens_modelled", "tokens_measured", "cost_modelled"]
        cols += ["cost_measured", "fitted_measured", "oracle_measured", "rank_corr_cost"]
        cols += ["rank_corr_fitted"]
        print_table(
            timed,
            cols,
            "step time across DP ranks (max/mean, mean over steps): modelled and measured, a "
            "rank's time the sum of its rows' (each row timed through the CP model at cp 1)",
        )
        payload["measured"] = {
            "method": "each packed row through ContextParallelVLM at cp 1 (what cpvlm train "
            "runs), forward + backward, CPU seconds (process_time, 1 thread), median of "
            "repeats taken round all rows; a DP rank's step time = sum of its rows'",
            "scale": args.scale,
            "rows_per_rank": args.measure_rows,
            "repeats": args.repeats,
            "calibration_rows": args.calibration,
            "parts": PARTS,
            "tiny": TINY,
            "shares": share_rows,
            "results": timed,
        }
    write_json(args.out_dir, "dp_balance", payload)


if __name__ == "__main__":
    main()
