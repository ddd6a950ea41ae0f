"""Vision data parallelism: balance by modelled encoder cost, bytes per rank, encoder time per rank.

1. Towers: the cost model of four published vision towers, read from their configs
   (cpvlm.hf.vision_cost): linear MACs per patch and attention/linear work of one
   frame of 1024 and 4096 patches.
2. Balance, for three mixes (cpvlm/testing/vision_cases.py: the 12-image + video mix, NeMo
   Automodel's 4 x 1024 + 400 x 112 patches, a 50-frame video + 300 small images) and cp 2/4/8:
   max/mean of the modelled Qwen3-VL-8B cost per rank for equal item counts in contiguous blocks
   (public frameworks; a video is one item), patch balance and cost balance of frame units, and
   the bound max(unit cost)/mean that no whole-unit assignment beats; Qwen2.5-VL-7B's cost for
   patch vs cost balance; and the issue's pure patches**2 model for patch balance.
3. Measured: every rank's share (patch balance and cost balance, assigned with the Qwen3-VL-8B
   cost) encoded forward+backward one after another in this process, interleaved rounds, best
   of each (process CPU time with one thread; wall time too), on a timing tower whose
   attention/linear ratio equals Qwen3-VL-8B's at the real patch counts: units shrunk
   SCALE-fold in patches and the tower's width chosen so that its pair/linear coefficient ratio
   is SCALE times the real one (attention/linear of a frame is that ratio times its patches, so
   every unit keeps its real ratio). Frames of equal length run as one batched SDPA call, as a
   varlen kernel would on a GPU: no per-frame Python loop.
4. Bytes per rank on the 12-image + video mix (route vs all-gather vs all-reduce backward), as
   before, with the cost-balanced assignment: ring algorithms, an all-gather or reduce-scatter of
   W blocks of M rows sends and receives (W-1)*M rows per rank, an all-reduce of N rows
   2*(W-1)/W*N. Rows are bf16 Qwen3-VL-8B-sized: 4096 features plus 3 deepstack levels.
5. vision="split" (``--part split`` alone: ``vision_split.json``), for the mixes with units larger
   than a rank's share (cpvlm/testing/vision_cases.py SPLIT_MIXES: three 1600-patch images among
   23 small ones; one 12-frame 64 x 96-patch video) at cp 2/4/8:
   - modelled: max/mean of the Qwen3-VL-8B cost per rank, whole units (cost-balanced, what route
     mode does), split (``split_assignment``), and the whole-unit bound max(unit cost)/mean;
   - measured: every rank's share encoded forward+backward one after another in this process on
     the timing tower of 3., best of the rounds, CPU time. A rank's piece of a sharded unit runs
     its own patches through the blocks and attends, per block, over the whole unit's keys: its
     own and the other ranks' (given here as tensors that take a gradient, as the ring's K/V
     blocks do); what is timed is a rank's compute, not the K/V traffic (bytes: attention rows
     of benchmarks/attention.py);
   - activation memory: the bytes autograd saves for the backward during one rank's tower
     forward (saved-tensor hooks, each storage counted once; of a piece's K/V over the unit only
     its own rows, as ring attention saves), max over ranks, whole vs split. Activations grow
     with patches, balance is by cost: a rank of many small images holds more patches than one
     with a large image of the same cost, so the peak falls less than the time.

6. Audio beside vision (``--part audio`` alone: ``audio_dp.json``, seconds), the audio-heavy mix
   (cpvlm/testing/vision_cases.py AUDIO_HEAVY_MIX: 18 recordings of 5 to 120 s beside the 12
   images and the video) for Qwen3-Omni-30B-A3B's two encoders (its Qwen3-VL tower and its audio
   encoder, cost models from the published config) at cp 2/4/8, modelled max/mean of the summed
   encoder cost per rank: every item (image, video, recording) by count in contiguous blocks;
   each encoder's units balanced by size (patches, frames); each encoder's units balanced by its
   cost, separately; the clips balanced by cost around the vision units' per-rank cost (what
   cpvlm does: one EncoderDataParallel per encoder, the audio one given the vision loads as
   ``base_loads``); one joint cost balance over both; and the whole-unit bound.

    python benchmarks/vision_dp.py [--rounds 15] [--part all|split|audio]   # about 6 minutes
    python benchmarks/vision_dp.py --rounds 1 --out-dir DIR  # a trial run
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from _common import Clock, max_over_mean, parser, print_table, write_json
from torch import nn
from transformers import AutoConfig

from cpvlm import ShardPlan
from cpvlm.encoders import assign_units, contiguous_assignment, route_plan, vision_units
from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.encoders.split_assign import split_assignment
from cpvlm.hf.vision_cost import vision_cost
from cpvlm.testing.vision_cases import (
    AUDIO_HEAVY_MIX,
    CURRENT_MIX,
    MIXES,
    PUBLISHED_TOWERS,
    SPLIT_MIXES,
)

MERGE = 2
CPS = (2, 4, 8)
TARGET = "Qwen3-VL-8B"
SCALE = 8  # timing units have 1/SCALE of the real patches (every mix's unit sizes divide by 8)
FEATURES = 4096 * 4  # main + 3 deepstack levels, packed into one collective
BYTES_PER_VALUE = 2  # bf16
TEXT_PER_ITEM = 64


def published_costs() -> dict[str, EncoderCost]:
    return {
        name: vision_cost(AutoConfig.for_model(model_type, vision_config=vc))
        for name, (model_type, vc) in PUBLISHED_TOWERS.items()
    }


def attention_over_linear(cost: EncoderCost, side: int) -> float:
    linear = cost.linear_per_patch * side * side
    return (cost.unit_cost((1, side, side)) - linear) / linear


def tower_rows(costs: dict[str, EncoderCost]) -> list[dict]:
    return [
        {
            "tower": name,
            "full_blocks": c.full_blocks,
            "windowed_blocks": c.windowed_blocks,
            "window": c.window,
            "linear_MMAC_per_patch": c.linear_per_patch / 1e6,
            "pair_MAC": c.pair,
            "attn/linear_1024": attention_over_linear(c, 32),
            "attn/linear_4096": attention_over_linear(c, 64),
        }
        for name, c in costs.items()
    ]


def balance(costs: list[int], per_rank: list[list[int]]) -> float:
    return max_over_mean(sum(costs[u] for u in units) for units in per_rank)


def _items_to_units(units, per_rank_items):
    return [[u for u, item in enumerate(units.items) if item in items] for items in per_rank_items]


def balance_rows(costs: dict[str, EncoderCost]) -> list[dict]:
    rows = []
    target, windowed = costs[TARGET], costs["Qwen2.5-VL-7B"]
    for mix, grids in MIXES.items():
        units = vision_units(torch.tensor(grids), MERGE)
        cost, cost_w = target.unit_costs(units), windowed.unit_costs(units)
        squares = [p * p for p in units.pixel_counts]
        for cp in CPS:
            by_patch = assign_units(units.pixel_counts, cp)
            by_count = _items_to_units(units, contiguous_assignment(units.num_items, cp))
            rows.append(
                {
                    "mix": mix,
                    "cp": cp,
                    "units": units.num_units,
                    "count": balance(cost, by_count),
                    "patch": balance(cost, by_patch),
                    "cost": balance(cost, assign_units(cost, cp)),
                    "bound": max(cost) / (sum(cost) / cp),
                    "qwen2.5_patch": balance(cost_w, by_patch),
                    "qwen2.5_cost": balance(cost_w, assign_units(cost_w, cp)),
                    "p^2_patch": balance(squares, by_patch),
                }
            )
    return rows


# ---- measured: a timing tower with Qwen3-VL-8B's attention/linear ratio --------------------


class _Block(nn.Module):
    def __init__(self, width: int, mlp: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp), nn.GELU(), nn.Linear(mlp, width))

    def forward(self, x_NF, groups, pieces=(), remote=(), ring_kv=None) -> torch.Tensor:
        """``groups``: (frames, length) runs of equal-length frames, rows in that order; then
        ``pieces`` (vision="split"): (local patches, unit patches) of sharded units, whose
        queries attend over the whole unit's keys, their own and ``remote``'s (the other ranks'
        K/V, one pair a piece). ``ring_kv``: a piece's K/V storage -> bytes of its own rows."""
        n, f = x_NF.shape
        qkv = self.qkv(self.norm1(x_NF))
        outs, start = [], 0
        for frames, length in groups:
            part = qkv[start : start + frames * length].view(frames, length, 3, self.heads, -1)
            q, k, v = part.permute(2, 0, 3, 1, 4).unbind(0)  # [frames, heads, length, d]
            out = F.scaled_dot_product_attention(q, k, v)
            outs.append(out.transpose(1, 2).reshape(frames * length, f))
            start += frames * length
        for (local, _), (rk, rv) in zip(pieces, remote):
            part = qkv[start : start + local].view(local, 3, self.heads, -1)
            q, k, v = part.permute(1, 2, 0, 3).unbind(0)  # [heads, local, d]
            local_bytes = k.numel() * k.element_size()
            k, v = torch.cat([k, rk], dim=1), torch.cat([v, rv], dim=1)
            for t in (k, v):
                ring_kv[t.untyped_storage().data_ptr()] = local_bytes
            # 4-d inputs, as for whole frames: the fused CPU kernel (3-d ones take the math path)
            out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
            outs.append(out.transpose(0, 1).reshape(-1, f))
            start += local
        x_NF = x_NF + self.proj(torch.cat(outs))
        return x_NF + self.mlp(self.norm2(x_NF))


