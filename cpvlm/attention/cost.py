"""What each CP attention implementation sends and how long it should take: ``impl="auto"``.

Legend: W = cp_size, u = Ulysses size (hybrid: W = u * r), L = S_loc, B batch, D head dim,
Hq/Hkv heads (Hq_i/Hkv_i: Ulysses member i's, ``head_split``), e = element size of the dtype,
a = element size of the accumulators (8 for float64, else 4), N = B * L * D.

Bytes each rank sends per layer, forward + backward (counted on real ranks in
tests/attention/test_attn_wire.py):
    ring        (s-1) * 2 Hkv N e  +  (s-1) * 2 Hkv N e + s * 2 Hkv N a     (0 when s = 1)
                s = the ring's steps (``ring_steps``: W when a document spans ranks, 1 when
                every document is whole on one rank); K/V go s-1 hops forward and again
                backward; the dK/dV accumulators s-1 hops and one message back to their owner.
    allgather   (W-1) * 2 Hkv N e  +  (W-1) * 2 Hkv N a
                an all-gather of K/V, a reduce-scatter of the dK/dV accumulators.
    ulysses     N e [2 sum_{m!=i} Hq_m + 2 sum_{m!=i} Hkv_m + (u-1)(2 Hq_i + 2 Hkv_i)], u = W
                q, k, v out and dq, dk, dv back; out back and dout out (cpvlm/attention/ulysses.py).
    hybrid      the ulysses term over u, plus the ring term over r with L -> u L, Hkv -> Hkv_i.
In float32 with even head splits the ring sends about (6W - 4) Hkv N e and Ulysses about
4 (W-1)/W (Hq + Hkv) N e: Ulysses sends less for MHA at any W, for GQA 8/2 from W = 4 on (where
each K/V head goes to two ranks); ``wire_bytes`` has the exact figure for a plan.

Time (``estimate_seconds``), per layer, forward + backward, slowest rank, from the block schedule
of the mask (the same calls the implementations make, so a sliding window's skipped blocks and
its masked edges are counted as they run):
    compute of a call  = call_s + pairs * heads * D * pair_s   (x (1 + backward_factor) for both)
    message            = message_s + bytes / link_bytes_per_s
    ring:      sum over steps of max(slowest rank's calls, the transfer in flight) - overlap;
    allgather: all-gather + the slowest rank's calls + reduce-scatter - no overlap;
    ulysses:   four all-to-alls + the calls of ceil(Hq / u) heads over the whole sequence;
    hybrid:    four all-to-alls over u + the ring over r on the member's heads.
The constants (``CostModel``) for CPU/gloo were measured on this project's 2-core machine (torch
2.13, gloo over loopback, one thread per rank, while other jobs were running: load average ~11):
fused CPU flash kernel 1.3e-10 s per (pair x head x D) forward at D=64, backward 2.6 x forward;
~100 us fixed per call (the slicing and log-sum-exp merge around the kernel: an 8 x 8 block took
0.65 ms forward under a load average of 30, the kernel alone ~20 us on a quiet machine); gloo
~0.5 GB/s per rank for p2p and all-to-all, ~1 ms per message. With these, ``auto`` came within 15%
of the fastest measured implementation (CPU seconds) in 28 of the 36 configurations of
``benchmarks/attention.py`` (S 4096 to 16384, cp 2 and 4, one sequence and 64 packed documents;
load average 9 to 34): the misses are balanced-layout packed rows at cp 4, where it picked hybrid
and the ring was 1.3-1.4 x faster, and a few within the noise of a loaded machine. For CUDA/NCCL
they are published figures, not measured here (no GPU in this project's CI): FlashAttention-2 on
an H100, ~350 TFLOP/s = 4 D flops per pair and head in 1.1e-14 s per (pair x head x D), ~10 us per
call, NVLink ~200 GB/s per GPU achieved in all-to-all, ~20 us per message. On CPU the kernels
dominate (a 16k sequence computes for seconds, its transfers take milliseconds), so ``auto``
mostly counts kernel calls and balance there; on GPUs the transfers matter and overlap decides.
``auto`` takes the smallest estimate (ties: ring, allgather, ulysses, hybrid with the smaller u);
it is a pure function of the plan, the shapes and the dtype, so every rank picks the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from cpvlm.attention.mask_spec import MaskSpec
from cpvlm.attention.ring import ring_steps
from cpvlm.attention.schedule import attention_schedule
from cpvlm.attention.ulysses import head_split
from cpvlm.distributed.shard_plan import ShardPlan


@dataclass(frozen=True)
class CostModel:
    """Constants of the time model (seconds, bytes)."""

    pair_s: float
    """Forward seconds per visible (query, key) pair, per query head, per unit of head dim."""
    backward_factor: float
    """Backward time of a call over its forward time."""
    call_s: float
    """Fixed cost of one kernel call."""
    link_bytes_per_s: float
    """What one rank sends per second."""
    message_s: float
    """Fixed cost of one message (per peer in a collective)."""


CPU_GLOO = CostModel(
    pair_s=1.3e-10, backward_factor=2.6, call_s=100e-6, link_bytes_per_s=0.5e9, message_s=1e-3
)
CUDA_NCCL = CostModel(
    pair_s=1.1e-14, backward_factor=2.5, call_s=10e-6, link_bytes_per_s=200e9, message_s=20e-6
)


def cost_model(device_type: str) -> CostModel:
    return CUDA_NCCL if device_type == "cuda" else CPU_GLOO


@dataclass(frozen=True)
class Shapes:
    """What the cost depends on besides the plan and the mask."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def acc(self) -> int:
        return 8 if self.dtype == torch.float64 else 4


