"""The tracker's "Gathered" and "Loss" categories (cpvlm.distributed.compat.memory_tracker) against
counts by hand: shapes times dtype sizes of what the head and the loss save for backward.

One rank of cp 2 on the tiny Qwen3-VL, text only (two documents, so the plan pads), no
activation checkpointing. What the loss saves, with ``n`` this rank's valid labels, ``S`` its
local length, ``V x D`` the head, ``c`` the compute dtype's size:
- both losses: the ``[1, S]`` bool mask of valid labels (``hidden[valid]``'s backward) and the
  ``n`` labels as int64;
- chunked: the ``n`` valid hidden rows (``c`` bytes each of D) and their float32 logsumexp;
- unchunked: the float32 log-softmax of the ``n`` valid rows (``[n, V]``) and cross-entropy's
  float32 0-d total weight; ``F.linear`` also saves its input, the ``[1, S, D]`` hidden states,
  made by the decoder (an activation, not the loss's).
Under FSDP2 (bf16 compute) the root unit holds the embedding, the final norm and the head, and
keeps them gathered to the backward: the head's ``[V, D]`` weight and the final norm's ``[D]``
weight are the gathered parameters saved. Without FSDP nothing is gathered.
"""

from __future__ import annotations

import pytest
import torch

from cpvlm import ShardPlan
from cpvlm.hf import TINY_MODELS
from cpvlm.simulate.batch import SequenceSpec, build_batch
from cpvlm.simulate.rank import Setup, simulate_step

SPEC = SequenceSpec(254, docs=2)  # documents of 127 tokens, each padded to 128 at cp 2
CP, RANK = 2, 0  # rank 0 holds both documents' last chunks: their padding, their last token
BF16, F32, I64, BOOL = 2, 4, 8, 1


@pytest.fixture(scope="module")
def config():
    return TINY_MODELS["qwen3-vl-tiny"]()


@pytest.fixture(scope="module")
def local(config):
    """``(S, n)``: this rank's local length and valid labels, from the batch and the plan."""
    batch, doc_lens = build_batch(config, SPEC)
    # The step's targets: each document's labels shifted by one, its last token without one.
    docs = batch["labels"].split(doc_lens, dim=1)
    ignore = torch.full((1, 1), -100)
    shifted = torch.cat([torch.cat([d[:, 1:], ignore], dim=1) for d in docs], dim=1)
    plan = ShardPlan(SPEC.seq_len, CP, doc_lens=doc_lens)
    labels = plan.pad(shifted, seq_dim=1, value=-100)[:, plan.indices(RANK)]
    return labels.shape[1], int((labels != -100).sum())


def _simulate(config, **kw):
    setup = Setup(
        cp=CP, rank=RANK, activation_checkpointing=False, optimizer=False, reduced_depth=False
    )
    return simulate_step(config, SPEC, Setup(**{**setup.__dict__, **kw}))


@pytest.fixture(scope="module")
def runs(config):
    return {
        "chunked": _simulate(config, loss_chunk=64),
        "whole": _simulate(config, loss_chunk=None),
        "no_fsdp": _simulate(config, loss_chunk=64, data_parallel="none", compute_dtype=None),
    }


@pytest.mark.timeout(900)  # three simulated steps of a tiny model: seconds of CPU, minutes loaded
def test_loss_and_gathered_bytes_saved_by_hand(config, local, runs):
    S, n = local
    V, D = config.text_config.vocab_size, config.text_config.hidden_size
    assert 0 < n < S  # the padding and the documents' last tokens have no label
    head_and_norm = (V * D + D) * BF16
    chunked, whole, no_fsdp = runs["chunked"], runs["whole"], runs["no_fsdp"]
    assert chunked.saved_gathered == head_and_norm
    assert chunked.loss_saved == S * BOOL + n * I64 + n * D * BF16 + n * F32
    assert whole.saved_gathered == head_and_norm
    assert whole.loss_saved == S * BOOL + n * I64 + n * V * F32 + F32
    # The same decoder: the unchunked loss saves, beyond it, only the head's input.
    assert whole.saved_activations - chunked.saved_activations == S * D * BF16
    assert no_fsdp.saved_gathered == 0
    assert no_fsdp.loss_saved == S * BOOL + n * I64 + n * D * F32 + n * F32


@pytest.mark.timeout(900)
def test_categories_at_the_peak(config, runs):
    V, D = config.text_config.vocab_size, config.text_config.hidden_size
    for name, m in runs.items():
        cats = dict(m.peak_by_category)
        total = cats.pop("Total")
        assert sum(cats.values()) == total == m.peak_fwd_bwd, (name, m.peak_by_category)
        assert m.gathered == cats["Gathered"] and m.loss == cats["Loss"]
        assert m.loss > 0, name  # the backward starts in the loss: its bytes are live then
    # FSDP2's root keeps the embedding and the head gathered (bf16) for the whole step.
    for name in ("chunked", "whole"):
        assert runs[name].gathered >= 2 * V * D * BF16, (name, runs[name].peak_by_category)
    assert runs["no_fsdp"].gathered == 0
    # Without FSDP the parameters are the full model in float32, none gathered.
    params = sum(p.numel() for p in _meta_params(config))
    assert runs["no_fsdp"].peak_by_category["Parameter"] == params * F32


def _meta_params(config):
    from cpvlm.simulate.depth import meta_model

    return list(meta_model(config, torch.float32).parameters())