class TimingTower(nn.Module):
    """Patch embedding, ``depth`` blocks (qkv, proj, a 2-matrix MLP), a merger (merge size 1)."""

    def __init__(self, width: int, *, depth: int = 2, heads: int = 2, pixel_dim: int = 64):
        super().__init__()
        real = PUBLISHED_TOWERS[TARGET][1]
        self.mlp = round(width * real["intermediate_size"] / real["hidden_size"])
        self.width, self.depth, self.pixel_dim = width, depth, pixel_dim
        self.embed = nn.Linear(pixel_dim, width, bias=False)
        self.blocks = nn.ModuleList(_Block(width, self.mlp, heads) for _ in range(depth))
        self.merger = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)
        )

    def vision_cost(self) -> EncoderCost:
        w = self.width
        linear = (
            self.pixel_dim * w
            + self.depth * block_linear_macs(w, self.mlp, gated=False)
            + 2 * w * w
        )
        return EncoderCost(linear_per_patch=linear, pair=2 * w, full_blocks=self.depth)

    def forward(self, x, groups, pieces=(), remote=None, ring_kv=None) -> torch.Tensor:
        """``remote``: per block, the other ranks' K/V of each piece (see ``_Block``)."""
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            x = block(x, groups, pieces, remote[i] if remote else (), ring_kv)
        return self.merger(x)