def candidates(cp_size: int) -> list[tuple[str, int | None]]:
    """Every (impl, ulysses_size) ``auto`` considers for a group of ``cp_size`` ranks."""
    if cp_size == 1:
        return [("ring", None)]
    hybrids = [("hybrid", u) for u in range(2, cp_size) if cp_size % u == 0]
    return [("ring", None), ("allgather", None), ("ulysses", None), *hybrids]


# ---- bytes ------------------------------------------------------------------------------------


def wire_bytes(
    impl: str, plan: ShardPlan, shapes: Shapes, ulysses_size: int | None = None
) -> list[int]:
    """Bytes each CP rank sends for one layer, forward + backward (formulas above)."""
    w, n = plan.cp_size, shapes.batch * plan.local_len * shapes.head_dim
    if impl in ("ring", "allgather"):
        return [_kv_bytes(impl, _hops(impl, plan), n * shapes.kv_heads, shapes)] * w
    u = w if impl == "ulysses" else ulysses_size
    heads = head_split(shapes.q_heads, shapes.kv_heads, u)
    out = []
    for rank in range(w):
        i = rank % u
        hq, hkv = _span(heads.q_range(i)), _span(heads.kv_range(i))
        sent = _ulysses_bytes(heads, i, n, shapes)
        if impl == "hybrid":
            ring = _hops("ring", plan.merge_ranks(u))
            sent += _kv_bytes("ring", ring, u * n * hkv, shapes) if hq else 0
        out.append(sent)
    return out


def _span(r: tuple[int, int]) -> int:
    return r[1] - r[0]


def _hops(impl: str, plan: ShardPlan) -> int:
    """The ring's steps (all-gather: the group size): what the K/V bytes scale with."""
    return ring_steps(attention_schedule(plan, True)) if impl == "ring" else plan.cp_size


def _kv_bytes(impl: str, w: int, kv_elems: int, shapes: Shapes) -> int:
    """Ring or all-gather bytes of K/V blocks of ``kv_elems`` elements (Hkv * N) each; ``w``:
    the ring's steps, or the all-gather's group size."""
    if w == 1:
        return 0
    forward = (w - 1) * 2 * kv_elems * shapes.elem
    if impl == "ring":
        return 2 * forward + w * 2 * kv_elems * shapes.acc
    return forward + (w - 1) * 2 * kv_elems * shapes.acc


def _ulysses_bytes(heads, i: int, n: int, shapes: Shapes) -> int:
    u = heads.size
    others = [m for m in range(u) if m != i]
    hq_out = sum(_span(heads.q_range(m)) for m in others)
    hkv_out = sum(_span(heads.kv_range(m)) for m in others)
    hq, hkv = _span(heads.q_range(i)), _span(heads.kv_range(i))
    return n * shapes.elem * (2 * hq_out + 2 * hkv_out + (u - 1) * (2 * hq + 2 * hkv))


# ---- time -------------------------------------------------------------------------------------


def _calls_s(calls: int, pairs: int, heads: int, d: int, m: CostModel) -> float:
    """Seconds of ``calls`` kernel calls computing ``pairs`` (query, key) pairs of ``heads``."""
    if heads == 0:
        return 0.0
    return calls * m.call_s + pairs * heads * d * m.pair_s


def _message(nbytes: float, peers: int, m: CostModel) -> float:
    return peers * m.message_s + nbytes / m.link_bytes_per_s if peers else 0.0


def _ring_s(
    plan: ShardPlan, mask: MaskSpec | bool, groups, kv_bytes: float, dkv_bytes: float, d, m, ranks
):
    """A ring over ``plan``'s ranks: per step, the slowest rank's calls or the transfer (the
    slowest of the first ``ranks`` ranks: a lower bound when that is not all of them)."""
    schedule, w = attention_schedule(plan, mask), plan.cp_size
    steps, total = ring_steps(schedule), 0.0
    work = [schedule.step_work(r) for r in range(min(ranks, w))]
    for i in range(steps):
        calls = max(
            sum(_calls_s(n[i], pairs[i], qb - qa, d, m) for qa, qb, _, _ in groups)
            for n, pairs in work
        )
        kv = _message(kv_bytes, 1, m) if i + 1 < steps else 0.0
        dkv = _message(dkv_bytes, 1, m) if steps > 1 else 0.0
        total += max(calls, kv) + max(calls * m.backward_factor, kv + dkv)
    return total


