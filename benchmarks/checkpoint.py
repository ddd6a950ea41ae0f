"""The step-time cost of a checkpoint, synchronous vs asynchronous (--async-save), side by side.

    python benchmarks/checkpoint.py                      # 64 M parameters + AdamW: ~770 MB a save
    python benchmarks/checkpoint.py --params-m 8 --out-dir DIR   # a trial run

One process (a gloo group of one rank), a stack of float32 Linear layers trained with AdamW on
random batches, checkpointed with cpvlm's own save (``cpvlm.train.checkpoint``: DCP files,
manifest, meta.json, rename) every ``--every`` steps into a temporary directory, three ways:
none (the baseline step time), sync (``dcp.save``: training waits for the write) and async
(``dcp.async_save``: training waits for the staging copy to host memory; the write runs in a
background thread, finished at the next step boundary after it is done). The cost of a
checkpoint is the wall time of the ``--every`` steps that include one minus ``--every`` baseline
steps (the median step without checkpoints): what a run loses per checkpoint. "blocked" is the time the save call itself held the step.
On a CPU-only machine the background write competes with training for the same cores (and the
staging copy is a memory copy like the write's); on GPUs the staging is a device-to-host copy and
the write overlaps the GPU's compute.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _common import Clock, parser, print_table, write_json

from cpvlm.train.checkpoint import finish_save, start_save


def _model(params_m: int, width: int) -> torch.nn.Module:
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _run(mode: str, args, out: Path) -> dict:
    torch.manual_seed(0)
    model = _model(args.params_m, args.width)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    group = (
        dist.new_group(backend="gloo", timeout=timedelta(seconds=600)) if mode == "async" else None
    )
    x = torch.randn(args.batch, args.width)
    pending, step_s, blocked = None, [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if pending is not None and pending.done():
            finish_save(pending)
            pending = None
        if mode != "none" and step % args.every == 0:
            t1 = time.perf_counter()
            if pending is not None:  # at most one in flight
                finish_save(pending)
            pending = start_save(
                out, step, model=model, optimizer=optim, rank_state={}, meta={},
                async_group=group,
            )  # fmt: skip
            if group is None:
                finish_save(pending)
                pending = None
            blocked.append(time.perf_counter() - t1)
        step_s.append(time.perf_counter() - t0)
    if pending is not None:
        finish_save(pending)
    warm = step_s[args.every :]  # the first window warms up allocator and files
    return {"mode": mode, "step_s": warm, "blocked_s": blocked[1:] if len(blocked) > 1 else blocked}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--params-m", type=int, default=64, help="parameters, in millions")
    p.add_argument("--width", type=int, default=1024, help="Linear width")
    p.add_argument("--batch", type=int, default=64, help="rows of a training batch")
    p.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--steps", type=int, default=25, help="steps of each mode")
    args = p.parse_args()
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="cpvlm-bench-ckpt-") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        runs = {}
        for mode in ("none", "sync", "async"):
            out = Path(tmp) / mode
            runs[mode] = _run(mode, args, out)
            size = (
                sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
                if mode != "none"
                else 0
            )
            runs[mode]["checkpoint_mb"] = size / 2 / 1e6  # two checkpoints are kept
            shutil.rmtree(out, ignore_errors=True)
        dist.destroy_process_group()
    base = statistics.median(runs["none"]["step_s"])  # robust to a busy machine's spikes
    rows = []
    for mode in ("sync", "async"):
        r = runs[mode]
        windows = len(r["step_s"]) // args.every
        cost = (sum(r["step_s"][: windows * args.every]) - windows * args.every * base) / windows
        blocked = sum(r["blocked_s"]) / len(r["blocked_s"])
        rows.append(
            {"mode": mode, "checkpoint_MB": r["checkpoint_mb"], "blocked_s": blocked,
             "cost_per_ckpt_s": cost, "cost_in_steps": cost / base}
        )  # fmt: skip
    rows[1]["async/sync"] = rows[1]["cost_per_ckpt_s"] / rows[0]["cost_per_ckpt_s"]
    title = (
        f"checkpoint cost: {args.params_m} M params + AdamW, a save every {args.every} steps, "
        f"baseline step {base:.3f} s"
    )
    print_table(
        rows,
        ["mode", "checkpoint_MB", "blocked_s", "cost_per_ckpt_s", "cost_in_steps", "async/sync"],
        title,
    )
    write_json(
        args.out_dir,
        "checkpoint",
        {"args": {k: str(v) for k, v in vars(args).items() if k != "out_dir"},
         "baseline_step_s": base,
         "rows": rows, "runs": runs, "wall_s": clock.wall()},
    )  # fmt: skip


if __name__ == "__main__":
    main()
