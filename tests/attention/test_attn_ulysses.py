"""Ulysses and hybrid cp_attention (and ring / all-gather on the balanced layout) on real gloo ranks
against one-process SDPA with the dense mask built from the document lengths.

float64 tolerance 1e-10: both sides compute the same sums in float64 in different orders (the
all-to-alls only move values; blockwise log-sum-exp merging vs one softmax), so they agree to a
few ulps (~2e-15 measured); a wrong mask entry, a head sent to the wrong rank or a lost K/V
gradient moves results by O(1e-2) or more.
"""

import pytest
from attn_cases import case, errors, run_and_reference

from cpvlm.testing import run_distributed

HEADS = [(8, 2), (6, 2), (7, 1), (12, 4), (5, 5)]  # (Hq, Hkv): GQA, uneven splits, MQA, MHA
LAYOUTS = ("head_tail", "balanced")


def doc_configs(cp):
    return [
        [6 * cp + 1],  # one sequence, padded at its end
        [1, 2 * cp - 1, 40 * cp + 3, 24 * cp + 1],  # packed: documents shorter than 2*cp
        [max(1, cp - 1), 1],  # every document shorter than cp: a rank holds only padding
        [3] * 12 + [8 * cp],  # tiny documents: grouped into masked calls
    ]


def _cases(cp, impl, ulysses_size=None):
    """Every (causal, heads, layout) once; documents and head dim rotate through the list."""
    docs = doc_configs(cp)
    combos = [(c, h, lay) for c in (True, False) for h in HEADS for lay in LAYOUTS]
    return [
        case(
            docs[i % 4],
            impl,
            causal,
            hq,
            hkv,
            (32, 64)[i % 2],
            layout=layout,
            ulysses_size=ulysses_size,
            seed=i,
        )
        for i, (causal, (hq, hkv), layout) in enumerate(combos)
    ]


def _balanced_ring_and_allgather(cp):
    """Ring and all-gather on the balanced layout (head-tail: tests/attention/test_attn_exact.py)."""
    docs = doc_configs(cp)
    combos = [(impl, causal) for impl in ("ring", "allgather") for causal in (True, False)]
    return [
        case(docs[j], impl, causal, *HEADS[(i + j) % 5], (32, 64)[j % 2], layout="balanced", seed=i)
        for i, (impl, causal) in enumerate(combos)
        for j in (1, 2 + i % 2)
    ]


def _check(cases, cp, tol):
    ranks = run_distributed(run_and_reference, cp, cases, timeout=300)
    checked = 0
    for c, name, err, padding_zero in errors(cases, ranks, cp):
        assert err <= tol, f"{name} rel err {err:.2e} for cp={cp} {c}"
        # Padding: outputs exactly 0, and not one gradient bit reaches or leaves it.
        assert padding_zero, f"{name} nonzero at padding, {c}"
        checked += 1
    assert checked == 4 * len(cases)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_float64_ulysses_and_balanced_layout_match_one_process(cp):
    cases = _cases(cp, "ulysses") + _balanced_ring_and_allgather(cp)
    if cp == 1:  # one rank: no all-to-all, and both layouts hold everything; keep one layout
        cases = [c for c in cases if c["impl"] != "ulysses" or c["layout"] == "head_tail"]
    if cp >= 3:
        # Fewer query heads than ranks: some ranks get none and still join every all-to-all.
        cases.append(case([5 * cp + 2, 3], "ulysses", True, 2, 1, 32, seed=98))
    cases.append(case([5 * cp + 2, 3], "auto", True, 8, 2, 32, scale=0.37, seed=99))
    _check(cases, cp, 1e-10)


def test_float64_hybrid_2x2_matches_one_process():
    cases = _cases(4, "hybrid", ulysses_size=2)
    # The degenerate grids (1 x 4: a ring through the hybrid path; 4 x 1: Ulysses and a
    # one-rank ring) and a member without query heads (Hq = 1 < u), whose ring has none either.
    cases += [
        case([37, 5, 2], "hybrid", True, 6, 2, 32, ulysses_size=1, seed=50),
        case([37, 5, 2], "hybrid", False, 6, 2, 64, ulysses_size=4, layout="balanced", seed=51),
        case([23, 6], "hybrid", True, 1, 1, 32, ulysses_size=2, seed=52),
    ]
    _check(cases, 4, 1e-10)


LOWPREC = [  # (docs, causal, (Hq, Hkv), layout)
    ([203], True, (8, 2), "head_tail"),
    ([1, 7, 90, 40], False, (6, 2), "balanced"),
    ([1, 7, 90, 40], True, (12, 4), "balanced"),
    ([203], False, (7, 1), "head_tail"),
]


def _lowprec(dtype):
    """Ulysses at cp 3 (uneven splits) and hybrid 2x2, each over LOWPREC, in one run per grid."""
    for cp, impl, u in ((3, "ulysses", None), (4, "hybrid", 2)):
        cases = [
            case(docs, impl, causal, hq, hkv, 64, dtype=dtype, ulysses_size=u, layout=lay, seed=i)
            for i, (docs, causal, (hq, hkv), lay) in enumerate(LOWPREC)
        ]
        yield cases, cp


def test_float32_within_1e5_of_float64():
    # float32 round-off is 6e-8; sums over ~200 keys and a few merges stay near 1e-6 (measured:
    # up to 1.2e-6), as for the ring.
    for cases, cp in _lowprec("float32"):
        _check(cases, cp, 1e-5)


def test_bfloat16_within_stated_tolerance_of_float64():
    # Inputs are the same bf16 values on both sides, so the error is bf16 arithmetic: unit
    # round-off u = 2**-8 = 3.9e-3, and one-process bf16 SDPA is already 2e-3..5e-3 off float64.
    # Ulysses rounds each output once (float32 accumulators, as one process does) and each dK/dV
    # once on the rank that computed it, plus once more where a split K/V head's two parts are
    # added in bf16; hybrid adds the ring's bf16 rounding of every block's partial result before
    # its float32 merge. Measured: up to 9.3e-3 (dk). 4u = 2**-6 bounds that with margin; a
    # wrong mask, a misplaced head or a dropped gradient is O(1e-1) or more.
    for cases, cp in _lowprec("bfloat16"):
        _check(cases, cp, 2**-6)