def timing_tower(target: EncoderCost) -> TimingTower:
    """The tower (width a multiple of its 2 heads) whose pair/linear ratio is nearest to
    SCALE times the target's: its frames of p / SCALE patches then have the target's
    attention/linear ratio at p patches."""
    want = SCALE * target.pair * target.full_blocks / target.linear_per_patch

    def ratio(w: int) -> float:
        c = TimingTower(w).vision_cost()
        return c.pair * c.full_blocks / c.linear_per_patch

    width = min(range(16, 512, 2), key=lambda w: abs(ratio(w) - want))
    return TimingTower(width)


def _share_input(frame_lens: list[int], pixel_dim: int, gen: torch.Generator):
    """Frames sorted by length (attention is per frame, so order does not change the work)."""
    lens = sorted(frame_lens)
    groups: list[tuple[int, int]] = []
    for n in lens:
        if groups and groups[-1][1] == n:
            groups[-1] = (groups[-1][0] + 1, n)
        else:
            groups.append((1, n))
    return torch.randn(sum(lens), pixel_dim, generator=gen), groups


def _encode_once(tower: TimingTower, x: torch.Tensor, groups) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one forward+backward. With one thread, CPU time is the
    work this process did: on a machine shared with others it is far steadier than wall time."""
    tower.zero_grad(set_to_none=True)
    clock = Clock()
    if groups:
        tower(x, groups).sum().backward()
    return clock.cpu(), clock.wall()


def _timing_tasks(target: EncoderCost, tower: TimingTower, gen) -> list[tuple]:
    """(mix, cp, scheme, input, groups, modelled cost) for every rank's share. Scheme "same"
    is the control: the cost-balanced rank 0 share, cp times; its max/mean is the noise floor
    of the measurement (a max over cp noisy timings exceeds their mean even when equal)."""
    tcost = tower.vision_cost()
    tasks = []
    for mix, grids in MIXES.items():
        units = vision_units(torch.tensor(grids), MERGE)
        cost = target.unit_costs(units)
        for cp in CPS:
            by_cost = assign_units(cost, cp)
            schemes = {
                "patch": assign_units(units.pixel_counts, cp),
                "cost": by_cost,
                "same": [by_cost[0]] * cp,
            }
            # Rank r of every scheme side by side, so that drifting load hits them alike.
            for r in range(cp):
                for scheme, per_rank in schemes.items():
                    lens = [units.pixel_counts[u] // SCALE for u in per_rank[r]]
                    x, groups = _share_input(lens, tower.pixel_dim, gen)
                    modelled = sum(tcost.unit_cost((1, 1, n)) for n in lens)
                    tasks.append((mix, cp, scheme, x, groups, modelled))
    # Calibration: CPU seconds per modelled MAC of small frames (attention ~0.2% of the work)
    # and of 1024-patch frames (real 8192 patches: attention ~1.1x the linear work).
    for name, lens in (("linear-bound", [14] * 400), ("attention-heavy", [1024] * 5)):
        x, groups = _share_input(lens, tower.pixel_dim, gen)
        tasks.append(
            (name, 0, "calibration", x, groups, sum(tcost.unit_cost((1, 1, n)) for n in lens))
        )
    return tasks


def _best_times(tower: TimingTower, tasks: list[tuple], rounds: int) -> list[tuple[float, float]]:
    _encode_once(tower, tasks[0][3], tasks[0][4])  # warm-up
    best = [(float("inf"), float("inf"))] * len(tasks)
    # Interleaved rounds, best of each: robust to other load on the machine drifting over time.
    for _ in range(rounds):
        for i, task in enumerate(tasks):
            cpu, wall = _encode_once(tower, task[3], task[4])
            best[i] = (min(best[i][0], cpu), min(best[i][1], wall))
    return best


def timing_rows(target: EncoderCost, rounds: int) -> tuple[list[dict], dict]:
    torch.manual_seed(0)
    tower = timing_tower(target)
    tcost = tower.vision_cost()
    tasks = _timing_tasks(target, tower, torch.Generator().manual_seed(0))
    best = _best_times(tower, tasks, rounds)
    rows: dict[tuple, dict] = {}
    calibration = {}
    for (mix, cp, scheme, _x, _g, modelled), (cpu, wall) in zip(tasks, best):
        if scheme == "calibration":
            calibration[f"{mix}_cpu_s_per_GMAC"] = cpu / modelled * 1e9
            continue
        row = rows.setdefault((mix, cp), {"mix": mix, "cp": cp})
        row.setdefault(f"{scheme}_cpu_s", []).append(round(cpu, 4))
        row.setdefault(f"{scheme}_wall_s", []).append(round(wall, 4))
        row.setdefault(f"{scheme}_model", []).append(modelled)
    for row in rows.values():
        for scheme in ("patch", "cost", "same"):
            for what, key in (("measured", "cpu_s"), ("wall", "wall_s"), ("modelled", "model")):
                v = row[f"{scheme}_{key}"]
                row[f"{what}_{scheme}"] = max(v) / (sum(v) / len(v))
            row.pop(f"{scheme}_model")
        row.pop("modelled_same")
    info = {
        "width": tower.width,
        "mlp": tower.mlp,
        "depth": tower.depth,
        "pixel_dim": tower.pixel_dim,
        "scale": SCALE,
        "pair_over_linear": tcost.pair * tcost.full_blocks / tcost.linear_per_patch,
        "target_pair_over_linear_x_scale": SCALE
        * target.pair
        * target.full_blocks
        / target.linear_per_patch,
        "rounds": rounds,
        **calibration,
    }
    return list(rows.values()), info


# ---- bytes per rank on the 12-image + video mix ---------------------------------------------


def _layout(grids) -> torch.Tensor:
    """TEXT_PER_ITEM text tokens before each item, then its rows: positions of the rows."""
    positions, cursor = [], 0
    for t, h, w in grids:
        cursor += TEXT_PER_ITEM
        rows = t * h * w // MERGE**2
        positions.append(torch.arange(cursor, cursor + rows))
        cursor += rows
    return torch.cat(positions)


def route_rows(units, per_rank, positions, seq_len, cp) -> tuple[int, int]:
    """Max over ranks of rows sent and rows received by routing (self-sends excluded)."""
    plan = ShardPlan(seq_len, cp)
    owner_of_unit = torch.empty(units.num_units, dtype=torch.long)
    for r, us in enumerate(per_rank):
        owner_of_unit[us] = r
    row_ranks = torch.repeat_interleave(owner_of_unit, torch.tensor(units.row_counts))
    row_positions = plan.padded_index[positions]
    sent, received = [], []
    for r in range(cp):
        rp = route_plan(row_ranks, row_positions, plan, r)
        sent.append(sum(rp.send_counts) - rp.send_counts[r])
        received.append(sum(rp.recv_counts) - rp.recv_counts[r])
    return max(sent), max(received)


def mib(rows: float) -> float:
    return rows * FEATURES * BYTES_PER_VALUE / 2**20


def comm_rows(target: EncoderCost) -> list[dict]:
    units = vision_units(torch.tensor(CURRENT_MIX), MERGE)
    positions = _layout(CURRENT_MIX)
    seq_len = int(positions[-1]) + 1 + TEXT_PER_ITEM
    rows = []
    for cp in CPS:
        per_rank = assign_units(target.unit_costs(units), cp)
        m = max(sum(units.row_counts[u] for u in us) for us in per_rank)
        gather_rows = (cp - 1) * m  # sent = received, forward (all-gather) and backward (RS)
        allreduce_rows = 2 * (cp - 1) / cp * (cp * m)  # all-reduce of the padded gather
        sent, received = route_rows(units, per_rank, positions, seq_len, cp)
        route_max = max(sent, received)  # backward is the transpose: sent <-> received
        rows.append(
            {
                "cp": cp,
                "route_fwd_send_MiB": mib(sent),
                "route_fwd_recv_MiB": mib(received),
                "allgather_fwd_MiB": mib(gather_rows),
                "allgather_bwd_rs_MiB": mib(gather_rows),
                "allgather_bwd_allreduce_MiB": mib(allreduce_rows),
                "route_over_allgather": route_max / gather_rows,
                "times_cp": route_max / gather_rows * cp,
            }
        )
    return rows


# ---- vision="split": units larger than a rank's share ----------------------------------------


def split_balance_rows(target: EncoderCost) -> list[dict]:
    rows = []
    for mix, grids in SPLIT_MIXES.items():
        units = vision_units(torch.tensor(grids), MERGE)
        cost = target.unit_costs(units)
        for cp in CPS:
            sa = split_assignment(cost, units.row_counts, cp)
            rows.append(
                {
                    "mix": mix,
                    "cp": cp,
                    "units": units.num_units,
                    "sharded": len(sa.split),
                    "bound": max(cost) / (sum(cost) / cp),
                    "whole": balance(cost, assign_units(cost, cp)),
                    "split": max_over_mean(sa.rank_costs(cost)),
                }
            )
    return rows


def _split_shares(target: EncoderCost, grids, cp: int) -> dict[str, list]:
    """Per scheme, per rank: (whole frame lengths, pieces (local patches, unit patches)), in
    timing-tower patches (real / SCALE)."""
    units = vision_units(torch.tensor(grids), MERGE)
    cost = target.unit_costs(units)
    whole = assign_units(cost, cp)
    sa = split_assignment(cost, units.row_counts, cp)
    m2 = MERGE * MERGE
    out = {"whole": [], "split": []}
    for r in range(cp):
        out["whole"].append(([units.pixel_counts[u] // SCALE for u in whole[r]], []))
        pieces = [
            ((b - a) * m2 // SCALE, units.pixel_counts[u] // SCALE) for u, a, b in sa.pieces(r)
        ]
        out["split"].append(([units.pixel_counts[u] // SCALE for u in sa.whole[r]], pieces))
    return out


def _split_task(tower: TimingTower, share, gen: torch.Generator):
    """(input, groups, pieces, remote): a rank's whole frames, then its pieces' patches; per
    block and piece, the other ranks' K/V of the unit as leaves that take a gradient."""
    lens, pieces = share
    x, groups = _share_input(lens, tower.pixel_dim, gen)
    local = [p for p, _ in pieces]
    x = torch.cat([x, torch.randn(sum(local), tower.pixel_dim, generator=gen)])
    heads = tower.blocks[0].heads
    d = tower.width // heads
    remote = [
        [
            tuple(torch.randn(heads, n - p, d, generator=gen).requires_grad_() for _ in range(2))
            for p, n in pieces
        ]
        for _ in tower.blocks
    ]
    return x, groups, pieces, remote


