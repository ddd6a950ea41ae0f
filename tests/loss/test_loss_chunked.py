"""chunked_token_mean_loss against the unchunked loss of the same logits, and what it keeps.

The reference is ``token_mean_loss(F.linear(h, W, b), labels, N)``: the logits built whole, then
the CE of its valid rows. float64: the two compute the same terms and differ only in the order of
the sums over rows (chunk by chunk), a few ulps: 1e-12 relative leaves orders of magnitude.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from cpvlm.loss import IGNORE_INDEX, chunked_token_mean_loss, token_mean_loss
from cpvlm.testing import rel_err

V, D = 300, 16


def _inputs(dtype=torch.float64, shape=(2, 37), ignored=0.4, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, D, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, D, generator=g, dtype=torch.float64) / 4).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    labels = torch.randint(V, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignored] = IGNORE_INDEX
    return h, w, b, labels


def _loss_and_grads(fn, h, w, b):
    leaves = [t.detach().requires_grad_() for t in (h, w, b)]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_equals_unchunked_in_float64(chunk):
    h, w, b, labels = _inputs()
    n = int((labels != IGNORE_INDEX).sum()) + 5  # other microbatches hold 5 more labels

    def plain(h, w, b):
        return token_mean_loss(F.linear(h, w, b), labels, n)

    def chunked(h, w, b):
        return chunked_token_mean_loss(h, w, labels, n, bias=b, chunk_size=chunk)

    ref_loss, ref_grads = _loss_and_grads(plain, h, w, b)
    loss, grads = _loss_and_grads(chunked, h, w, b)
    assert rel_err(loss, ref_loss) <= 1e-12
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert rel_err(got, ref) <= 1e-12, name


def test_no_valid_label_gives_zero_and_zero_gradients():
    h, w, b, labels = _inputs()
    labels.fill_(IGNORE_INDEX)
    loss, grads = _loss_and_grads(
        lambda h, w, b: chunked_token_mean_loss(h, w, labels, 0, bias=b, chunk_size=8), h, w, b
    )
    assert float(loss) == 0.0
    assert all(g is not None and not g.any() for g in grads)


def test_bfloat16_matches_the_unchunked_bfloat16_loss():
    """bf16 logits, float32 softmax in both. The weight gradient is one bf16 matmul in the plain
    path and a float32 sum of per-chunk bf16 matmuls here: a few bf16 roundings (2**-8 = 4e-3
    each) apart, so 2e-2 relative; the loss and the hidden states' gradient see the same ops."""
    h, w, b, labels = _inputs(torch.bfloat16, shape=(1, 200))
    n = int((labels != IGNORE_INDEX).sum())
    ref_loss, ref_grads = _loss_and_grads(
        lambda h, w, b: token_mean_loss(F.linear(h, w, b), labels, n), h, w, b
    )
    loss, grads = _loss_and_grads(
        lambda h, w, b: chunked_token_mean_loss(h, w, labels, n, bias=b, chunk_size=32), h, w, b
    )
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert rel_err(loss, ref_loss) <= 1e-6
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    for got, ref in zip(grads, ref_grads, strict=True):
        assert rel_err(got.double(), ref.double()) <= 2e-2


def test_no_rows_by_vocabulary_tensor_is_kept_for_backward():
    """What autograd saves: the plain loss keeps [valid rows, V] (its log-softmax); the chunked
    one keeps the hidden rows, the weight and one log-sum-exp per row."""
    h, w, b, labels = _inputs(shape=(1, 400), ignored=0.0)
    n = int((labels != IGNORE_INDEX).sum())

    def saved(fn):
        shapes = []
        with saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            fn(*(t.detach().requires_grad_() for t in (h, w, b)))
        return shapes

    plain = saved(lambda h, w, b: token_mean_loss(F.linear(h, w, b), labels, n))
    chunked = saved(lambda h, w, b: chunked_token_mean_loss(h, w, labels, n, bias=b, chunk_size=50))
    assert (400, V) in plain
    assert all(V not in s or s == (V, D) or s == (V,) for s in chunked), chunked


def test_bad_arguments_are_named():
    h, w, b, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        chunked_token_mean_loss(h, w, labels, 5, chunk_size=0)
    with pytest.raises(ValueError, match="do not fit a weight of shape"):
        chunked_token_mean_loss(h[..., :3], w, labels, 5)
    with pytest.raises(ValueError, match="need labels of shape"):
        chunked_token_mean_loss(h, w, labels[:, :3], 5)
