"""PEFT LoRA in ``cpvlm train`` (``--lora-r``): which layers are adapted, and how.

The base model is frozen whole (embeddings, decoder, head, vision tower and its projector); LoRA
layers are injected by ``peft.get_peft_model`` into the linear layers named by ``--lora-targets``
inside the decoder layers (default: the attention and MLP projections ``DEFAULT_TARGETS``), and,
with ``--lora-vision``, into every linear layer of the vision tower. Only the LoRA matrices train
(and sit in the optimizer); dropout is 0, so a CP run equals the one-process run exactly.

A pattern matches a linear layer when it is the layer's name, a dotted suffix of it (PEFT's rule
for a list of names: ``q_proj`` matches ``...self_attn.q_proj``), or an ``fnmatch`` glob of its
name within the decoder layer (``self_attn.*``). The resolved targets are full module names, so
the adapter's ``adapter_config.json`` names exactly the layers that trained.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatchcase(name, pattern)


def lora_target_modules(model: nn.Module, lora) -> list[str]:
    """The full module names of ``model`` that LoRA adapts under ``lora`` (a ``LoraConfig`` of
    ``cpvlm.train.config``). Raises ValueError when a pattern matches no linear layer."""
    from cpvlm.hf import adapter_for

    adapter = adapter_for(model)
    full = {id(m): n for n, m in model.named_modules()}
    patterns = lora.targets or DEFAULT_TARGETS
    found, hits, linears = [], dict.fromkeys(patterns, 0), set()
    for layer in adapter.decoder_layers(model):
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            linears.add(name)
            picked = [p for p in patterns if _matches(name, p)]
            for p in picked:
                hits[p] += 1
            if picked:
                found.append(full[id(module)])
    missing = [p for p, n in hits.items() if n == 0] if lora.targets else []
    if missing or not found:
        raise ValueError(
            f"model.lora.targets (--lora-targets): {', '.join(missing or patterns)} match no linear "
            f"layer of the decoder layers; they have: {', '.join(sorted(linears))}"
        )
    if lora.vision:
        tower = adapter.vision_tower(model)
        found += [full[id(m)] for m in tower.modules() if isinstance(m, nn.Linear)]
    return found


def peft_config(model: nn.Module, lora):
    """The ``peft.LoraConfig`` of the run (explicit full module names)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha_value,
        lora_dropout=0.0,
        target_modules=lora_target_modules(model, lora),
    )


def peft_model(model: nn.Module, lora, seed: int):
    """``model`` frozen, with LoRA layers injected (in place): the ``peft.PeftModel`` around it.

    The LoRA A matrices are drawn from ``seed`` (the same on every rank, the global RNG left as
    it was); B starts at zero, so the adapted model starts as the base model.
    """
    from peft import get_peft_model

    config = peft_config(model, lora)
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, config)
    return wrapped


def apply_lora(model: nn.Module, lora, seed: int) -> nn.Module:
    """``peft_model`` for training: the HF model itself (LoRA layers in it), which
    ``ContextParallelVLM`` wraps as it wraps any model of its family."""
    return peft_model(model, lora, seed).get_base_model()