def _split_encode_once(tower: TimingTower, task) -> tuple[float, int]:
    """(CPU seconds of one forward+backward, bytes saved for the backward). Of a piece's K/V
    over the whole unit only its own rows count: what ring attention saves (its own K/V; the
    other ranks' blocks travel again in the backward)."""
    x, groups, pieces, remote = task
    tower.zero_grad(set_to_none=True)
    if not len(x):
        return 0.0, 0
    saved: dict[int, int] = {}
    ring_kv: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        saved[ptr] = ring_kv.get(ptr, t.untyped_storage().nbytes())
        return t

    clock = Clock()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tower(x, groups, pieces, remote, ring_kv)
    out.sum().backward()
    return clock.cpu(), sum(saved.values())


def split_timing_rows(target: EncoderCost, tower: TimingTower, rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    tasks = []
    for mix, grids in SPLIT_MIXES.items():
        for cp in CPS:
            shares = _split_shares(target, grids, cp)
            for r in range(cp):  # rank r of both schemes side by side: drifting load hits both
                for scheme in ("whole", "split"):
                    tasks.append((mix, cp, scheme, _split_task(tower, shares[scheme][r], gen)))
    _split_encode_once(tower, tasks[0][3])  # warm-up
    best = [float("inf")] * len(tasks)
    memory = [0] * len(tasks)
    for _ in range(rounds):
        for i, (_, _, _, task) in enumerate(tasks):
            cpu, saved = _split_encode_once(tower, task)
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
                "measured_whole": max_over_mean(row["whole_cpu"]),
                "measured_split": max_over_mean(row["split_cpu"]),
                "max_s_whole": max(row["whole_cpu"]),
                "max_s_split": max(row["split_cpu"]),
                "act_MiB_whole": whole_mem / 2**20,
                "act_MiB_split": split_mem / 2**20,
                "act_split/whole": split_mem / whole_mem,
            }
        )
    return rows


