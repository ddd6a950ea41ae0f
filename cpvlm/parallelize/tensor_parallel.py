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
gradients are replicated there), so the gradient sync must not add over TP. Styles whose
parameters need a TP sum of gradients (transformers' ``replicated_with_grad_allreduce``, e.g.
Qwen3's per-head q/k norms, which each rank sees only for its heads) are refused here, as are the
embedding and head styles (the embedding and head stay replicated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
"""The plan's styles this module applies, by transformers' names."""

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
    other = {k: v for k, v in layer.items() if v not in STYLES}
    if other:
        raise ValueError(
            f"tensor parallelism: the plan's styles {other} are not supported under CP (only "
            f"{list(STYLES)}); use tp 1"
        )
    return layer


def parallelize_decoder_layers(
    layers: Sequence[nn.Module],
    plan: Mapping[str, str],
    tp_mesh: DeviceMesh,
    *,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Split each decoder layer's planned projections over the 1-d ``tp_mesh``, in place.

    ``plan``: the text config's ``base_model_tp_plan``; ``num_heads`` / ``num_kv_heads``: the
    attention's query and key-value heads, which the TP size must divide (a rank computes whole
    heads). Call it on every rank with identical weights, before any data parallelism.
    """
    tp = tp_mesh.size()
    layer_plan = decoder_layer_plan(plan)
    for name, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if heads % tp:
            raise ValueError(
                f"tensor parallelism: tp={tp} must divide the attention's {name}={heads} (each "
                f"rank computes whole heads); use a tp that divides {heads}"
            )
    for layer in layers:
        styles = {path: STYLES[style]() for path, style in layer_plan.items()}
        parallelize_module(layer, tp_mesh, styles)
