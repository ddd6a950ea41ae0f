"""The fused CUDA block kernels, alone and inside every rank's ring schedule, against float64.

Skipped without a CUDA device (benchmarks/gpu/check.sh runs them on one). Shapes as in Qwen-VL
text attention: Hq/Hkv = 32/8 (GQA), D = 128. Inputs are drawn in float64 and rounded to the
dtype under test; the reference is float64 attention of the same rounded values, so the errors
are the kernels' and the merges' arithmetic alone. Tolerances (max-abs relative, ``rel_err``):
``CP_TOLERANCES`` for every rank's ring schedule (justified where it is defined, in
cpvlm/testing/attention_check.py: 1e-5 for fp32, 8u for bf16/fp16 with u their unit round-off);
one kernel call alone has half the roundings of the bf16/fp16 CP bound, so 4u there.
"""

import pytest
import torch

from cpvlm import ShardPlan
from cpvlm.attention import block
from cpvlm.attention.schedule import CAUSAL, FULL, MASKED, Segment
from cpvlm.distributed import compat
from cpvlm.testing import rel_err
from cpvlm.testing.attention_check import CP_TOLERANCES, cp_errors, random_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DOCS = {"single": [2001], "packed": [1, 15, 700, 37, 1200, 48]}


def _block_tolerance(dtype):
    return CP_TOLERANCES[dtype] if dtype == torch.float32 else CP_TOLERANCES[dtype] / 2


def _flash_on_this_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def test_each_dtype_gets_its_kernel():
    q = torch.empty(1, 4, 8, 128, device="cuda")
    assert compat.cuda_fused_kernel(q) is compat.CUDA_EFFICIENT
    assert compat.cuda_fused_kernel(q.double()) is None  # float64: the plain-torch path
    assert compat.cuda_fused_kernel(q[..., :100]) is None  # head dim not a multiple of 8
    if _flash_on_this_gpu():
        assert compat.cuda_fused_kernel(q.bfloat16()) is compat.CUDA_FLASH


def test_the_kernels_lse_layouts_are_those_of_the_meta_kernels():
    # compat reads the layouts from the meta kernels (_kernel_lse_shape); the CPU emulation
    # (cpvlm.testing.EmulatedKernel) states them too. Here the CUDA kernels' own, in full.
    aten = torch.ops.aten
    q = torch.randn(100, 4, 64, device="cuda", dtype=torch.float16)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32, device="cuda")
    qm, cum = q.to("meta"), cu.to("meta")
    calls = {
        "efficient packed": lambda q, cu: aten._efficient_attention_forward(
            q[None], q[None], q[None], None, cu, cu, 60, 60, 0.0, 0, True
        ),
        "efficient dense": lambda q, cu: aten._efficient_attention_forward(
            *(q.view(2, 50, 4, 64),) * 3, None, None, None, None, None, 0.0, 1, True
        ),
    }
    if _flash_on_this_gpu():
        calls["flash packed"] = lambda q, cu: aten._flash_attention_forward(
            q, q, q, cu, cu, 60, 60, 0.0, False, False
        )
        calls["flash dense"] = lambda q, cu: aten._flash_attention_forward(
            *(q.view(2, 50, 4, 64),) * 3, None, None, 50, 50, 0.0, True, False
        )
    want = {"efficient packed": (2, 4, 64), "efficient dense": (2, 4, 64),
            "flash packed": (4, 100), "flash dense": (2, 4, 50)}  # fmt: skip
    for name, call in calls.items():
        lse = call(q, cu)[1]
        assert tuple(lse.shape) == tuple(call(qm, cum)[1].shape) == want[name], name
        assert lse.dtype == torch.float32 and lse.is_contiguous(), name


# Rectangles of one block: documents of 100, 300, 1 and 299 rows; FULL ones see other key counts.
_FULL = [(0, 100, 0, 80), (100, 400, 80, 300), (400, 401, 300, 310), (401, 700, 310, 700)]
_CAUSAL = [(0, 100, 0, 100), (100, 400, 100, 400), (400, 401, 400, 401), (401, 700, 401, 700)]


def _segments(kind, rects):
    def pairs(q0, q1, k0, k1):
        n = q1 - q0
        return n * (n + 1) // 2 if kind == CAUSAL else n * (k1 - k0)

    return tuple(Segment(*r, kind, pairs(*r), overwrite=True) for r in rects)


