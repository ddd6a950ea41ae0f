"""What a training step does with its gradients after the last backward, with data, expert and
tensor parallelism: sum them (``sync_step_gradients``), take their global norm and clip them.

Shared by ``cpvlm train``'s loop and the Trainer route (``cpvlm.hf.trainer``), so that both sum
and clip the same way. The parameters of one model lie on several meshes (FSDP2 shards, experts
sharded over EP, TP shards, plain tensors); torch's foreach ops take one mesh at a time, so the
norm is one DTensor reduction per mesh, combined.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cpvlm.parallelize.data_parallel import sync_gradients
from cpvlm.parallelize.expert_parallel import sync_expert_gradients
from cpvlm.parallelize.mesh import MeshGroups
from cpvlm.parallelize.tensor_parallel import sync_tp_gradients


def sync_step_gradients(
    model: nn.Module, groups: MeshGroups, data_parallel: str, tp_summed: Sequence[nn.Module] = ()
) -> None:
    """Finish the sum of the step's gradients, once after its last backward, on every rank:
    over dp x cp for ``data_parallel="none"`` (FSDP2 and DDP summed in the backward), the sharded
    experts FSDP2 leaves replicated over their replicas (``ep > 1`` under HSDP), and the TP-partial modules ``tp_summed``
    (``apply_tensor_parallel``'s return) over TP."""
    if data_parallel == "none":
        sync_gradients(model, groups)
    elif groups.ep_mesh is not None:  # experts FSDP2 does not shard over their replicas (HSDP)
        sync_expert_gradients(model, groups)
    if groups.tp_mesh is not None:
        sync_tp_gradients(tp_summed, groups.tp_mesh.get_group())


def by_mesh(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters grouped by DTensor mesh (plain tensors together): FSDP2's shards, and
    expert-parallel experts on the ep mesh; torch's foreach ops take one mesh at a time."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(groups.values())


def global_grad_norm(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all gradients of the model, whole (FSDP2 shards, sharded experts: a DTensor
    reduction per mesh)."""
    norms = []
    for group in by_mesh(params):
        grads = [p.grad for p in group if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_grad_norm_(params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most ``max_norm`` (``> 0``; ``inf``
    leaves them); returns the norm before clipping."""
    norm = global_grad_norm(params)
    if max_norm != float("inf"):
        for group in by_mesh(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
