"""Timings of the GPU check (check.py): the CP block schedule against SDPA flash, varlen against
one call per document. bf16, B=1, Hq/Hkv = 32/8, D = 128, causal.

Both comparisons compute the same (query, key) pairs on both sides. "CP block schedule" is every
rank's ring schedule run in one process (simulate_cp_attention: block kernels, lse merges, dK/dV
parts; no communication), which together is the causal attention of the whole sequence: what
one SDPA flash call computes. Their ratio is the overhead of cutting the work into blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cpvlm import ShardPlan
from cpvlm.attention import block
from cpvlm.attention.schedule import attention_schedule
from cpvlm.testing import simulate_cp_attention

HQ, HKV, D = 32, 8, 128


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` CUDA-event times of ``fn`` after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return min(times)


def _inputs(seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(1, HQ, seq_len, D), (1, HKV, seq_len, D), (1, HKV, seq_len, D), (1, HQ, seq_len, D)]
    return [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes]


def _sdpa_flash(q, k, v, dout) -> None:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        except RuntimeError:  # a torch whose SDPA flash path does not take GQA: expand for it
            g = HQ // HKV
            kv = [t.repeat_interleave(g, 1) for t in leaves[1:]]
            out = F.scaled_dot_product_attention(leaves[0], *kv, is_causal=True)
    out.backward(dout)


def speed_rows(cp: int, local_lens: list[int], *, repeats: int) -> list[dict]:
    rows = []
    for local_len in local_lens:
        rows.append(_speed_row(cp, local_len, repeats))
        torch.cuda.empty_cache()
    return rows


def _speed_row(cp: int, local_len: int, repeats: int) -> dict:
    seq_len = cp * local_len
    plan = ShardPlan(seq_len, cp)
    q, k, v, dout = _inputs(seq_len)
    shards = [[plan.shard(t, r, seq_dim=2) for r in range(cp)] for t in (q, k, v, dout)]
    ms_cp = best_ms(lambda: simulate_cp_attention(*shards, plan=plan), repeats)
    ms_sdpa = best_ms(lambda: _sdpa_flash(q, k, v, dout), repeats)
    # fwd 2 matmuls, bwd 5, over the causal pairs: 2 * 7 * pairs * D flops per head.
    flops = 14 * (seq_len * (seq_len + 1) // 2) * D * HQ
    return {"cp": cp, "local_len": local_len, "seq_len": seq_len, "cpvlm_ms": ms_cp,
            "sdpa_flash_ms": ms_sdpa, "ratio": ms_cp / ms_sdpa,
            "sdpa_tflops": flops / ms_sdpa / 1e9}  # fmt: skip


def _block_fwd_bwd(q, k, v, dout, segments_list) -> None:
    """Forward then backward of ``segments_list`` (each a tuple of segments: one call batch)."""
    acc = torch.float32
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    for segments in segments_list:
        block.attend_block(q, k, v, segments, out, lse, D**-0.5)
    out_q = out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(2, *k.shape, dtype=acc, device=q.device)
    for segments in segments_list:
        parts = block.attend_block_backward(dout, q, k, v, out_q, lse, segments, dq, D**-0.5)
        block.add_key_grads(dkv, parts)


def varlen_rows(n_docs: int, seq_len: int, *, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(n_docs, generator=g) + 0.25
    lens = (weights / weights.sum() * seq_len).long().clamp(min=1)
    lens[-1] += seq_len - int(lens.sum())
    plan = ShardPlan(seq_len, 1, doc_lens=lens.tolist())
    segments = attention_schedule(plan, True).segments(0, 0)
    rects = [p for seg in segments for p in (seg.parts or (seg,))]
    one_each = [(replace(r, overwrite=True),) for r in rects]
    q, k, v, dout = _inputs(plan.padded_len, seed=1)
    ms_varlen = best_ms(lambda: _block_fwd_bwd(q, k, v, dout, [segments]), repeats)
    ms_each = best_ms(lambda: _block_fwd_bwd(q, k, v, dout, one_each), repeats)
    return [
        {"documents": n_docs, "tokens": seq_len, "calls_varlen": 1, "calls_per_document":
         len(rects), "varlen_ms": ms_varlen, "per_document_ms": ms_each,
         "per_document_over_varlen": ms_each / ms_varlen}
    ]  # fmt: skip
