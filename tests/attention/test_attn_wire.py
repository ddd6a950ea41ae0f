"""Bytes on the wire per rank for one layer's forward + backward, counted on real gloo ranks, equal
the formula of each implementation (``cpvlm.attention.cost.wire_bytes``, whose docstring and the
ulysses.py / hybrid.py docstrings state it). Besides them a call makes exactly one all-reduce:
the ranks' agreement on its inputs (``cpvlm.distributed.collectives.agree``)."""

import pytest
import torch
import torch.distributed as dist

from cpvlm import ShardPlan
from cpvlm.attention import Shapes, cp_attention, wire_bytes
from cpvlm.testing import run_distributed


class _Counter:
    """Counts what this rank sends in every torch.distributed call the attention may use.

    all-to-all: the splits sent to the other ranks; batch_isend_irecv: the isend tensors;
    all-gather: the input to each of the W-1 others; reduce-scatter: the W-1 slices that belong to
    the others. Anything else (all_reduce, broadcast, ...) is recorded by name so that a test fails
    on a collective it does not expect.
    """

    def __init__(self):
        self.sent = 0
        self.other = []
        self._saved = {}

    def _patch(self, name, count):
        original = getattr(dist, name, None)
        if original is None:
            return
        self._saved[name] = original

        def counted(*args, **kwargs):
            self.sent += count(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    def __enter__(self):
        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            w, me = dist.get_world_size(group), dist.get_rank(group)
            unit = input.numel() // max(input.shape[0], 1) * input.element_size()
            splits = input_split_sizes or [input.shape[0] // w] * w
            return sum(n for r, n in enumerate(splits) if r != me) * unit

        def p2p(ops):
            return sum(op.tensor.nbytes for op in ops if op.op is dist.isend)

        def gather(output, input, group=None, **kw):
            return (dist.get_world_size(group) - 1) * input.nbytes

        def scatter(output, input, group=None, **kw):
            return input.nbytes - output.nbytes

        self._patch("all_to_all_single", a2a)
        self._patch("batch_isend_irecv", p2p)
        for name in ("all_gather_single", "all_gather_into_tensor"):
            self._patch(name, gather)
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            self._patch(name, scatter)
        for name in ("all_reduce", "broadcast", "all_gather", "all_to_all", "send", "reduce"):
            self._patch(name, lambda *a, _n=name, **k: self.other.append(_n) or 0)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


CASES = [
    # (impl, ulysses_size, Hq, Hkv, dtype, causal, layout)
    ("ring", None, 8, 2, torch.float32, True, "head_tail"),
    ("allgather", None, 6, 2, torch.bfloat16, False, "balanced"),
    ("ulysses", None, 8, 2, torch.float32, True, "head_tail"),
    ("ulysses", None, 7, 1, torch.bfloat16, True, "balanced"),
    ("ulysses", None, 12, 4, torch.float64, False, "head_tail"),
    ("ulysses", None, 5, 5, torch.float32, True, "balanced"),
    ("hybrid", 2, 6, 2, torch.float32, True, "head_tail"),
    ("hybrid", 2, 5, 5, torch.bfloat16, False, "balanced"),
]


def _count(rank, world_size, cases):
    doc_lens = [1, 2 * world_size - 1, 20 * world_size + 3, 9]
    counts = []
    for impl, u, hq, hkv, dtype, causal, layout in cases:
        plan = ShardPlan(sum(doc_lens), world_size, doc_lens=doc_lens, layout=layout)
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(2, hq, plan.local_len, 32, generator=g).to(dtype).requires_grad_()
        k, v = (
            torch.randn(2, hkv, plan.local_len, 32, generator=g).to(dtype).requires_grad_()
            for _ in range(2)
        )
        with _Counter() as counter:
            out = cp_attention(
                q,
                k,
                v,
                plan=plan,
                group=dist.group.WORLD,
                impl=impl,
                causal=causal,
                ulysses_size=u,
            )
            out.float().sum().backward()
        counts.append((counter.sent, counter.other))
    return counts


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_bytes_sent_per_rank_equal_the_formula(cp):
    cases = [c for c in CASES if c[1] is None or cp % c[1] == 0]
    ranks = run_distributed(_count, cp, cases, timeout=120)
    doc_lens = [1, 2 * cp - 1, 20 * cp + 3, 9]
    for i, (impl, u, hq, hkv, dtype, _, layout) in enumerate(cases):
        plan = ShardPlan(sum(doc_lens), cp, doc_lens=doc_lens, layout=layout)
        expected = wire_bytes(impl, plan, Shapes(2, hq, hkv, 32, dtype), u)
        for rank, counts in enumerate(ranks):
            sent, other = counts[i]
            # The one agreement before the call's collectives (three int64s, outside the
            # formula; in a model forward only the first layer's call makes it).
            assert other == ["all_reduce"], f"{impl}: unexpected collectives {other}"
            assert sent == expected[rank], (impl, u, hq, hkv, dtype, rank, sent, expected[rank])
        if cp > 1:
            assert min(expected) > 0


def test_the_formula_gives_the_figures_worked_out_by_hand_from_the_docstrings():
    # N = B * L * D elements; the figures below are the docstring formulas evaluated by hand, so
    # that counted bytes (above) == wire_bytes == the written formula.
    def n_of(plan):
        return 2 * plan.local_len * 32

    plan = ShardPlan(100, 4)
    n = n_of(plan)
    # ring, W=4, Hkv=2, float32: 3 * 4N * 4 twice (K/V forward, again backward) + 4 * 4N * 4.
    assert wire_bytes("ring", plan, Shapes(2, 8, 2, 32, torch.float32)) == [160 * n] * 4
    # all-gather, bf16: 3 * 4N * 2 (K/V) + 3 * 4N * 4 (float32 dK/dV reduce-scatter).
    assert wire_bytes("allgather", plan, Shapes(2, 6, 2, 32, torch.bfloat16)) == [72 * n] * 4
    # Ulysses 6/2 over 4 ranks: query heads 1, 2, 1, 2 and one K/V head each (0, 0, 1, 1).
    # Rank 0: 2*(2+1+2) + 2*3 + 3*(2*1 + 2*1) = 28 N e; rank 1: 2*(1+1+2) + 2*3 + 3*(4+2) = 32.
    got = wire_bytes("ulysses", plan, Shapes(2, 6, 2, 32, torch.float32))
    assert got == [28 * 4 * n, 32 * 4 * n, 28 * 4 * n, 32 * 4 * n]
    # hybrid 2 x 2, 6/2, float32: Ulysses over 2 (heads 3 + 1 each): 2*3 + 2*1 + 1*(6+2) = 16 N e;
    # the ring over 2 on 2L positions with 1 K/V head: 1*2*(2*2N*1) e + 2*2*2N*1 a = 8N e + 8N a.
    got = wire_bytes("hybrid", plan, Shapes(2, 6, 2, 32, torch.float32), 2)
    assert got == [(16 * 4 + 8 * 4 + 8 * 4) * n] * 4
    # Ulysses 7/1 over 3 ranks, float64: query heads 2, 2, 3, one K/V head each (sent three
    # times, never expanded to 7). Rank 0: 2*(2+3) + 2*2 + 2*(4+2) = 26 N e; rank 2: 28.
    plan = ShardPlan(100, 3)
    n = n_of(plan)
    got = wire_bytes("ulysses", plan, Shapes(2, 7, 1, 32, torch.float64))
    assert got == [26 * 8 * n, 26 * 8 * n, 28 * 8 * n]


def _ring_whole_documents(rank, world_size, doc_lens):
    plan = ShardPlan(sum(doc_lens), world_size, doc_lens=doc_lens, layout="balanced")
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 4, plan.local_len, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, plan.local_len, 16, generator=g, requires_grad=True) for _ in "kv")
    with _Counter() as counter:
        cp_attention(q, k, v, plan=plan, group=dist.group.WORLD, impl="ring").sum().backward()
    return counter.sent, counter.other, [t.grad.abs().sum().item() for t in (q, k, v)]


@pytest.mark.parametrize("cp", [2, 3])
def test_a_ring_over_whole_documents_moves_no_kv(cp):
    """Balanced layout, every document whole on one rank: no rank needs another's K/V, so the
    ring runs its first step only and sends nothing (the formula says 0 too); exactness of such
    plans is tested in test_attn_ulysses.py (documents shorter than cp)."""
    doc_lens = [5, 3, 7, 4, 6, 2][: 2 * cp]
    plan = ShardPlan(sum(doc_lens), cp, doc_lens=doc_lens, layout="balanced")
    assert all(r >= 0 for r in plan.whole_on)  # the premise: nothing split
    assert wire_bytes("ring", plan, Shapes(1, 4, 2, 16, torch.float32)) == [0] * cp
    for sent, other, grads in run_distributed(_ring_whole_documents, cp, doc_lens, timeout=120):
        assert sent == 0 and other == ["all_reduce"]
        assert all(g > 0 for g in grads)  # the backward ran and reached q, k and v
