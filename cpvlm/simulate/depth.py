"""Fewer layers, then the rest added: how a simulation of a deep model stays fast.

Every decoder layer of one kind (full or sliding or linear attention, with or without deepstack
inputs) saves the same bytes for backward on a rank, and so does every vision block of one kind.
So the simulation runs a copy of the model with a few layers, each kind of layer at least once
in a place that is neither the first (which also saves, once for all layers, what they share:
position embeddings, masks) nor the last (whose interval also holds what follows it), and adds
the layers left out, in one of two ways (``Setup.depth_fit``):
- ``"add"``: ``count x the bytes the simulated layer of their kind saved`` to the activations
  and to the peak (as if every saved activation were alive at the peak), and their parameter and
  gradient shards whole to the peak: an upper bound (the peak may come before a gradient lands).
- ``"affine"``: a rank's bytes are affine in the number of layers of a kind (the layers are
  identical, the step's schedule repeats per layer), so the reduced model is simulated once more
  with one more layer of each kind left out, and every figure of the forward + backward (saved,
  peak, each category at the peak) is extrapolated along that line to the full count. Exact for
  the saved bytes; the peak is the largest of several phases' bytes, each affine in the depth
  with its own slope, and a few layers can put it in another phase than the full model does
  (Qwen3-VL-8B, text 32k, cp 4 and 8: the fit is 17% and 12% low; the reduced models peak in
  the loss's backward, the full one, we believe, later, with the layers' gradients), so it is
  not the default. A fit per phase (each phase's peak extrapolated, then the largest) would fix it.
Either way the parameter, gradient and optimizer shards of the layers left out are counted
exactly from the full config's parameters on the meta device.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Depth:
    """The reduced model's layers of each tower, and for each kind of layer: the index of its
    typical layer in the reduced model and how many of that kind the full model has beyond the
    reduced one."""

    text_layers: int
    vision_blocks: int
    text_extra: dict  # {typical reduced layer index: layers left out}
    vision_extra: dict


def _text_kinds(config, vision: bool = True) -> list:
    text = config.text_config
    n = text.num_hidden_layers
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * n)
    deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
    deepstack *= vision  # without images or videos, a deepstack layer adds nothing
    return [("deepstack", i) if i < deepstack else types[i] for i in range(n)]


def _vision_kinds(config) -> list:
    vision = config.vision_config
    n = _vision_depth(vision)
    deepstack = set(getattr(vision, "deepstack_visual_indexes", None) or [])
    full = getattr(vision, "fullatt_block_indexes", None)
    kinds = []
    for i in range(n):
        kind = "block" if full is None else ("full" if i in full else "window")
        kinds.append(("deepstack", kind) if i in deepstack else kind)
    return kinds


def _vision_depth(vision) -> int:
    return vision.depth if hasattr(vision, "depth") else vision.num_hidden_layers


def _text_prefix(kinds: list) -> int:
    """The shortest prefix in which every kind with layers left out has one neither first nor
    last."""
    for t in range(3, len(kinds) + 1):
        inner = set(kinds[1 : t - 1])
        if all(k in inner or kinds[:t].count(k) == kinds.count(k) for k in set(kinds)):
            return t
    return len(kinds)


def reduce_depth(config, vision: bool = True, plus: tuple[str, int] | None = None):
    """``(reduced config, Depth)``; a model with no more layers than needed is returned as is.
    ``vision=False``: for a sequence without images or videos. ``plus=(tower, i)`` (``"text"``
    or ``"vision"``, a key of ``Depth.text_extra`` / ``vision_extra``): the reduced model with
    one more copy of its layer ``i`` right after it (the affine fit's second point)."""
    text_kinds, vision_kinds = _text_kinds(config, vision), _vision_kinds(config)
    t = _text_prefix(text_kinds)
    plain = [k for k in dict.fromkeys(vision_kinds) if not isinstance(k, tuple)]
    deepstack = [k for k in vision_kinds if isinstance(k, tuple)]
    reduced_vision = plain[:1] + plain + deepstack + ([] if deepstack else plain[:1])
    if len(reduced_vision) >= len(vision_kinds):
        reduced_vision = vision_kinds
    depth = Depth(
        t,
        len(reduced_vision),
        _extra(text_kinds, text_kinds[:t]),
        _extra(vision_kinds, reduced_vision),
    )
    text_order = list(range(t))  # the full model's layer each reduced text layer copies
    if plus is not None:
        tower, i = plus
        if i not in (depth.text_extra if tower == "text" else depth.vision_extra):
            raise ValueError(f"reduce_depth: {tower} layer {i} has no layers left out")
        if tower == "text":
            text_order.insert(i + 1, i)
        else:
            reduced_vision.insert(i + 1, reduced_vision[i])
    reduced = copy.deepcopy(config)
    text = reduced.text_config
    text.num_hidden_layers = len(text_order)
    if getattr(text, "layer_types", None):
        text.layer_types = [text.layer_types[i] for i in text_order]
    vision_config = reduced.vision_config
    v = len(reduced_vision)
    if hasattr(vision_config, "depth"):
        vision_config.depth = v
    else:
        vision_config.num_hidden_layers = v
    if deepstack:
        n = sum(isinstance(k, tuple) for k in reduced_vision)
        vision_config.deepstack_visual_indexes = list(range(v - n, v))
    if getattr(vision_config, "fullatt_block_indexes", None) is not None:
        vision_config.fullatt_block_indexes = [
            i
            for i, k in enumerate(reduced_vision)
            if (k[1] if isinstance(k, tuple) else k) == "full"
        ]
    return reduced, depth


def _extra(full: list, reduced: list) -> dict:
    out = {}
    for kind in dict.fromkeys(full):
        left_out = full.count(kind) - reduced.count(kind)
        if left_out:
            out[next(i for i in range(1, len(reduced) - 1) if reduced[i] == kind)] = left_out
    return out


def vision_blocks(tower: nn.Module) -> nn.ModuleList:
    """The tower's blocks: its longest ``nn.ModuleList``."""
    lists = [m for m in tower.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len)


def shard_bytes(model: nn.Module, world: int, fsdp: bool) -> tuple[int, int, int]:
    """``(parameter bytes, trainable parameter elements, trainable tensors)`` one rank holds:
    FSDP2 keeps dim-0 chunks of ``ceil(dim0 / world)`` rows (the largest, rank 0's, padded to
    on every rank)."""
    nbytes = elems = tensors = 0
    for p in model.parameters():
        n = p.numel()
        if fsdp and p.dim() and world > 1:
            n = math.ceil(p.shape[0] / world) * (n // p.shape[0])
        nbytes += n * p.element_size()
        elems += n if p.requires_grad else 0
        tensors += p.requires_grad
    for b in model.buffers():
        nbytes += b.numel() * b.element_size()
    return nbytes, elems, tensors


def meta_model(config, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config, dtype=dtype)