def split_rows(target: EncoderCost, rounds: int) -> dict:
    """Item 5: the vision="split" tables, printed; returned for the JSON."""
    bal = split_balance_rows(target)
    print_table(
        bal,
        list(bal[0]),
        f"vision='split': modelled max/mean per rank ({TARGET} cost): whole units (cost-balanced), "
        "sharded units, the whole-unit bound",
    )
    print()
    torch.manual_seed(0)
    tower = timing_tower(target)
    timing = split_timing_rows(target, tower, rounds)
    print_table(
        timing,
        list(timing[0]),
        f"vision='split': encoder fwd+bwd max/mean per rank (CPU s, best of {rounds}) and the "
        f"largest rank's saved activations, timing tower width {tower.width}, units / {SCALE}, "
        f"load average {os.getloadavg()[0]:.1f}",
    )
    print()
    return {"mixes": SPLIT_MIXES, "balance": bal, "encoder": timing}


def audio_rows() -> list[dict]:
    """Item 6: the audio-heavy mix under Qwen3-Omni-30B-A3B's two encoders."""
    from cpvlm.families.qwen3_omni_moe import qwen3_omni_30b_a3b_config, qwen3_omni_audio_cost
    from cpvlm.families.qwen3_vl import qwen3_vl_vision_cost

    config = qwen3_omni_30b_a3b_config()
    vision_cost = qwen3_vl_vision_cost(config.vision_config)
    audio_cost = qwen3_omni_audio_cost(config.audio_config)
    units = vision_units(torch.tensor(AUDIO_HEAVY_MIX["vision"]), MERGE)
    clips = AUDIO_HEAVY_MIX["audio"]
    v_cost = vision_cost.unit_costs(units)
    a_cost = [audio_cost.unit_cost((1, 1, n)) for n in clips]
    cost = v_cost + a_cost  # vision units, then clips
    nv = len(v_cost)

    def both(v_per_rank, a_per_rank):
        return [list(v) + [nv + a for a in c] for v, c in zip(v_per_rank, a_per_rank)]

    rows = []
    for cp in CPS:
        items = [
            *(("v", i) for i in range(units.num_items)),
            *(("a", i) for i in range(len(clips))),
        ]
        blocks = contiguous_assignment(len(items), cp)
        by_count = [
            [u for u, item in enumerate(units.items) if ("v", item) in {items[i] for i in b}]
            + [nv + a for a in range(len(clips)) if ("a", a) in {items[i] for i in b}]
            for b in blocks
        ]
        by_size = both(assign_units(units.pixel_counts, cp), assign_units(clips, cp))
        v_cp = assign_units(v_cost, cp)
        by_cost = both(v_cp, assign_units(a_cost, cp))
        v_loads = [sum(v_cost[u] for u in mine) for mine in v_cp]
        around = both(v_cp, assign_units(a_cost, cp, v_loads))
        rows.append(
            {
                "cp": cp,
                "units": len(cost),
                "audio_share": round(sum(a_cost) / sum(cost), 3),
                "count": balance(cost, by_count),
                "size": balance(cost, by_size),
                "cost_per_encoder": balance(cost, by_cost),
                "cost_around_vision": balance(cost, around),
                "cost_joint": balance(cost, assign_units(cost, cp)),
                "bound": max(1.0, max(cost) / (sum(cost) / cp)),
            }
        )
    return rows


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    p.add_argument(
        "--part",
        choices=("all", "split", "audio"),
        default="all",
        help="split: item 5 only; audio: item 6 only",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    audio = audio_rows()
    print_table(
        audio,
        list(audio[0]),
        "Audio-heavy mix, Qwen3-Omni-30B-A3B encoders: modelled max/mean of the summed encoder "
        "cost per rank",
    )
    print()
    if args.part == "audio":
        write_json(
            args.out_dir,
            "audio_dp",
            {"mix": AUDIO_HEAVY_MIX, "balance": audio, "load_average": os.getloadavg()},
        )
        return
    costs = published_costs()
    split = split_rows(costs[TARGET], args.rounds)
    if args.part == "split":
        write_json(args.out_dir, "vision_split", {**split, "load_average": os.getloadavg()})
        return
    towers = tower_rows(costs)
    print_table(
        towers,
        list(towers[0]),
        "Vision towers (published configs): forward MACs, attention/linear work of one frame",
    )
    print()
    bal = balance_rows(costs)
    print_table(
        bal,
        list(bal[0]),
        f"Modelled max/mean per rank ({TARGET} cost unless named): items by count, frame "
        "units by patches, by cost; the whole-unit bound",
    )
    print()
    timing, info = timing_rows(costs[TARGET], args.rounds)
    print_table(
        timing,
        [
            "mix",
            "cp",
            "measured_patch",
            "measured_cost",
            "modelled_patch",
            "modelled_cost",
            "measured_same",
            "wall_patch",
            "wall_cost",
        ],
        f"Encoder fwd+bwd max/mean per rank, CPU time (wall time at the end): timing tower "
        f"width {info['width']}, units / {SCALE}, best of {args.rounds}, load average "
        f"{os.getloadavg()[0]:.1f}",
    )
    ratio = info["attention-heavy_cpu_s_per_GMAC"] / info["linear-bound_cpu_s_per_GMAC"]
    print(
        f"CPU s per modelled GMAC: linear-bound {info['linear-bound_cpu_s_per_GMAC']:.4f}, "
        f"attention-heavy {info['attention-heavy_cpu_s_per_GMAC']:.4f} (ratio {ratio:.3f}); "
        "measured_same: the same share timed cp times (the noise floor)"
    )
    print()
    comm = comm_rows(costs[TARGET])
    print_table(
        comm,
        list(comm[0]),
        "Bytes per rank, 12-image + video mix (max over ranks; route backward = forward "
        "with send/recv swapped)",
    )
    write_json(
        args.out_dir,
        "vision_dp",
        {
            "mixes": {name: grids for name, grids in MIXES.items()},
            "published_towers": PUBLISHED_TOWERS,
            "towers": towers,
            "balance": bal,
            "timing_tower": info,
            "encoder_time": timing,
            "load_average": os.getloadavg(),
            "comm": comm,
            "features": FEATURES,
            "bytes_per_value": BYTES_PER_VALUE,
            "split": split,
            "audio": audio,
        },
    )


if __name__ == "__main__":
    main()
