"""DP balance: a step's rows dealt to DP ranks by tokens against by modelled cost, at dp 2, 4, 8,
on a long-tailed mix (a few long videos, many short image chats) and a text-heavy mix.

    python benchmarks/dp_balance.py             # about a minute (modelled costs)
    python benchmarks/dp_balance.py --measure   # and measured step times (minutes, CPU)

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

Measured step time (``--measure``, CPU): the same stream at 1/16 of the size (``--scale 16``:
rows of seq_len / 16 tokens, image and frame sides / 4, text / 16) and a tiny Qwen3-VL whose
modelled shares of vision, attention and per-token decoder work on that stream resemble
Qwen3-VL-8B's on the full one (``TINY``; both shares in the table). Every row of a step is timed
once, alone, in one process: forward and backward of each of its documents as its own sequence
(what per-document attention in a packed row computes), best of ``--repeats``; a DP rank's step
time is the sum of its rows' (its rows run one after another, as gradient accumulation does),
so one machine measures every rank of dp 2, 4, 8 without running them at once, and both deals
are timed on the same rows. The cost deal uses the tiny model's ``RowCost`` (what ``cpvlm
train`` would use for it). Figures: mean over steps of max/mean measured rank time.
"""

from __future__ import annotations

import math
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
    # text 2 layers of 128 (MLP 512, 4 heads of 16, 2 KV heads), vocabulary 2048; vision 1 block
    # of 32 (MLP 128), patch 8, merge 2: shares like Qwen3-VL-8B's at scale 16 (chosen from a
    # small grid of widths and depths by the sum of share differences on both mixes)
    "text_config": {
        "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048,
    },
    "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 128, "num_heads": 2,
                      "out_hidden_size": 128, "deepstack_visual_indexes": [0]},
}  # fmt: skip


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


def _doc_batch(config, meta, n):
    """A one-document batch of ``meta``'s grids and ``n`` tokens (text-only documents cut)."""
    from cpvlm.integrations.hf import SampleSpec, synthetic_batch

    vision = sum(t * h * w // 4 for t, h, w in meta.image_grids + meta.video_grids)
    spec = SampleSpec(
        images=tuple((h, w) for _, h, w in meta.image_grids),
        videos=tuple(meta.video_grids),
        text_len=max(1, n - vision),
    )
    return synthetic_batch(config, [spec], seed=n)


def _row_seconds(model, config, slot, repeats):
    """Forward and backward of every document of ``slot``, each alone; best of ``repeats``."""
    batches = [_doc_batch(config, m, n) for m, n in zip(slot.metas, slot.lengths, strict=True)]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            model(**batch).loss.backward()
        best = min(best, time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return best


def measured(mix, dps, rows, seq_len, steps, samples, scale, repeats, seed):
    """Measured step time max/mean across DP ranks at each dp, token deal and cost deal (the
    method in the module docstring); each row timed once, all dp on the same rows."""
    import copy

    import torch
    from transformers import AutoModelForImageTextToText

    from cpvlm.data.balance import dp_deal, max_over_mean
    from cpvlm.data.packing import dp_split
    from cpvlm.integrations.hf import row_cost
    from cpvlm.integrations.hf.families.qwen3_vl import tiny_qwen3_vl_config

    config = tiny_qwen3_vl_config(**copy.deepcopy(TINY))
    cost = row_cost(config)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).train()
    rng = random.Random(seed)
    metas = [MIXES[mix](rng, seq_len, scale) for _ in range(samples)]
    top = max(dps)
    stream = [s for step in steps_of(metas, seq_len, rows * top, steps, seed) for s in step]
    seconds = [_row_seconds(model, config, slot, repeats) for slot in stream]
    costs = [slot_cost(cost, s) for s in stream]
    out = []
    for dp in dps:
        per, per_model = {"tokens": [], "cost": []}, {"tokens": [], "cost": []}
        for k in range(0, len(stream), rows * dp):
            idx = range(k, k + rows * dp)
            slots = [stream[i] for i in idx]
            deals = {
                "tokens": dp_split([s.num_tokens for s in slots], dp),
                "cost": dp_deal([costs[i] for i in idx], dp),
            }
            for name, shares_ in deals.items():
                per[name].append(max_over_mean([seconds[i] for i in idx], shares_))
                per_model[name].append(max_over_mean([costs[i] for i in idx], shares_))
        out.append(
            {
                "mix": mix, "dp": dp, "R": rows, "steps": len(per["cost"]),
                "tokens_measured": statistics.mean(per["tokens"]),
                "cost_measured": statistics.mean(per["cost"]),
                "tokens_modelled": statistics.mean(per_model["tokens"]),
                "cost_modelled": statistics.mean(per_model["cost"]),
                "row_seconds_mean": statistics.mean(seconds),
            }
        )  # fmt: skip
    docs = [(m, n) for s in stream for m, n in zip(s.metas, s.lengths, strict=True)]
    return out, shares(cost, docs)


def main():
    from cpvlm.integrations.hf import row_cost

    p = parser(__doc__)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="R per DP rank")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--measure", action="store_true", help="also time the rows (CPU, minutes)")
    p.add_argument("--scale", type=int, default=16, help="measured stream: sizes / scale")
    p.add_argument("--measure-rows", type=int, default=2, help="R per DP rank when timing")
    p.add_argument("--measure-steps", type=int, default=2, help="steps at the largest dp")
    p.add_argument("--repeats", type=int, default=2)
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

        torch.set_num_threads(1)
        timed, share_rows = [], []
        for mix in MIXES:
            rows_, tiny_shares = measured(
                mix, args.dp, args.measure_rows, args.seq_len // args.scale,
                args.measure_steps, args.samples // args.scale, args.scale, args.repeats, seed=0,
            )  # fmt: skip
            timed += rows_
            full = _stream_docs(mix, args.seq_len, args.samples)
            share_rows.append(
                {"mix": mix, **{f"8B_{k}": v for k, v in shares(cost, full).items()},
                 **{f"tiny_{k}": v for k, v in tiny_shares.items()}}
            )  # fmt: skip
        print_table(
            share_rows,
            list(share_rows[0]),
            "modelled cost shares: Qwen3-VL-8B on the stream, the tiny model at --scale",
        )
        cols = ["mix", "dp", "R", "steps", "tokens_measured", "cost_measured"]
        cols += ["tokens_modelled", "cost_modelled", "row_seconds_mean"]
        print_table(
            timed,
            cols,
            "measured step time across DP ranks (max/mean, mean over steps; each row timed alone "
            "in one process, a rank's time = sum of its rows')",
        )
        payload["measured"] = {
            "method": "each row timed once alone in one process (forward+backward of each "
            "document, best of repeats, 1 thread); a DP rank's step time = sum of its rows'",
            "scale": args.scale,
            "rows_per_rank": args.measure_rows,
            "repeats": args.repeats,
            "tiny": TINY,
            "shares": share_rows,
            "results": timed,
        }
    write_json(args.out_dir, "dp_balance", payload)


if __name__ == "__main__":
    main()
