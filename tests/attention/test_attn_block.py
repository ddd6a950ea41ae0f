"""The local block kernel with log-sum-exp: fused CPU path and plain-torch path, one process."""

import pytest
import torch
import torch.nn.functional as F

from cpvlm.attention import block
from cpvlm.testing import rel_err


def _inputs(sq=11, sk=13, hq=6, hkv=2, d=16):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, hq, sq, d, dtype=torch.float64, generator=g)
    k = torch.randn(2, hkv, sk, d, dtype=torch.float64, generator=g)
    v = torch.randn(2, hkv, sk, d, dtype=torch.float64, generator=g)
    return q, k, v


def _visible(kind, sq, sk):
    if kind == "full":
        return torch.ones(sq, sk, dtype=torch.bool)
    if kind == "causal":
        return torch.ones(sq, sk, dtype=torch.bool).tril()
    g = torch.Generator().manual_seed(5)
    visible = torch.rand(sq, sk, generator=g) < 0.4
    visible[0] = True
    return visible


@pytest.mark.parametrize("path", ["fused", "math"])
@pytest.mark.parametrize("kind", ["full", "causal", "masked"])
def test_block_forward_and_backward_match_sdpa(path, kind):
    q, k, v = _inputs()
    scale = 0.3
    visible = _visible(kind, q.shape[2], k.shape[2])
    mask = None
    if kind == "masked":
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    forward = block.block_forward if path == "fused" else block._math_forward
    backward = block.block_backward if path == "fused" else block._math_backward
    out, lse = forward(q, k, v, causal=kind == "causal", scale=scale, mask=mask)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        qr, kr.repeat_interleave(3, 1), vr.repeat_interleave(3, 1), attn_mask=visible, scale=scale
    )
    dout = torch.randn_like(ref)
    ref.backward(dout)
    scores = (q @ k.repeat_interleave(3, 1).transpose(-1, -2)) * scale
    ref_lse = scores.masked_fill(~visible, float("-inf")).logsumexp(-1)
    assert rel_err(out, ref) <= 1e-12
    assert rel_err(lse, ref_lse) <= 1e-12
    grads = backward(dout, q, k, v, out, lse, causal=kind == "causal", scale=scale, mask=mask)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert got.shape == want.shape  # dK/dV keep Hkv heads
        assert rel_err(got, want) <= 1e-12


@pytest.mark.parametrize("path", ["fused", "math"])
def test_a_row_that_sees_nothing_stays_finite(path):
    q, k, v = _inputs(sq=4, sk=5)
    mask = torch.zeros(4, 5, dtype=q.dtype)
    mask[2] = float("-inf")
    forward = block.block_forward if path == "fused" else block._math_forward
    backward = block.block_backward if path == "fused" else block._math_backward
    out, lse = forward(q, k, v, causal=False, scale=0.25, mask=mask)
    assert torch.all(out[:, :, 2] == 0) and torch.isfinite(lse).all()
    grads = backward(torch.ones_like(out), q, k, v, out, lse, causal=False, scale=0.25, mask=mask)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][:, :, 2] == 0)


def test_merge_of_two_key_halves_equals_attention_over_all_keys():
    q, k, v = _inputs(sk=14)
    out_all, lse_all = block.block_forward(q, k, v, causal=False, scale=0.2)
    out_acc = torch.zeros_like(out_all)
    lse_acc = torch.full(lse_all.shape, float("-inf"), dtype=torch.float64)
    for half, overwrite in ((slice(0, 6), True), (slice(6, 14), False)):
        out, lse = block.block_forward(q, k[:, :, half], v[:, :, half], causal=False, scale=0.2)
        block._merge(out_acc, lse_acc, out, lse, overwrite)
    assert rel_err(out_acc, out_all) <= 1e-13
    assert rel_err(lse_acc, lse_all) <= 1e-13
