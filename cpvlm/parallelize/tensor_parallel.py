"""Tensor parallelism (TP) of a decoder's layers under CP: attention heads and MLP columns split
over a tp mesh, by the model's own plan.

Legend: T ranks in a TP group, H / Hkv query / key-value heads (H / T, Hkv / T on each rank).

The plan is transformers' ``base_model_tp_plan`` of the text config: ``"layers.*.<path>"`` ->
``"colwise"`` (q/k/v, gate/up: each rank computes its share of the output features, i.e. its
heads and its MLP columns) or ``"rowwise"`` (o, down: each rank's partial product, summed over the
TP group). torch's ``ColwiseParallel`` / ``RowwiseParallel`` do the sharding and the collectives
(``parallelize_module``): the parameters become ``Shard`` DTensors on the tp mesh, a colwise
layer's input gradient is summed over TP in the backward, a rowwise layer's output in the forward.

Under CP every rank of a TP group holds the same CP shard of tokens (the CP group is the ranks of
one tp rank), so attention runs as ``cp_attention`` over the CP group on this rank's H / T heads,
which are whole heads: the same computation as on one process. Exactness: the rowwise sum adds the
same products in another order (round-off). Gradients: a planned parameter's gradient is this
rank's shard, summed over the CP (and DP) ranks of its tp rank; every other parameter is
replicated over TP and gets the same, whole gradient on each TP rank (the activations and their
gradients are replicated there), so the gradient sync must not add over TP. One exception,
transformers' ``replicated_with_grad_allreduce`` style (Qwen3's q/k norms: one weight over the
head dim, applied to every head, so each rank sees it only on its own heads): the parameter stays
a whole, plain tensor, and its gradient is partial per TP rank; ``sync_tp_gradients`` sums it
over the TP group after the backward (a sum of the same terms as one process, in another order).
The embedding and head styles are left out (the embedding and head stay replicated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from cpvlm.parallelize.data_parallel import all_reduce_gradients

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
"""The plan's styles that split a module, by transformers' names."""

SUMMED = "replicated_with_grad_allreduce"
"""The plan's style of a replicated module whose gradient is summed over TP (transformers' name)."""

_LAYER = "layers.*."


def decoder_layer_plan(plan: Mapping[str, str]) -> dict[str, str]:
    """The decoder-layer entries of a ``base_model_tp_plan``, relative to one layer.

    Raises ``ValueError`` when there are none, or when a layer entry has a style not in
    ``STYLES``; entries outside the layers (embedding, head) are left replicated.
    """
    layer = {k[len(_LAYER) :]: v for k, v in (plan or {}).items() if k.startswith(_LAYER)}
    if not layer:
        raise ValueError(
            f"tensor parallelism: the model's base_model_tp_plan {dict(plan or {})} has no "
            f"'{_LAYER}<path>' entries, so its decoder layers cannot be split; use tp 1 (or give "
            "the text config a plan of colwise q/k/v, gate/up and rowwise o, down projections)"
        )
    other = {k: v for k, v in layer.items() if v not in STYLES and v != SUMMED}
    if other:
        raise ValueError(
            f"tensor parallelism: the plan's styles {other} are not supported under CP (only "
            f"{[*STYLES, SUMMED]}); use tp 1"
        )
    return layer


def _has_module(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def check_tp_sizes(tp: int, where: str = "tp", **sizes: int) -> None:
    """``tp`` must divide each of ``sizes`` (heads, kv heads, MLP width: a rank computes whole
    heads and an equal share of the columns); the message names ``where`` and the fix."""
    for name, size in sizes.items():
        if size % tp:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            raise ValueError(
                f"{where} = {tp} must divide the model's {name}={size} (tensor parallelism: each "
                f"rank computes 1/tp of it, in whole heads); use a tp in {divisors}"
            )


def parallelize_decoder_layers(
    layers: Sequence[nn.Module],
    plan: Mapping[str, str],
    tp_mesh: DeviceMesh,
    *,
    num_heads: int,
    num_kv_heads: int,
) -> list[nn.Module]:
    """Split each decoder layer's planned projections over the 1-d ``tp_mesh``, in place.

    ``plan``: ``base_model_tp_plan`` entries (the text config's, or the family's own); ``num_heads``
    / ``num_kv_heads``: the attention's query and key-value heads, which the TP size must divide
    (a rank computes whole heads). Call it on every rank with identical weights, before any data
    parallelism. Returns the modules of the ``SUMMED`` style, whose gradients
    ``sync_tp_gradients`` sums over TP after each step's backward.
    """
    tp = tp_mesh.size()
    layer_plan = decoder_layer_plan(plan)
    check_tp_sizes(tp, "tensor parallelism: tp", num_heads=num_heads, num_kv_heads=num_kv_heads)
    for i, layer in enumerate(layers):  # a layer of another kind (MoE, linear attention) would
        # keep its own per-head modules whole and unsummed: refuse rather than guess
        missing = [p for p in layer_plan if not _has_module(layer, p)]
        if missing:
            raise ValueError(
                f"tensor parallelism: decoder layer {i} ({type(layer).__name__}) has no "
                f"{missing} of the plan; use tp 1 (the plan must name every layer's modules)"
            )
    summed = []
    for layer in layers:
        styles = {p: STYLES[s]() for p, s in layer_plan.items() if s in STYLES}
        parallelize_module(layer, tp_mesh, styles)
        summed += [layer.get_submodule(p) for p, s in layer_plan.items() if s == SUMMED]
    return summed


def sync_tp_gradients(modules: Sequence[nn.Module], tp_group: dist.ProcessGroup) -> None:
    """Sum the gradients of ``modules``' parameters (``parallelize_decoder_layers``' return) over
    the TP group, in place: one flat all-reduce. Call it once per step after the last backward
    (before or after the data-parallel sync: both are sums), on every rank; a FSDP2 shard is
    summed as it is (the TP ranks of one FSDP2 rank hold the same shard)."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    if not params or dist.get_world_size(tp_group) == 1:
        return
    all_reduce_gradients(params, tp_group)
