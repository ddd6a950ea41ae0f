"""DP balance: a step's rows dealt to DP ranks by tokens against by modelled cost, at dp 2, 4, 8,
on a long-tailed mix (a few long videos, many short image chats) and a text-heavy mix.

    python benchmarks/dp_balance.py             # about a minute (modelled costs)

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

Measured step time across DP ranks is not here yet: a one-process reference of a packed row
with per-document attention on the tiny model, timed per DP rank's rows, is left to do.
"""

from __future__ import annotations

import random
import statistics

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


def long_tailed(rng: random.Random, seq_len: int):
    """One sample in 40 a long video (12 to 24 frames of 24x32 to 32x48 patches: 1.7k to 4.6k
    tokens), the rest image chats (one or two images of 16x16 to 32x32 patches, 50 to 300 text
    tokens)."""
    from cpvlm.data.meta import SampleMeta

    if rng.random() < 1 / 40:
        t = 2 * rng.randint(6, 12)
        h, w = 2 * rng.randint(12, 16), 2 * rng.randint(16, 24)
        tokens = t // 2 * h * w // 4 + rng.randint(50, 300)
        if tokens <= seq_len:
            return SampleMeta(tokens, (), ((t // 2, h, w),))
    grids = tuple(
        (1, 2 * rng.randint(8, 16), 2 * rng.randint(8, 16)) for _ in range(rng.randint(1, 2))
    )
    return SampleMeta(sum(g[1] * g[2] // 4 for g in grids) + rng.randint(50, 300), grids)


def text_heavy(rng: random.Random, seq_len: int):
    """Text documents of log-normal length (median ~700 tokens, a long tail up to the row), one
    in six with an image of 16x16 to 32x32 patches."""
    from cpvlm.data.meta import SampleMeta

    tokens = min(seq_len, max(16, int(rng.lognormvariate(6.5, 1.0))))
    if rng.random() < 1 / 6:
        g = (1, 2 * rng.randint(8, 16), 2 * rng.randint(8, 16))
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


def main():
    from cpvlm.integrations.hf import row_cost

    p = parser(__doc__)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="R per DP rank")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--samples", type=int, default=20000)
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
    write_json(args.out_dir, "dp_balance", payload)


if __name__ == "__main__":
    main()
