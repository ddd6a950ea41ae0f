"""The vision="split" rows of benchmarks/vision_dp.py: sharded units against whole units.

For the mixes with units larger than a rank's share (cpvlm/testing/vision_cases.py SPLIT_MIXES:
three 1600-patch images among 23 small ones; one 12-frame 64 x 96-patch video) at cp 2/4/8:
- modelled: max/mean of the Qwen3-VL-8B cost per rank, whole units (cost-balanced, what route mode
  does), split (``split_assignment``), and the whole-unit bound max(unit cost)/mean;
- measured: every rank's share encoded forward+backward one after another in this process on
  vision_dp.py's timing tower (units SCALE-fold smaller, the real attention/linear ratio), best of
  the rounds, CPU time. A rank's piece of a sharded unit runs its own patches through the blocks
  and attends, per block, over the whole unit's keys: its own and the other ranks' (given here as
  tensors that take a gradient, as the ring's K/V blocks do); what is timed is a rank's compute,
  not the K/V traffic (bytes: attention rows of benchmarks/attention.py);
- activation memory: the bytes autograd saves for the backward during one rank's tower forward
  (saved-tensor hooks, each storage counted once; of a piece's K/V over the unit only its own
  rows, as ring attention saves), max over ranks, whole vs split. Activations grow with
  patches, balance is by cost: a rank of many small images holds more patches than one with a
  large image of the same cost, so the peak falls less than the time.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from cpvlm.testing.vision_cases import SPLIT_MIXES
from cpvlm.vision import assign_vision_units, vision_units
from cpvlm.vision.split_assign import split_assignment

MERGE = 2
_RING_KV: dict[int, int] = {}
"""Storage of a piece's K/V over the whole unit -> bytes of its local rows: what ring attention
saves for the backward (its own K/V; the other ranks' blocks travel again in the backward)."""


def _max_over_mean(values) -> float:
    return max(values) / (sum(values) / len(values))


def balance_rows(target, cps) -> list[dict]:
    rows = []
    for mix, grids in SPLIT_MIXES.items():
        units = vision_units(torch.tensor(grids), MERGE)
        cost = target.unit_costs(units)
        for cp in cps:
            whole = assign_vision_units(cost, cp)
            sa = split_assignment(cost, units.row_counts, cp)
            rows.append(
                {
                    "mix": mix,
                    "cp": cp,
                    "units": units.num_units,
                    "sharded": len(sa.split),
                    "bound": max(cost) / (sum(cost) / cp),
                    "whole": _max_over_mean([sum(cost[u] for u in us) for us in whole]),
                    "split": _max_over_mean(sa.rank_costs(cost)),
                }
            )
    return rows


def _shares(target, grids, cp, scale):
    """Per scheme, per rank: (whole frame lengths, pieces (local patches, unit patches)), in
    timing-tower patches (real / scale)."""
    units = vision_units(torch.tensor(grids), MERGE)
    cost = target.unit_costs(units)
    whole = assign_vision_units(cost, cp)
    sa = split_assignment(cost, units.row_counts, cp)
    m2 = MERGE * MERGE
    out = {"whole": [], "split": []}
    for r in range(cp):
        out["whole"].append(([units.pixel_counts[u] // scale for u in whole[r]], []))
        pieces = [
            ((b - a) * m2 // scale, units.pixel_counts[u] // scale) for u, a, b in sa.pieces(r)
        ]
        out["split"].append(([units.pixel_counts[u] // scale for u in sa.whole[r]], pieces))
    return out


def _block(block, x, groups, pieces, remote):
    """vision_dp._Block.forward with pieces: queries of the local patches over the unit's keys."""
    n, f = x.shape
    qkv = block.qkv(block.norm1(x))
    outs, start = [], 0
    for frames, length in groups:
        part = qkv[start : start + frames * length].view(frames, length, 3, block.heads, -1)
        q, k, v = part.permute(2, 0, 3, 1, 4).unbind(0)
        outs.append(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, f))
        start += frames * length
    for (local, _), (rk, rv) in zip(pieces, remote):
        part = qkv[start : start + local].view(local, 3, block.heads, -1)
        q, k, v = part.permute(1, 2, 0, 3).unbind(0)  # [heads, local, d]
        local_bytes = k.numel() * k.element_size()
        k, v = torch.cat([k, rk], dim=1), torch.cat([v, rv], dim=1)
        for t in (k, v):
            _RING_KV[t.untyped_storage().data_ptr()] = local_bytes
        # 4-d inputs, as for whole frames: the fused CPU kernel (3-d ones take the math path)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        outs.append(out.transpose(0, 1).reshape(-1, f))
        start += local
    x = x + block.proj(torch.cat(outs))
    return x + block.mlp(block.norm2(x))


def _task(tower, share, gen, share_input):
    lens, pieces = share
    x, groups = share_input(lens, tower.pixel_dim, gen)
    local = [p for p, _ in pieces]
    x = torch.cat([x, torch.randn(sum(local), tower.pixel_dim, generator=gen)])
    d = tower.width // tower.blocks[0].heads
    remote = [
        [
            tuple(
                torch.randn(tower.blocks[0].heads, n - p, d, generator=gen).requires_grad_()
                for _ in range(2)
            )
            for p, n in pieces
        ]
        for _ in tower.blocks
    ]
    return x, groups, pieces, remote


def _forward(tower, x, groups, pieces, remote):
    x = tower.embed(x)
    for block, rem in zip(tower.blocks, remote):
        x = _block(block, x, groups, pieces, rem)
    return tower.merger(x)


def _run(tower, task) -> tuple[float, int]:
    """(CPU seconds of one forward+backward, bytes saved for the backward)."""
    x, groups, pieces, remote = task
    tower.zero_grad(set_to_none=True)
    if not len(x):
        return 0.0, 0
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        saved[ptr] = _RING_KV.get(ptr, t.untyped_storage().nbytes())
        return t

    _RING_KV.clear()
    cpu = time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _forward(tower, x, groups, pieces, remote)
    out.sum().backward()
    return time.process_time() - cpu, sum(saved.values())


def timing_rows(target, tower, cps, rounds, scale, share_input) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    tasks = []
    for mix, grids in SPLIT_MIXES.items():
        for cp in cps:
            shares = _shares(target, grids, cp, scale)
            for r in range(cp):  # rank r of both schemes side by side: drifting load hits both
                for scheme in ("whole", "split"):
                    tasks.append(
                        (mix, cp, scheme, _task(tower, shares[scheme][r], gen, share_input))
                    )
    _run(tower, tasks[0][3])  # warm-up
    best = [float("inf")] * len(tasks)
    memory = [0] * len(tasks)
    for _ in range(rounds):
        for i, (_, _, _, task) in enumerate(tasks):
            cpu, saved = _run(tower, task)
            best[i], memory[i] = min(best[i], cpu), saved
    per: dict[tuple, dict] = {}
    for (mix, cp, scheme, _), cpu, saved in zip(tasks, best, memory):
        row = per.setdefault((mix, cp), {"mix": mix, "cp": cp})
        row.setdefault(f"{scheme}_cpu", []).append(cpu)
        row.setdefault(f"{scheme}_mem", []).append(saved)
    rows = []
    for row in per.values():
        whole_mem, split_mem = max(row["whole_mem"]), max(row["split_mem"])
        rows.append(
            {
                "mix": row["mix"],
                "cp": row["cp"],
                "measured_whole": _max_over_mean(row["whole_cpu"]),
                "measured_split": _max_over_mean(row["split_cpu"]),
                "max_s_whole": max(row["whole_cpu"]),
                "max_s_split": max(row["split_cpu"]),
                "act_MiB_whole": whole_mem / 2**20,
                "act_MiB_split": split_mem / 2**20,
                "act_split/whole": split_mem / whole_mem,
            }
        )
    return rows