@lru_cache(maxsize=256)
def estimate_seconds(
    impl: str,
    plan: ShardPlan,
    mask: MaskSpec | bool,
    shapes: Shapes,
    ulysses_size: int | None = None,
    device_type: str = "cpu",
) -> float:
    """Modelled seconds of one layer's CP attention, forward + backward, on the slowest rank."""
    return _estimate(impl, plan, mask, shapes, ulysses_size, device_type, plan.cp_size)


def _view_ranks(impl: str, ulysses_size: int | None, plan: ShardPlan) -> int:
    """The ranks whose schedule rows ``impl`` reads (one per Ulysses group)."""
    if impl == "ulysses":
        return 1
    return plan.cp_size if impl in ("ring", "allgather") else plan.cp_size // ulysses_size


def _estimate(impl, plan, mask, shapes, ulysses_size, device_type, ranks: int) -> float:
    """``estimate_seconds`` from the rows of the first ``ranks`` ranks of the schedule it reads
    (``_view_ranks``): the slowest of them stands for the slowest rank, so with fewer than all
    it is a lower bound (every term is a max over ranks, summed: monotone), with all exact."""
    m, d, w = cost_model(device_type), shapes.head_dim, plan.cp_size
    n = shapes.batch * plan.local_len * d
    if impl in ("ring", "allgather"):
        kv, dkv = (2 * shapes.kv_heads * n * size for size in (shapes.elem, shapes.acc))
        whole = ((0, shapes.q_heads, 0, shapes.kv_heads),)
        if impl == "ring":
            return _ring_s(plan, mask, whole, kv, dkv, d, m, ranks)
        schedule = attention_schedule(plan, mask)
        calls = max(
            sum(_calls_s(n[i], pairs[i], shapes.q_heads, d, m) for i in range(w))
            for n, pairs in map(schedule.step_work, range(min(ranks, w)))
        )
        comm = _message((w - 1) * kv, w - 1, m) + _message((w - 1) * dkv, w - 1, m)
        return comm + calls * (1 + m.backward_factor)
    u = w if impl == "ulysses" else ulysses_size
    heads = head_split(shapes.q_heads, shapes.kv_heads, u)
    # The all-to-alls wait for the rank that sends most; each is a quarter of the bytes, roughly.
    a2a = max(_ulysses_bytes(heads, i, n, shapes) for i in range(u))
    comm = 4 * _message(a2a / 4, u - 1, m)
    busiest = max(range(u), key=lambda i: _span(heads.q_range(i)))
    groups = heads.groups(busiest)
    view = plan.merge_ranks(u)
    if impl == "ulysses" or view.cp_size == 1:
        n, pairs = attention_schedule(view, mask).step_work(0)
        calls = sum(_calls_s(n[0], pairs[0], qb - qa, d, m) for qa, qb, _, _ in groups)
        return comm + calls * (1 + m.backward_factor)
    kv, dkv = (2 * _span(heads.kv_range(busiest)) * u * n * e for e in (shapes.elem, shapes.acc))
    return comm + _ring_s(view, mask, groups, kv, dkv, d, m, ranks)


def choose_impl(
    plan: ShardPlan, mask: MaskSpec | bool, shapes: Shapes, device_type: str = "cpu"
) -> tuple[str, int | None]:
    """The (impl, ulysses_size) with the smallest ``estimate_seconds`` (``impl="auto"``; ties:
    the earlier candidate); ``mask`` a MaskSpec or a bool (``MaskSpec(causal=mask)``): the
    schedule counts its work.

    Each rank's rows cost about the same, so the candidates are tried by the ranks they read,
    fewest first, and a candidate is dropped as soon as a lower bound from some of its ranks
    (1, 2, 4, ...) already loses to the best so far: the same pick as estimating every one in
    full, without every rank's rows of a ring that cannot win."""
    options = candidates(plan.cp_size)
    order = sorted(range(len(options)), key=lambda k: (_view_ranks(*options[k], plan), k))
    best = None
    for k in order:
        impl, u = options[k]
        total, ranks = _view_ranks(impl, u, plan), 1
        while best is not None and ranks < total:
            bound = _estimate(impl, plan, mask, shapes, u, device_type, ranks)
            if (bound, k) > best:
                break
            ranks *= 2
        else:
            exact = estimate_seconds(impl, plan, mask, shapes, u, device_type)
            best = min(best or (exact, k), (exact, k))
    return options[best[1]]