def _block_reference(q, k, v, dout, segments, scale):
    """Per-rectangle float64 attention, out 0 / lse -inf on rows outside every rectangle."""
    b, hq, s, d = q.shape
    out = torch.zeros(b, hq, s, d, dtype=torch.float64, device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float64, device=q.device)
    grads = [torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in (q, k, v)]
    for seg in segments:
        args = [t.double()[:, :, idx] for t, idx in ((q, seg.rows), (k, seg.cols), (v, seg.cols))]
        o, l = block._math_forward(*args, causal=seg.kind == CAUSAL, scale=scale, mask=None)
        out[:, :, seg.rows], lse[:, :, seg.rows] = o, l
        dq, dk, dv = block._math_backward(
            dout.double()[:, :, seg.rows], *args, o, l, causal=seg.kind == CAUSAL, scale=scale,
            mask=None,
        )  # fmt: skip
        grads[0][:, :, seg.rows] += dq
        grads[1][:, :, seg.cols] += dk
        grads[2][:, :, seg.cols] += dv
    return out, lse, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["packed", "dense"])
@pytest.mark.parametrize("kind", [FULL, CAUSAL])
def test_block_kernels_forward_and_backward_match_float64(kind, layout, dtype):
    if dtype != torch.float32 and not _flash_on_this_gpu():
        pytest.skip("the flash kernel needs sm80+")
    rects = _CAUSAL if kind == CAUSAL else _FULL
    segments = _segments(kind, rects if layout == "packed" else rects[1:2])
    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(2, 32, 700, 128, device="cuda", generator=g) for _ in range(2))
    k, v = (torch.randn(2, 8, 700, 128, device="cuda", generator=g) for _ in range(2))
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    scale = 128**-0.5
    out_ref, lse_ref, grads_ref = _block_reference(q, k, v, dout, segments, scale)

    acc = block.acc_dtype(dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device="cuda")
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=acc, device="cuda")
    block.attend_block(q, k, v, segments, out_acc, lse_acc, scale)
    tol = _block_tolerance(dtype)
    assert rel_err(out_acc, out_ref) <= tol
    # The scores are float32 sums of exact products of the rounded inputs, so the lse is close
    # to exact (the kernels' fast exp/log: ~1e-6); a wrong lse layout scrambles it by O(1).
    seen = lse_ref > float("-inf")
    assert torch.equal(lse_acc > float("-inf"), seen)
    assert rel_err(lse_acc[seen], lse_ref[seen]) <= 1e-4

    # Backward from the float64 out and lse (the rows' final ones, as under CP).
    dq = torch.zeros(q.shape, dtype=acc, device="cuda")
    dkv = torch.zeros(2, *k.shape, dtype=acc, device="cuda")
    lse = lse_ref.masked_fill(~seen, 0).to(acc)
    parts = block.attend_block_backward(dout, q, k, v, out_ref.to(dtype), lse, segments, dq, scale)
    block.add_key_grads(dkv, parts)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dkv[0], dkv[1]), grads_ref):
        assert rel_err(got, want) <= tol, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_masked_call_on_the_efficient_kernel_keeps_rows_that_see_nothing_at_zero(dtype):
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(1, 32, 50, 128, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(1, 8, 70, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    visible = torch.rand(50, 70, generator=torch.Generator().manual_seed(3)) < 0.3
    visible[7] = False
    seg = Segment(0, 50, 0, 70, MASKED, int(visible.sum()), overwrite=True, visible=visible)
    acc = block.acc_dtype(dtype)
    out = torch.zeros(q.shape, dtype=acc, device="cuda")
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device="cuda")
    block.attend_block(q, k, v, (seg,), out, lse, 0.1)
    mask = torch.zeros(50, 70, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    want, _ = block._math_forward(
        *(t.double() for t in (q, k, v)), causal=False, scale=0.1, mask=mask.cuda()
    )
    assert torch.isfinite(out).all() and torch.all(out[:, :, 7] == 0)
    assert torch.all(lse[:, :, 7] == float("-inf"))
    assert rel_err(out, want) <= _block_tolerance(dtype)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_ranks_ring_schedule_on_the_gpu_matches_float64(cp, dtype):
    if dtype != torch.float32 and not _flash_on_this_gpu():
        pytest.skip("the flash kernel needs sm80+")
    for i, (docs, causal) in enumerate(
        [(DOCS["single"], True), (DOCS["packed"], True), (DOCS["packed"], False)]
    ):
        plan = ShardPlan(sum(docs), cp, doc_lens=docs)
        tensors = random_inputs(plan, seed=i, device="cuda", dtype=dtype)
        errors = cp_errors(plan, *tensors, causal=causal)
        for name, err in errors.items():
            assert err <= CP_TOLERANCES[dtype], f"{name} {err:.2e} cp={cp} {docs} causal={causal}"


def test_float64_on_cuda_takes_the_plain_path_exactly():
    docs = DOCS["packed"]
    plan = ShardPlan(sum(docs), 4, doc_lens=docs)
    tensors = random_inputs(plan, hq=8, hkv=2, d=64, device="cuda")
    for name, err in cp_errors(plan, *tensors, causal=True).items():
        assert err <= 1e-10, name
