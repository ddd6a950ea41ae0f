"""The one-process reference step of a transformers VLM: its own forward, loss and gradients.

Legend: B batch, S sequence length, V vocab size, E experts.

The reference is the unwrapped model's own forward (its own attention and vision path) on the
whole batch, or on each packed document alone; the cross-entropy is recomputed in the model's dtype
(transformers' loss upcasts float64 logits to float32 only), and an MoE model's router
load-balancing loss is recomputed in the model's dtype from its router logits (transformers sums it
in float32), following transformers' ``load_balancing_loss_func`` step by step
(``moe_reference.py``). Nothing here calls the CP code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from cpvlm.constants import IGNORE_INDEX
from cpvlm.verify.moe_reference import switch_load_balancing_loss

# cpvlm.hf (and transformers) is imported where a reference runs, not with this module.


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over valid labels (labels[..., 1:] vs logits[..., :-1]), in
    the logits' dtype (float32 at least); 0 when no label is valid."""
    total, count = causal_lm_loss_sum(logits, labels)
    return total / max(count, 1)


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of next-token cross-entropy over valid labels, their count)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    logits_flat = logits[..., :-1, :].reshape(-1, logits.shape[-1])
    labels_flat = labels[..., 1:].reshape(-1).to(logits.device)
    total = F.cross_entropy(logits_flat, labels_flat, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, int((labels_flat != IGNORE_INDEX).sum())


def _forward(model, inputs: Mapping, router: bool):
    from cpvlm.hf import adapter_for
    from cpvlm.hf.adapter import module_at

    adapter = adapter_for(model)
    kwargs = adapter.to_model_batch({k: v for k, v in inputs.items() if k != "labels"})
    if router:
        kwargs["output_router_logits"] = True
    try:
        return model(**kwargs, use_cache=False)
    finally:  # the M-RoPE offsets the forward caches beside its get_rope_index
        owner = module_at(model, adapter.modules.rope_index.rpartition(".")[0], None)
        if owner is not None:  # (a model without that module, Nemotron Omni, caches none)
            owner.rope_deltas = None


def _gradients(model) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def reference_loss_and_grads(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor] | None = None,
    *,
    documents: Sequence[Mapping[str, torch.Tensor]] | None = None,
    with_router_loss: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One-process reference step: the model's own forward on ``batch`` (or on each of the
    ``documents`` of a packed row alone), the mean cross-entropy over all valid labels, plus for
    an MoE model with the router loss on ``weight * aux`` with aux over all tokens of the forward
    batch (the documents pooled, as one packed forward would), backward. Returns the detached loss
    and a clone of every trainable parameter's gradient (zeros where a parameter got none); leaves
    ``.grad`` cleared and the model's cached ``rope_deltas`` reset."""
    from cpvlm.hf import adapter_for

    if (batch is None) == (documents is None):
        raise ValueError("pass batch or documents")
    parts = [batch] if documents is None else list(documents)
    spec = adapter_for(model).router_loss() if with_router_loss else None
    model.zero_grad(set_to_none=True)
    try:
        total, count, logits_per_layer, keeps = 0, 0, None, []
        for part in parts:
            out = _forward(model, part, spec is not None)
            part_total, part_count = causal_lm_loss_sum(out.logits, part["labels"])
            total, count = total + part_total, count + part_count
            if spec is not None:
                layers = list(out.router_logits)
                logits_per_layer = (
                    [[t] for t in layers]
                    if logits_per_layer is None
                    else [acc + [t] for acc, t in zip(logits_per_layer, layers, strict=True)]
                )
                mask = part.get("attention_mask")
                keeps.append(
                    torch.ones(part["input_ids"].numel()) if mask is None else mask.reshape(-1)
                )
        loss = total / max(count, 1)
        if spec is not None:
            text = model.config.text_config
            num_experts = getattr(text, "num_experts", None) or text.n_routed_experts
            pooled = [torch.cat(ts) for ts in logits_per_layer]
            aux = switch_load_balancing_loss(pooled, torch.cat(keeps), num_experts, spec.top_k)
            loss = loss + spec.weight * aux
        loss.backward()
        grads = _gradients(model)
    finally:
        model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def reference(model, batch: Mapping, doc_lens: Sequence[int] | None):
    """``reference_loss_and_grads`` of a batch as the CP side takes it: the whole ``batch``, or
    with ``doc_lens`` each document of its packed row alone."""
    from cpvlm.hf.data.synthetic import split_documents

    if doc_lens is None:
        return reference_loss_and_grads(model, batch)
    return reference_loss_and_grads(model, documents=split_documents(model.config, batch, doc_lens))


def mrope_position_ids(model, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The ``[3, B, S]`` M-RoPE position ids the model's own forward computes for ``batch``
    (``get_rope_index`` leaves padding positions at 0)."""
    from cpvlm.hf import adapter_for
    from cpvlm.hf.inputs import rope_index

    adapter = adapter_for(model)
    extras = {k: batch[k] for k in adapter.video_keys if batch.get(k) is not None}
    return rope_index(
        adapter,
        model,
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch.get("attention_mask"),
        batch.get("image_grid_thw"),
        batch.get("video_grid_thw"),
        extras,
        batch.get("audio_lengths"),
    )
