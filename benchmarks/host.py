"""Per-step host milliseconds by part: the plan, the attention schedule, positions, vision.

What every rank computes on the host before (and between) its kernels, for one packed row of S
tokens in D documents over cp ranks, one thread:
  - plan:      ``ShardPlan`` and the tensors a step reads (one rank's indices, document ids,
               padded index), layout head-tail or balanced;
  - schedule:  one rank's attention schedule (its segments of every ring step, plus the ring's
               last step, which every rank agrees on) per mask (causal, window 4096), for the
               ring (the plan) and Ulysses / hybrid (the merged plans); beside it the schedule as
               cpvlm computed it before (``cpvlm.testing.schedule_reference``: every rank's
               rows, loops over rectangles), which every rank computed in full, and the ratio;
  - positions: per-document position ids of a text row (``prepare_batch``'s ``_positions``),
               1D (``[B, S]``) and M-RoPE (``[3, B, S]``, ``cpvlm.hf.inputs.rope_index``);
  - vision:    ``assign_units`` of one vision unit per document;
  - auto:      ``impl="auto"``'s choice (``choose_impl``: the cost model over every candidate,
               which reads every rank's calls and pairs per step), per layout and mask;
  - route:     one rank's ``route_plan`` of one visual row per 8 tokens.
Times are process CPU milliseconds (the minimum over ``--repeats``; wall clock and the 1-minute
load average beside them), so that other work on the machine inflates them less; the reference runs once, where it finishes in
reasonable time (cp <= 16, and S <= 128k or the headline size; elsewhere its column is empty:
skipped, not measured). ``--max-seq``/``--max-cp`` cut the grid. ``--before FILE`` prints the figures of an earlier run (e.g. of the
previous code) side by side with ratios. Run: python benchmarks/host.py [--quick] [--part P]
"""

from __future__ import annotations

import json
import os
import random
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from _common import parser, print_table, write_json

from cpvlm import ShardPlan
from cpvlm.attention import schedule as attn_schedule
from cpvlm.attention.cost import Shapes, choose_impl, estimate_seconds
from cpvlm.attention.mask_spec import MaskSpec
from cpvlm.distributed import layout as attn_layout
from cpvlm.encoders.assign import assign_units
from cpvlm.encoders.route import route_plan
from cpvlm.hf import inputs as hf_inputs
from cpvlm.hf.adapter import ModulePaths

PARTS = ("plan", "schedule", "auto", "positions", "vision", "route")
WINDOW = 4096
FULL_GRID = [
    (s, d, cp)
    for s in (1 << 15, 1 << 17, 1 << 19, 1 << 20)
    for d in (1, 64, 1024, 4096)
    for cp in (8, 16, 32, 64)
    if d * 8 <= s
]
QUICK_GRID = [(1 << 20, 1024, 16)]
HEADLINE = (1 << 20, 1024, 16)


def doc_lens(seq_len: int, docs: int, seed: int = 0) -> list[int]:
    """``docs`` random lengths (a uniform random split) summing to ``seq_len``."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, seq_len), docs - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, seq_len])]


def fresh_caches() -> None:
    attn_layout.build_layout.cache_clear()
    attn_schedule._schedule.cache_clear()
    if hasattr(attn_schedule._runs, "cache_clear"):  # cached per plan: timed in every schedule
        attn_schedule._runs.cache_clear()
    estimate_seconds.cache_clear()


def timed(fn, repeats: int) -> dict:
    """Minimum CPU and wall milliseconds of ``fn()`` (caches cleared before each run)."""
    cpu, wall = [], []
    for _ in range(repeats):
        fresh_caches()
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"cpu_ms": 1e3 * min(cpu), "wall_ms": 1e3 * min(wall), "load": os.getloadavg()[0]}


def build_plan(lens, cp, layout, rank=0):
    plan = ShardPlan(sum(lens), cp, doc_lens=lens, layout=layout)
    plan.indices(rank), plan.doc_ids, plan.padded_index  # noqa: B018 (what a step reads)
    return plan


def one_rank_schedule(plan: ShardPlan, mask: MaskSpec, rank: int) -> None:
    schedule = attn_schedule.attention_schedule(plan, mask)
    for i in range(plan.cp_size):
        schedule.segments(rank, i)
    if hasattr(schedule, "last_step"):  # the ring's steps (an earlier version: all ranks' rows)
        schedule.last_step  # noqa: B018
    else:
        [schedule.segments(r, i) for r in range(plan.cp_size) for i in range(plan.cp_size)]


def reference_schedule(plan: ShardPlan, mask: MaskSpec):
    try:
        from cpvlm.testing.schedule_reference import reference_steps
    except ImportError:
        return None
    return reference_steps(plan, mask)


_ADAPTER = SimpleNamespace(modules=ModulePaths())
"""The base layout's module paths (text documents ask the adapter nothing else)."""


def positions(lens: list[int], mrope: bool) -> torch.Tensor:
    """Per-document position ids of a text row as ``prepare_batch`` builds them (the product's
    ``_positions``): ``[1, S]`` for 1D-RoPE families, ``[3, 1, S]`` for M-RoPE ones."""
    model = SimpleNamespace(model=SimpleNamespace(get_rope_index=print) if mrope else None)
    ids = torch.zeros(1, sum(lens), dtype=torch.long)
    plan = ShardPlan(sum(lens), 1, doc_lens=lens)
    return hf_inputs._positions(_ADAPTER, model, ids, ids, None, ([], []), {}, plan, lens)


