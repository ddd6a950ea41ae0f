"""CP linear attention (Gated DeltaNet core) on CPU: cpvlm at CP 2 and 4 against the one-process layer.

    python benchmarks/linear_attention.py                     # S in 4096 8192 16384, a few minutes
    python benchmarks/linear_attention.py --seq-lens 4096 --repeats 1
    python benchmarks/linear_attention.py --seq-lens 512 --repeats 1 --out-dir DIR  # trial

The layer is what Qwen3.5's linear-attention layers do between their projections: a causal
depthwise conv (width 4, SiLU) over q|k|v, then the gated delta rule with q/k l2 norms; B=1,
Hk=2, Hv=4, K=V=128, float32, forward and backward. Every process runs one thread:
  (a) one process, transformers' torch functions (``causal_conv1d_fn``,
      ``torch_chunk_gated_delta_rule``) on the full sequence, plain autograd;
  (b) cpvlm at CP=1 (its own kernel, the same code path as CP, recomputing in the backward);
  (c) cpvlm at CP=2 and CP=4 on gloo (``cp_causal_conv1d`` + ``cp_gated_delta_rule``).
Times are CPU seconds of a process (its compute, not waiting), best repeat; "slowest/a" is the
slowest rank's over (a): the time ratio with one core per rank; "sum/a" is all ranks' CPU over
(a): the work CP adds. The cross-rank scan (all-gather of the chunk maps, the scan, its rerun
and gradient in the backward, the reduce-scatter) is timed alone on the same ranks with the same
shapes; "scan share" is its time over the rank's layer time. Bytes are per rank and layer, each
direction, from the shapes: the maps (forward all-gather = backward reduce-scatter) and the conv
halo (forward rows = backward gradients). Errors are max|x - x_a| / max|x_a| over the output.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _common import Clock, parser, print_table, write_json

from cpvlm import ShardPlan
from cpvlm.attention.linear import cp_causal_conv1d, cp_gated_delta_rule
from cpvlm.attention.linear import delta_rule as dr
from cpvlm.attention.linear.conv import halo_plan
from cpvlm.distributed.collectives import all_gather_dim0, reduce_scatter_dim0
from cpvlm.testing import rel_err, run_distributed
from cpvlm.testing.attention_check import unshard

B, HK, HV, DK, DV, WIDTH = 1, 2, 4, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV


def _inputs(seq_len):
    gen = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(B, seq_len, CHANNELS, generator=gen),
        "g": -0.5 * torch.rand(B, seq_len, HV, generator=gen),
        "beta": torch.rand(B, seq_len, HV, generator=gen),
        "weight": torch.randn(CHANNELS, WIDTH, generator=gen) * 0.5,
        "dout": torch.randn(B, seq_len, HV, DV, generator=gen),
    }


def _split(mixed):
    b, s, _ = mixed.shape
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], -1)
    return q.view(b, s, HK, DK), k.view(b, s, HK, DK), v.view(b, s, HV, DV)


def _one_process(t):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    x, w = t["x"].clone().requires_grad_(), t["weight"].clone().requires_grad_()
    mixed = hf.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    q, k, v = _split(mixed)
    out, _ = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=t["g"], beta=t["beta"], use_qk_l2norm_in_kernel=True
    )
    out.backward(t["dout"])
    return out.detach()


def _cp_layer(t, plan, rank, group):
    x = plan.shard(t["x"], rank).requires_grad_()
    w = t["weight"].clone().requires_grad_()
    mixed = cp_causal_conv1d(x, w, None, plan=plan, group=group, activation="silu")
    q, k, v = _split(mixed)
    g, beta = (plan.shard(t[n], rank) for n in ("g", "beta"))
    out = cp_gated_delta_rule(q, k, v, g, beta, plan=plan, group=group, use_qk_l2norm=True)
    out.backward(plan.shard(t["dout"], rank))
    return out.detach()


def _scan_alone(plan, rank, group):
    """The cross-rank part of cp_gated_delta_rule, forward and backward, on maps of its shape."""
    n = B * 2 * len(plan.doc_lens)
    maps = torch.randn(n, HV, DK, DV + DK)
    maps_all = all_gather_dim0(maps, group)
    states = dr._scan(maps_all, plan, rank, B, DV)
    with torch.enable_grad():
        leaf = maps_all.requires_grad_()
        (d_all,) = torch.autograd.grad(dr._scan(leaf, plan, rank, B, DV), leaf, states)
    reduce_scatter_dim0(d_all.contiguous(), group)


def _cpu(fn, *args):
    clock = Clock()
    out = fn(*args)
    return clock.cpu(), out


def _worker(rank, world_size, seq_lens, repeats, with_reference):
    torch.set_num_threads(1)
    group, rows = dist.group.WORLD, []
    warm, warm_plan = _inputs(256), ShardPlan(256, world_size)
    if with_reference:
        _one_process(warm)  # first calls import and resolve transformers' hub-kernel fallbacks
    _cp_layer(warm, warm_plan, rank, group)
    for s in seq_lens:
        t, plan = _inputs(s), ShardPlan(s, world_size)
        best = {"a": float("inf"), "cp": float("inf"), "scan": float("inf")}
        out_a = out_cp = None
        for _ in range(repeats):
            if with_reference:
                sec, out_a = _cpu(_one_process, t)
                best["a"] = min(best["a"], sec)
            dist.barrier()
            sec, out_cp = _cpu(_cp_layer, t, plan, rank, group)
            best["cp"] = min(best["cp"], sec)
            dist.barrier()
            best["scan"] = min(best["scan"], _cpu(_scan_alone, plan, rank, group)[0])
        rows.append({"seq_len": s, **best, "out": out_cp, "out_a": out_a})
    return rows


def _bytes(plan, rank):
    n = B * 2 * len(plan.doc_lens)
    maps = (plan.cp_size - 1) * n * HV * DK * (DK + DV) * 4
    halo = sum(halo_plan(plan, rank, WIDTH).recv_counts) * B * CHANNELS * 4
    return maps, halo


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    one = run_distributed(_worker, 1, args.seq_lens, args.repeats, True, timeout=3600)[0]
    rows = []
    for r in one:
        rows.append(
            {
                "S": r["seq_len"],
                "cp": 1,
                "a_s": r["a"],
                "rank_s": r["cp"],
                "slowest/a": r["cp"] / r["a"],
                "sum/a": r["cp"] / r["a"],
                "scan share": r["scan"] / r["cp"],
                "map MiB": 0.0,
                "halo KiB": 0.0,
                "err": f"{rel_err(r['out'], r['out_a']):.1e}",
            }
        )
    for r in one:
        del r["out"]
    for cp in (2, 4):
        ranks = run_distributed(_worker, cp, args.seq_lens, args.repeats, False, timeout=3600)
        for i, s in enumerate(args.seq_lens):
            a = one[i]["a"]
            times = [ranks[r][i]["cp"] for r in range(cp)]
            slow = max(range(cp), key=lambda r: times[r])
            outs = [ranks[r][i]["out"] for r in range(cp)]
            maps, halo = _bytes(ShardPlan(s, cp), slow)
            rows.append(
                {
                    "S": s,
                    "cp": cp,
                    "a_s": a,
                    "rank_s": times[slow],
                    "slowest/a": times[slow] / a,
                    "sum/a": sum(times) / a,
                    "scan share": ranks[slow][i]["scan"] / times[slow],
                    "map MiB": maps / 2**20,
                    "halo KiB": halo / 2**10,
                    "err": f"{rel_err(unshard(ShardPlan(s, cp), outs, 1), one[i]['out_a']):.1e}",
                }
            )
    rows.sort(key=lambda r: (r["S"], r["cp"]))
    columns = [
        "S",
        "cp",
        "a_s",
        "rank_s",
        "slowest/a",
        "sum/a",
        "scan share",
        "map MiB",
        "halo KiB",
        "err",
    ]
    load = os.getloadavg()
    print_table(
        rows, columns, title=f"CP linear attention, fwd+bwd, CPU seconds (load {load[0]:.1f})"
    )
    write_json(
        args.out_dir,
        "linear_attention",
        {
            "dims": {"B": B, "Hk": HK, "Hv": HV, "K": DK, "V": DV, "conv_width": WIDTH},
            "load_average": load,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
