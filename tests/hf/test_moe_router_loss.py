"""Qwen3-VL-MoE with its router load-balancing loss under CP: the loss and every gradient, router
included, equal the one-process model's to 1e-10 (float64); a per-shard router loss does not.

The definition matched (cpvlm.router_loss, ContextParallelVLM): transformers' aux loss of one
forward batch, ``E * sum_e (C_e / T) * (P_e / T)`` over the batch's valid tokens and MoE layers,
computed under CP from counts C and token totals T summed over the CP group; a step of several
forward batches (microbatches x DP replicas) averages the batches' aux losses, as transformers'
Trainer with gradient accumulation and DDP does. The reference recomputes the aux loss in float64
from the unwrapped model's router logits (transformers sums it in float32; it is compared with
transformers' own aux_loss at float32 round-off below).

The router weights are re-drawn with std 0.3 instead of the initializer's 0.02, so that routing is
far from uniform (with std 0.02 every probability is ~1/E and top-k choices are near ties), and
every test checks that no top-k choice is within 1e-6 of a tie.
"""

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

import cpvlm.hf.context_parallel as context_parallel  # noqa: E402
from cpvlm.families.qwen3_vl_moe import tiny_qwen3_vl_moe_config  # noqa: E402
from cpvlm.hf import ContextParallelVLM, SampleSpec, synthetic_batch  # noqa: E402
from cpvlm.loss import count_valid_labels, shift_labels  # noqa: E402
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.router_loss import load_balancing_loss, load_balancing_loss_share  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    causal_lm_loss_sum,
    cp_loss_and_grads,
    mixed_batch,
    packed_documents,
    reference,
    rel_err,
    run_distributed,
    summed_gradients,
    switch_load_balancing_loss,
)
from cpvlm.verify.moe_reference import MIRRORS, WRITTEN_AGAINST  # noqa: E402

COEF = 0.5  # large enough that the router loss moves every gradient well above 1e-10
CONFIGS = [("ring", "route", "scalable"), ("allgather", "allgather", "compat")]
_models = {}
TIMEOUT = 300  # s; a few seconds on an idle 2-core machine, minutes when it is shared


def moe_model(dtype=torch.float64):
    if dtype not in _models:
        config = tiny_qwen3_vl_moe_config(text_config={"router_aux_loss_coef": COEF})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForImageTextToText.from_config(config, experts_implementation="eager")
            for layer in model.model.language_model.layers:
                torch.nn.init.normal_(layer.mlp.gate.weight, std=0.3)
        _models[dtype] = model.to(dtype).train()
    return _models[dtype]


def _batches(model, kind):
    if kind == "packed":
        packed, parts, doc_lens = packed_documents(model, torch.float64)
        return packed, doc_lens, parts
    return mixed_batch(model, torch.float64), None, None


def per_shard_share(router_logits, real_mask, *, top_k, group):
    """The bug this file rules out: each rank's aux loss from its own shard's statistics, averaged
    over the CP ranks (what calling the model's loss function on a shard gives)."""
    assert top_k == 2
    return load_balancing_loss(router_logits, real_mask, top_k=2) / dist.get_world_size(group)


def _cp(rank, world_size, kind, configs, per_shard=False):
    base = moe_model()
    batch, doc_lens, _ = _batches(base, kind)
    results = []
    for attn, vision, flow in configs:
        model = copy.deepcopy(base)
        cp_model = ContextParallelVLM(
            model, dist.group.WORLD, options=CPOptions(attn=attn, vision=vision, flow=flow)
        )
        share = per_shard_share if per_shard else load_balancing_loss_share
        with mock.patch.object(context_parallel, "load_balancing_loss_share", share):
            out, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
        aux = out.extra_losses["router_aux"].detach().clone()
        dist.all_reduce(aux)
        results.append({"loss": loss, "aux": aux, "grads": grads} if rank == 0 else None)
    return results


def _reference(kind):
    model = moe_model()
    batch, doc_lens, parts = _batches(model, kind)
    loss, grads = reference(model, batch, doc_lens)
    # The aux loss alone, and the routing's distance from a tie, from the model's own forward.
    with torch.no_grad():
        logits, keep = [], []
        for part in parts or [batch]:
            inputs = {k: v for k, v in part.items() if k != "labels"}
            out = model(**inputs, use_cache=False, output_router_logits=True)
            model.model.rope_deltas = None
            logits.append(out.router_logits)
            mask = part.get("attention_mask")
            keep.append(torch.ones(part["input_ids"].numel()) if mask is None else mask.reshape(-1))
        layers = [torch.cat(ts) for ts in zip(*logits, strict=True)]
        aux = switch_load_balancing_loss(layers, torch.cat(keep), 4, 2)
        gap = min(
            float((p[:, 1] - p[:, 2]).min())
            for p in (torch.softmax(t.float(), -1).sort(-1, descending=True).values for t in layers)
        )
    assert gap > 1e-6, f"a top-2 choice is within {gap:.1e} of a tie"
    return loss, grads, aux


