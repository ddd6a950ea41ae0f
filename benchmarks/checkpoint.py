"""The step-time cost of a checkpoint, synchronous vs asynchronous (--async-save), side by side.

    python benchmarks/checkpoint.py                     # 8 M parameters + AdamW: ~96 MB a save
    python benchmarks/checkpoint.py --quick --out-dir DIR   # a trial run

One process (a gloo group of one rank), a stack of float32 Linear layers trained with AdamW on
a random batch, checkpointed with cpvlm's own save (``cpvlm.train.checkpoint``: DCP files,
manifest, meta.json, rename) as ``cpvlm train`` does: sync (``dcp.save``: the step waits for the
write) and async (``dcp.async_save``: the step waits for the staging copy to host memory, the
write runs in a background thread and is finished at the first step boundary after it is done).

A *round* of one mode: ``--before`` steps without a save (their median is the round's step time),
the step that saves, then steps until the save is finished (at least ``--after``). Per round:

    step_s   median step time of the steps before the save
    save_s   the step that saves (training, then the save call)
    stall_s  save_s - step_s: how long the checkpoint held training at that step
    after_s  what the steps after the save took beyond step_s, the finishing call included
             (an async write competes for the cores here; ~0 for sync)
    cost_s   stall_s + after_s: what the checkpoint cost the run in all

The rounds alternate sync and async (so load on a shared machine hits both alike); the table
shows the median over ``--rounds`` rounds of each column, and async/sync of stall and cost.
On a CPU-only machine the background write competes with training for the same cores (and the
staging copy is a memory copy like the write's); on GPUs the staging is a device-to-host copy and
the write overlaps the GPU's compute.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _common import Clock, parser, print_table, write_json

from cpvlm.train.checkpoint import finish_save, start_save

MODES = ("sync", "async")
COLUMNS = ("step_s", "save_s", "stall_s", "after_s", "cost_s")


def _model(params_m: float, width: int) -> torch.nn.Module:
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


class _Trainer:
    def __init__(self, args):
        torch.manual_seed(0)
        self.model = _model(args.params_m, args.width)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, args.width)
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self) -> None:
        self.model(self.x).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def save(self, out: Path, step: int, group):
        return start_save(
            out, step, model=self.model, optimizer=self.optim, rank_state={}, meta={},
            async_group=group,
        )  # fmt: skip


def _round(trainer: _Trainer, mode: str, out: Path, step: int, group, args) -> dict:
    """One round of ``mode``; ``step`` numbers its checkpoint."""
    before = []
    for _ in range(args.before):
        t0 = time.perf_counter()
        trainer.step()
        before.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    trainer.step()
    pending = trainer.save(out, step, group if mode == "async" else None)
    if mode == "sync":
        finish_save(pending)
        pending = None
    save_s = time.perf_counter() - t0
    after, steps_after = [], 0
    while pending is not None or steps_after < args.after:
        t0 = time.perf_counter()
        trainer.step()
        if pending is not None and pending.done():  # as cpvlm train: at a step boundary
            finish_save(pending)
            pending = None
        after.append(time.perf_counter() - t0)
        steps_after += 1
    step_s = statistics.median(before)
    after_s = sum(after) - len(after) * step_s
    stall_s = save_s - step_s
    return {
        "mode": mode,
        "step_s": step_s,
        "save_s": save_s,
        "stall_s": stall_s,
        "after_s": after_s,
        "cost_s": stall_s + after_s,
        "steps_until_written": len(after) if mode == "async" else 0,
        "before": before,
        "after": after,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--params-m", type=float, default=8, help="parameters, in millions")
    p.add_argument("--width", type=int, default=512, help="Linear width")
    p.add_argument("--batch", type=int, default=32, help="rows of a training batch")
    p.add_argument("--before", type=int, default=5, help="steps before the save in a round")
    p.add_argument("--after", type=int, default=5, help="least steps after the save in a round")
    p.add_argument("--rounds", type=int, default=7, help="rounds of each mode (median)")
    p.add_argument("--quick", action="store_true", help="2 M parameters, 3 rounds")
    args = p.parse_args()
    if args.quick:
        args.params_m, args.rounds = 2, 3
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="cpvlm-bench-ckpt-") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
        trainer = _Trainer(args)
        out = Path(tmp) / "run"
        trainer.step()  # warm up allocator, optimizer state and the first save's files
        finish_save(trainer.save(out, 0, None))
        finish_save(trainer.save(out, 0, group))  # and DCP's background writer
        rounds = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for i, mode in enumerate(order):
                rounds[mode].append(_round(trainer, mode, out, 2 * r + i + 1, group, args))
        ckpt = max(
            (d for d in (out / "checkpoints").iterdir() if d.name.startswith("step_")),
            key=lambda d: d.name,
        )
        ckpt_mb = sum(f.stat().st_size for f in ckpt.iterdir()) / 1e6
        dist.destroy_process_group()
    rows = []
    for mode in MODES:
        row = {"mode": mode, "checkpoint_MB": ckpt_mb}
        for col in COLUMNS:
            row[col] = statistics.median(x[col] for x in rounds[mode])
        rows.append(row)
    sync, asyn = rows
    asyn["stall async/sync"] = asyn["stall_s"] / sync["stall_s"]
    asyn["cost async/sync"] = asyn["cost_s"] / sync["cost_s"]
    title = (
        f"checkpoint cost per save: {trainer.params / 1e6:.1f} M params + AdamW, "
        f"{args.batch} x {args.width} batch, median of {args.rounds} rounds a mode"
    )
    print_table(rows, ["mode", "checkpoint_MB", *COLUMNS, "stall async/sync", "cost async/sync"],
                title)  # fmt: skip
    write_json(
        args.out_dir,
        "checkpoint_quick" if args.quick else "checkpoint",
        {"args": {k: str(v) for k, v in vars(args).items() if k != "out_dir"},
         "params": trainer.params, "rows": rows, "rounds": rounds, "wall_s": clock.wall()},
    )  # fmt: skip


if __name__ == "__main__":
    main()
