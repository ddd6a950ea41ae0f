"""shift_labels, count_valid_labels and token_mean_loss in one process, against plain references.

Distributed runs are simulated here by computing every rank's share with the ShardPlan and
combining them as the gradient sync does (a plain sum over ranks and microbatches). Tolerances:
float64 shares summed in a different order than the reference mean differ by a few ulps per term,
so 1e-12 relative leaves three orders of magnitude of margin at these sizes.
"""

import pytest
import torch
import torch.nn.functional as F

from cpvlm import ShardPlan
from cpvlm.loss import IGNORE_INDEX, count_valid_labels, shift_labels, token_mean_loss
from cpvlm.testing import rel_err

# ---- shift_labels ---------------------------------------------------------------------------


def test_shift_labels_one_document():
    labels = torch.tensor([[5, 6, 7, 8], [1, -100, 3, 4]])
    expected = torch.tensor([[6, 7, 8, -100], [-100, 3, 4, -100]])
    assert torch.equal(shift_labels(labels), expected)


def test_shift_labels_never_crosses_a_document_boundary():
    labels = torch.arange(10, 19).unsqueeze(0)  # documents [10 11 12] [13] [14 .. 18]
    out = shift_labels(labels, doc_lens=[3, 1, 5])
    expected = torch.tensor([[11, 12, -100, -100, 15, 16, 17, 18, -100]])
    assert torch.equal(out, expected)
    assert torch.equal(shift_labels(labels, doc_lens=torch.tensor([3, 1, 5])), expected)
    assert torch.equal(labels, torch.arange(10, 19).unsqueeze(0))  # out of place


def test_shift_labels_any_leading_dims_and_int32():
    labels = torch.arange(12, dtype=torch.int32).reshape(2, 1, 6)
    out = shift_labels(labels, doc_lens=[2, 4], ignore_index=-1)
    assert out.dtype == torch.int32
    assert out[1, 0].tolist() == [7, -1, 9, 10, 11, -1]


@pytest.mark.parametrize(
    "doc_lens, match",
    [([2, 2], "sum to 4 but labels have 5 tokens"), ([5, 0], r"doc_lens\[1\] = 0")],
)
def test_shift_labels_rejects_bad_doc_lens(doc_lens, match):
    with pytest.raises(ValueError, match=match):
        shift_labels(torch.zeros(1, 5, dtype=torch.long), doc_lens=doc_lens)


def test_shift_labels_rejects_float_labels():
    with pytest.raises(ValueError, match="integer tensor"):
        shift_labels(torch.zeros(1, 5))


# ---- count_valid_labels -----------------------------------------------------------------------


def test_count_valid_labels_over_microbatches_without_dp():
    a = torch.tensor([[1, -100, 2], [-100, -100, 3]])
    b = torch.tensor([[-100, 4]], dtype=torch.int32)
    assert count_valid_labels(a) == 3
    assert count_valid_labels([a, b]) == 4
    assert count_valid_labels([torch.full((2, 3), -100)]) == 0
    with pytest.raises(ValueError, match="got no labels"):
        count_valid_labels([])


# ---- token_mean_loss --------------------------------------------------------------------------


def _reference_mean(logits, labels):
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="mean"
    )


def test_shares_of_any_split_sum_to_the_mean_and_its_gradient():
    logits = torch.randn(3, 10, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (3, 10))
    labels[torch.rand(3, 10) < 0.5] = IGNORE_INDEX
    labels[1] = IGNORE_INDEX  # a whole row without a valid label
    n = count_valid_labels(labels)
    expected = _reference_mean(logits, labels)
    (g_expected,) = torch.autograd.grad(expected, logits)

    # Uneven pieces of the flattened positions, one of them without any valid label.
    flat_logits, flat_labels = logits.reshape(-1, 7), labels.reshape(-1)
    pieces = [torch.arange(0, 4), torch.arange(10, 20), torch.arange(4, 10), torch.arange(20, 30)]
    shares = [token_mean_loss(flat_logits[p], flat_labels[p], n) for p in pieces]
    assert shares[1].item() == 0.0 and shares[1].requires_grad
    total = sum(shares)
    (g_total,) = torch.autograd.grad(total, logits)
    assert rel_err(total, expected) <= 1e-12
    assert rel_err(g_total, g_expected) <= 1e-12


def test_a_rank_without_valid_labels_gets_a_connected_exact_zero():
    logits = torch.randn(2, 5, 9, dtype=torch.float64)
    logits[0, 1, 3] = float("inf")  # a non-finite padding row must not leak into the loss
    logits[1, 2, 0] = float("nan")
    logits.requires_grad_()
    labels = torch.full((2, 5), IGNORE_INDEX)
    loss = token_mean_loss(logits, labels, num_valid=17)
    assert loss.item() == 0.0 and loss.dtype == torch.float64
    assert loss.grad_fn is not None
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_non_finite_logits_on_ignored_rows_do_not_reach_valid_rows():
    logits = torch.randn(6, 4, dtype=torch.float64)
    labels = torch.tensor([1, IGNORE_INDEX, 2, IGNORE_INDEX, 0, 3])
    clean = logits.clone().requires_grad_()
    dirty = logits.clone()
    dirty[1] = float("inf")
    dirty[3, 2] = float("nan")
    dirty.requires_grad_()
    token_mean_loss(clean, labels, 4).backward()
    loss = token_mean_loss(dirty, labels, 4)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(dirty.grad).all()
    assert torch.equal(dirty.grad, clean.grad)


def test_zero_valid_labels_in_the_whole_step_gives_zero_loss_and_zero_grads():
    head = torch.nn.Linear(4, 6, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    labels = torch.full((3,), IGNORE_INDEX)
    loss = token_mean_loss(head(x), labels, count_valid_labels(labels))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in head.parameters())