@pytest.mark.float64_family
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind", ["mixed", "packed"])
def test_router_loss_and_every_gradient_match_one_process(kind, cp):
    ref_loss, ref_grads, ref_aux = _reference(kind)
    routers = [n for n in ref_grads if ".mlp.gate." in n]
    assert len(routers) == 2 and all(ref_grads[n].abs().max() > 0 for n in routers)
    for result in run_distributed(_cp, cp, kind, CONFIGS, timeout=TIMEOUT)[0]:
        assert rel_err(result["aux"], ref_aux) <= 1e-10
        assert rel_err(result["loss"], ref_loss) <= 1e-10
        for n, g in ref_grads.items():
            assert rel_err(result["grads"][n], g) <= 1e-10, n


def test_per_shard_router_loss_fails_the_same_check():
    ref_loss, ref_grads, ref_aux = _reference("mixed")
    (result,) = run_distributed(_cp, 2, "mixed", CONFIGS[:1], True, timeout=TIMEOUT)[0]
    assert rel_err(result["aux"], ref_aux) > 1e-4
    assert rel_err(result["loss"], ref_loss) > 1e-6
    for n in (n for n in ref_grads if ".mlp.gate." in n):
        assert rel_err(result["grads"][n], ref_grads[n]) > 1e-4, n


def test_reference_aux_is_transformers_aux_loss():
    """switch_load_balancing_loss (float64) is transformers' load_balancing_loss_func (float32 sums
    and softmax: agreement to float32 round-off, measured ~1e-8), with and without padding."""
    model = moe_model()
    batch = mixed_batch(model, torch.float64)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        for mask in (batch["attention_mask"], None):
            out = model(
                **{**inputs, "attention_mask": mask}, use_cache=False, output_router_logits=True
            )
            model.model.rope_deltas = None
            ours = switch_load_balancing_loss(list(out.router_logits), mask, 4, 2)
            err = rel_err(ours, out.aux_loss)
            assert err <= 1e-6, (
                f"switch_load_balancing_loss no longer mirrors {MIRRORS} in transformers "
                f"{transformers.__version__} (written against {WRITTEN_AGAINST}): rel err {err:.1e}"
            )
    padded = switch_load_balancing_loss(list(out.router_logits), batch["attention_mask"], 4, 2)
    assert rel_err(padded, ours) > 1e-4  # the padding tokens are excluded


# ---- several microbatches and DP replicas ---------------------------------------------------


def _step_batches(model):
    """Four forward batches of one step: DP replica d, microbatch m -> batches[d][m]."""
    specs = [
        [SampleSpec(images=((4, 4),), text_len=20), SampleSpec(text_len=31)],
        [SampleSpec(images=((4, 8),), videos=((2, 4, 4),), text_len=9), SampleSpec(text_len=14)],
    ]
    return [
        [
            synthetic_batch(model.config, [s], dtype=torch.float64, seed=20 + 2 * d + m)
            for m, s in enumerate(row)
        ]
        for d, row in enumerate(specs)
    ]


def _dp_cp_step(rank, world_size):
    dp_rank, cp = rank // 2, 2
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = copy.deepcopy(moe_model())
    batches = _step_batches(model)
    num_valid = count_valid_labels([shift_labels(b["labels"]) for row in batches for b in row])
    cp_model = ContextParallelVLM(model, groups[dp_rank])
    assert cp_model.cp_size == cp
    for batch in batches[dp_rank]:
        out = cp_model(**batch, num_valid=num_valid, num_batches=4)
        out.loss.backward()
    grads = summed_gradients(model)  # summed over dp x cp, as the gradient sync does
    return grads if rank == 0 else None


def test_dp_and_microbatches_average_the_forward_batches_router_losses():
    """DP 2 x CP 2, two microbatches per replica: the summed gradients are those of the one-device
    step ``sum_f CE_f / N + COEF * mean_f aux_f`` over the four forward batches."""
    model = moe_model()
    batches = [b for row in _step_batches(model) for b in row]
    num_valid = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    model.zero_grad(set_to_none=True)
    total = 0
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = model(**inputs, use_cache=False, output_router_logits=True)
        model.model.rope_deltas = None
        ce_sum, _ = causal_lm_loss_sum(out.logits, batch["labels"])
        aux = switch_load_balancing_loss(list(out.router_logits), batch["attention_mask"], 4, 2)
        total = total + ce_sum / num_valid + COEF * aux / len(batches)
    total.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    grads = run_distributed(_dp_cp_step, 4, timeout=TIMEOUT)[0]
    for n, g in ref.items():
        assert rel_err(grads[n], g) <= 1e-10, n
