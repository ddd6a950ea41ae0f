"""Causal attention balance of the ShardPlan layouts against contiguous splitting.

For each CP size and document mix: max/mean over ranks of the causal (q, k) pairs a rank attends
(1.00 is perfect balance), and the padding the layout adds, for per-document head-tail (the
default), the balanced layout (long documents head-tail, short ones whole, LPT by causal work;
``layout="balanced"``) and contiguous splitting. Then the Ulysses head splits (``head_split``) of
the head counts of published models and of the test cases: query heads per rank, the busiest
rank's work over the mean (the price of an uneven split), and the K/V heads each rank receives
(a K/V head goes to two ranks only when its query heads are split; never expanded to Hq).
Pure arithmetic; no timing. Run: python benchmarks/balance.py [--out-dir DIR]
"""

from __future__ import annotations

import random

import torch
from _common import max_over_mean, parser, print_table, write_json

from cpvlm import ShardPlan
from cpvlm.attention import head_split

HEADS = {  # (Hq, Hkv) of the text models (their config.json), then the test cases' odd ones
    "Qwen2.5-VL-3B": (16, 2),
    "Qwen2.5-VL-7B": (28, 4),
    "Qwen2.5-VL-32B": (40, 8),
    "Qwen2.5-VL-72B": (64, 8),
    "Qwen3-VL-8B": (32, 8),
    "tests 12/4": (12, 4),
    "tests 7/1": (7, 1),
    "tests 6/2": (6, 2),
    "tests 5/5": (5, 5),
}


def causal_pairs(plan: ShardPlan, positions_per_rank: list[torch.Tensor]) -> list[int]:
    """Causal (q, k) pairs each rank attends: keys of its query's document at or before it."""
    real = ~plan.is_padding
    # For a real query at p in document d: (p - start_of_d + 1) keys.
    doc_start = torch.zeros(plan.padded_len, dtype=torch.long)
    start = 0
    for p in plan.padded_doc_lens:  # the balanced layout's padding-only tail follows, no keys
        doc_start[start : start + p] = start
        start += p
    keys = torch.where(real, torch.arange(plan.padded_len) - doc_start + 1, 0)
    return [int(keys[idx].sum()) for idx in positions_per_rank]


def contiguous_split(plan: ShardPlan) -> list[torch.Tensor]:
    """Rank r holds the r-th contiguous block of the padded sequence (no load balancing)."""
    return list(torch.arange(plan.padded_len).chunk(plan.cp_size))


def mixes(seq_len: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    short = [rng.randint(64, 512) for _ in range(200)]
    skewed = [seq_len // 2, *(rng.randint(32, 1024) for _ in range(40))]
    return {
        "one long sequence": [seq_len],
        "many short documents": trim(short, seq_len),
        "skewed mix": trim(skewed, seq_len),
    }


def trim(lens: list[int], total: int) -> list[int]:
    out, acc = [], 0
    for n in lens:
        if acc + n >= total:
            break
        out.append(n)
        acc += n
    out.append(total - acc)
    return out


def main() -> None:
    args = parser(__doc__).parse_args()
    seq_len = 32768
    rows = []
    for name, doc_lens in mixes(seq_len).items():
        for cp in (2, 4, 8):
            plan = ShardPlan(seq_len, cp, doc_lens=doc_lens)
            bal = ShardPlan(seq_len, cp, doc_lens=doc_lens, layout="balanced")
            ht = causal_pairs(plan, [plan.indices(r) for r in range(cp)])
            bl = causal_pairs(bal, [bal.indices(r) for r in range(cp)])
            contig = causal_pairs(plan, contiguous_split(plan))
            rows.append(
                {
                    "mix": name,
                    "docs": len(doc_lens),
                    "cp": cp,
                    "head_tail_max_over_mean": max_over_mean(ht),
                    "balanced_max_over_mean": max_over_mean(bl),
                    "contiguous_max_over_mean": max_over_mean(contig),
                    "padding_tokens": plan.padded_len - seq_len,
                    "padding_pct": 100 * (plan.padded_len - seq_len) / seq_len,
                    "balanced_padding_pct": 100 * (bal.padded_len - seq_len) / seq_len,
                    "balanced_docs_split": sum(1 for r in bal.whole_on if r < 0),
                }
            )
    columns = [
        "mix",
        "docs",
        "cp",
        "head_tail_max_over_mean",
        "balanced_max_over_mean",
        "contiguous_max_over_mean",
        "padding_pct",
        "balanced_padding_pct",
        "balanced_docs_split",
    ]
    print_table(
        rows, columns, f"Causal attention balance, seq_len={seq_len} (max/mean pairs per rank)"
    )
    heads = head_split_rows()
    print_table(
        heads,
        ["model", "heads", "u", "q_heads_per_rank", "imbalance", "kv_heads_per_rank", "kv_copies"],
        "Ulysses head splits: query heads per rank (min-max), busiest over mean, K/V heads each "
        "rank receives (min-max), K/V head copies in all (Hkv when no K/V head is split)",
    )
    write_json(args.out_dir, "balance", {"seq_len": seq_len, "rows": rows, "head_splits": heads})


def head_split_rows() -> list[dict]:
    rows = []
    for name, (hq, hkv) in HEADS.items():
        for u in (2, 4, 8):
            split = head_split(hq, hkv, u)
            q = [b - a for a, b in (split.q_range(i) for i in range(u))]
            kv = [b - a for a, b in (split.kv_range(i) for i in range(u))]
            rows.append(
                {
                    "model": name,
                    "heads": f"{hq}/{hkv}",
                    "u": u,
                    "q_heads_per_rank": f"{min(q)}-{max(q)}",
                    "imbalance": split.imbalance,
                    "kv_heads_per_rank": f"{min(kv)}-{max(kv)}",
                    "kv_copies": sum(kv),
                }
            )
    return rows


if __name__ == "__main__":
    main()