def test_zero_count_with_local_valid_labels_is_an_error():
    with pytest.raises(ValueError, match="num_valid is 0 but this rank holds 2 valid labels"):
        token_mean_loss(torch.randn(3, 5), torch.tensor([1, -100, 4]), 0)


@pytest.mark.parametrize(
    "logits_shape, labels_shape, num_valid, match",
    [
        ((2, 3, 5), (2, 4), 3, "need labels of shape"),
        ((2, 5), (2,), -1, "num_valid must be an int >= 0"),
        ((2, 5), (2,), 1.5, "num_valid must be an int >= 0"),
    ],
)
def test_token_mean_loss_rejects_bad_inputs(logits_shape, labels_shape, num_valid, match):
    with pytest.raises(ValueError, match=match):
        token_mean_loss(
            torch.randn(logits_shape), torch.zeros(labels_shape, dtype=torch.long), num_valid
        )


def test_low_precision_logits_are_reduced_in_float32():
    logits = torch.randn(4, 8, 50, dtype=torch.float64).to(torch.bfloat16)
    labels = torch.randint(0, 50, (4, 8))
    labels[:, ::3] = IGNORE_INDEX
    loss = token_mean_loss(logits, labels, count_valid_labels(labels))
    assert loss.dtype == torch.float32
    expected = _reference_mean(logits.double(), labels)
    # Same bf16 inputs, float32 instead of float64 arithmetic over 50-way softmaxes: a few float32
    # ulps; in bf16 it would be ~1e-3.
    assert rel_err(loss, expected) <= 1e-6
    assert token_mean_loss(logits.double(), labels, 5).dtype == torch.float64


# ---- the padding scenario of the public fix, simulated rank by rank -------------------------------


class _TinyLM(torch.nn.Module):
    """Per-token model (no attention): shares of different ranks meet only in the parameters."""

    def __init__(self, vocab=32, dim=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, dtype=torch.float64)
        self.proj = torch.nn.Linear(dim, dim, dtype=torch.float64)
        self.head = torch.nn.Linear(dim, vocab, dtype=torch.float64)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.embed(ids))))


def _simulate_cp_step(model, microbatches, cp, doc_lens=None):
    """Loss and grads as cpvlm computes them: per-rank shares, summed over ranks and microbatches."""
    params = list(model.parameters())
    n = count_valid_labels([labels for _, labels in microbatches])
    loss = torch.zeros((), dtype=torch.float64)
    grads = [torch.zeros_like(p) for p in params]
    ranks_without_labels = 0
    for ids, labels in microbatches:
        plan = ShardPlan(ids.shape[1], cp, doc_lens=doc_lens)
        for r in range(cp):
            ids_loc = plan.shard(plan.pad(ids), r)
            labels_loc = plan.shard(plan.pad(labels, value=IGNORE_INDEX), r)
            ranks_without_labels += int((labels_loc == IGNORE_INDEX).all())
            share = token_mean_loss(model(ids_loc), labels_loc, n)
            for g, dg in zip(grads, torch.autograd.grad(share, params)):
                g += dg  # the sync: sum over dp x cp, no division
            loss = loss + share.detach()
    return loss, grads, ranks_without_labels


def _reference_step(model, microbatches):
    ids = torch.cat([i.reshape(-1) for i, _ in microbatches])
    labels = torch.cat([lab.reshape(-1) for _, lab in microbatches])
    loss = F.cross_entropy(model(ids), labels, ignore_index=IGNORE_INDEX, reduction="mean")
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def test_cp128_public_fix_padding_scenario():
    """CP=128, 56 valid label rows padded to 256: 200 padding rows, 72 ranks without a label."""
    model = _TinyLM()
    ids = torch.randint(0, 32, (1, 56))
    labels = torch.randint(0, 32, (1, 56))  # pre-shifted, every row valid
    plan = ShardPlan(56, 128)
    assert plan.padded_len == 256 and plan.padded_len - plan.seq_len == 200

    loss, grads, empty = _simulate_cp_step(model, [(ids, labels)], cp=128)
    assert empty == 72
    ref_loss, ref_grads = _reference_step(model, [(ids, labels)])
    assert rel_err(loss, ref_loss) <= 1e-12
    assert rel_err(grads[0], ref_grads[0]) <= 1e-12  # the embedding
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g, ref) <= 1e-12

    # What the public bug computed: a mean per rank, averaged over ranks that have labels.
    per_rank_means = [
        F.cross_entropy(
            model(plan.shard(plan.pad(ids), r))[0],
            plan.shard(plan.pad(labels, value=IGNORE_INDEX), r)[0],
            ignore_index=IGNORE_INDEX,
        )
        for r in range(128)
    ]
    assert sum(torch.isnan(m).item() for m in per_rank_means) == 72  # 0/0 on every empty rank


def test_packed_documents_and_microbatches_of_different_counts():
    """cp=8, two microbatches of packed documents with masked prompts and shifted labels."""
    model = _TinyLM()
    doc_lens = [5, 17, 3]
    microbatches = []
    for masked in (0.2, 0.7):
        ids = torch.randint(0, 32, (2, 25))
        raw = ids.clone()
        raw[torch.rand(2, 25) < masked] = IGNORE_INDEX
        microbatches.append((ids, shift_labels(raw, doc_lens=doc_lens)))
    counts = [count_valid_labels(lab) for _, lab in microbatches]
    assert counts[0] != counts[1]

    loss, grads, empty = _simulate_cp_step(model, microbatches, cp=8, doc_lens=doc_lens)
    ref_loss, ref_grads = _reference_step(model, microbatches)
    assert rel_err(loss, ref_loss) <= 1e-12
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g, ref) <= 1e-12