def schedule_rows(lens, cp, repeats, reference: bool) -> list[dict]:
    rows = []
    for layout in ("head_tail", "balanced"):
        plan = ShardPlan(sum(lens), cp, doc_lens=lens, layout=layout)
        rank = cp // 2 - 1 if cp > 1 else 0  # a middle rank (head-tail ranks are alike)
        for name, mask in (("causal", MaskSpec()), (f"window {WINDOW}", MaskSpec(window=WINDOW))):
            views = [("ring", plan, rank)]
            if cp >= 8:
                views.append(("hybrid u=4", plan.merge_ranks(4), rank // 4))
            views.append(("ulysses", plan.merge_ranks(cp), 0))
            for impl, view, r in views:
                row = {"part": "schedule", "layout": layout, "mask": name, "impl": impl}
                row.update(timed(lambda v=view, m=mask, r=r: one_rank_schedule(v, m, r), repeats))
                if reference and impl == "ring":
                    ref = timed(lambda v=view, m=mask: reference_schedule(v, m), 1)
                    if reference_schedule(ShardPlan(8, 1), MaskSpec()) is not None:
                        row["reference_cpu_ms"] = ref["cpu_ms"]
                        row["ratio"] = ref["cpu_ms"] / row["cpu_ms"]
                rows.append(row)
    return rows


def run(config, parts, repeats) -> list[dict]:
    s, d, cp = config
    lens = doc_lens(s, d)
    rows = []
    if "plan" in parts:
        for layout in ("head_tail", "balanced"):
            row = {"part": "plan", "layout": layout}
            rows.append(row | timed(lambda lay=layout: build_plan(lens, cp, lay), repeats))
    if "schedule" in parts:
        rows += schedule_rows(
            lens, cp, repeats, reference=cp <= 16 and (config == HEADLINE or s <= 1 << 17)
        )
    if "auto" in parts:
        shapes = Shapes(batch=1, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
        for layout in ("head_tail", "balanced"):
            plan = ShardPlan(s, cp, doc_lens=lens, layout=layout)
            for name, mask in (
                ("causal", MaskSpec()),
                (f"window {WINDOW}", MaskSpec(window=WINDOW)),
            ):
                row = {"part": "auto", "layout": layout, "mask": name}
                row |= timed(lambda p=plan, m=mask: choose_impl(p, m, shapes), repeats)
                row["impl"] = "->" + "".join(map(str, choose_impl(plan, mask, shapes))).replace(
                    "None", ""
                )
                rows.append(row)
    if "positions" in parts:
        for name, mrope in (("1d", False), ("mrope", True)):
            row = {"part": "positions", "impl": name}
            rows.append(row | timed(lambda m=mrope: positions(lens, m), repeats))
    if "vision" in parts:
        costs = [max(1, n // 8) for n in lens]
        rows.append({"part": "vision"} | timed(lambda: assign_units(costs, cp), repeats))
    if "route" in parts:
        plan = ShardPlan(s, cp, doc_lens=lens)
        rows_at = plan.padded_index[::8]
        ranks = torch.arange(rows_at.numel()) % cp
        plan.owners, plan.local_index  # noqa: B018 (the plan's part, timed above)
        rows.append(
            {"part": "route"} | timed(lambda: route_plan(ranks, rows_at, plan, cp // 2), repeats)
        )
    for row in rows:
        row.update(S=s, docs=d, cp=cp)
    return rows


def _key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("S", "docs", "cp", "part", "layout", "mask", "impl"))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="the headline sizes only (S=1M, ...)")
    p.add_argument("--part", choices=(*PARTS, "all"), default="all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before", type=str, default=None, help="host.json of an earlier run")
    p.add_argument("--max-seq", type=int, default=None, help="only grid points with S <= this")
    p.add_argument("--max-cp", type=int, default=None, help="only grid points with cp <= this")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*non-contiguous.*")
    torch.set_num_threads(1)
    parts = PARTS if args.part == "all" else (args.part,)
    grid = QUICK_GRID if args.quick else FULL_GRID
    grid = [
        (s, d, cp) for s, d, cp in grid if s <= (args.max_seq or s) and cp <= (args.max_cp or cp)
    ]
    rows = []
    for n, config in enumerate(grid):
        print(f"[{n + 1}/{len(grid)}] S={config[0]} docs={config[1]} cp={config[2]}", flush=True)
        rows += run(config, parts, args.repeats)
    if args.before:
        before = {_key(r): r for r in json.loads(Path(args.before).read_text())["rows"]}
        for row in rows:
            old = before.get(_key(row))
            if old is not None:
                row["before_cpu_ms"] = old["cpu_ms"]
                row["before/after"] = old["cpu_ms"] / row["cpu_ms"]
    cols = ["S", "docs", "cp", "part", "layout", "mask", "impl", "cpu_ms", "wall_ms", "load"]
    cols += ["reference_cpu_ms", "ratio"] if any("ratio" in r for r in rows) else []
    cols += ["before_cpu_ms", "before/after"] if args.before else []
    print_table(rows, cols, title="host milliseconds per step and rank (CPU, one thread)")
    name = "host" if args.part == "all" else f"host_{args.part}"
    name += "_quick" if args.quick else ""
    write_json(args.out_dir, name, {"quick": args.quick, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
