"""A Mamba-2 mixer (transformers' ``NemotronHMamba2Mixer``) on a CP shard: CP conv, CP SSD scan.

Legend: B batch, L local length, D hidden size, H heads, P head dim, G groups, N state size.

``cp_mamba2_mixer(mixer, hidden_states, plan=, group=)`` computes what the mixer's forward computes
on its torch path (no cache, no attention mask), each document of the plan from a zero conv
history and a zero state, reading every parameter and size from the unmodified module:

    in_proj -> [gate | x B C | dt];  x B C -> causal depthwise conv (conv1d, SiLU) with the
    halo across ranks (``cp_causal_conv1d``);  SSD scan (A = -exp(A_log), dt with dt_bias,
    softplus and time_step_limit, D skip) with the state carried across ranks (``cp_ssd_scan``);
    gated RMSNorm (norm.weight, group_size, variance_epsilon; the gate's SiLU before the norm);
    out_proj.

Where transformers' torch path computes in float32 whatever the model's dtype:

1. ``A = -exp(A_log.float())`` (``mamba2_scan_forward``);
2. the scan (``mamba2_chunk_scan``): x, B, C and dt cast with ``.float()`` after dt's bias,
   softplus and clamp in the model's dtype; the D term multiplies the float32 x;
3. the gated norm (``NemotronHRMSNormGated``): input and gate cast to float32, SiLU, variance and
   rsqrt in float32, then cast back to the input's dtype (the scan output's: float32, or float64
   in a float64 model, where the float64 D promotes the scan output) and multiplied by the weight;
   ``out_proj`` gets it cast to the model's dtype.

The conv computes in the weight's dtype (no cast). Here each float32 step runs in
``compute_dtype``: float64 for a float64 model, float32 otherwise, so a float64 model computes in
float64 throughout (a check against transformers' float64 module reads it under ``KeepFloat64``,
which turns its float32 casts into float64) and other dtypes round where transformers rounds.
The norm is written out here, not called, so that a float64 model does not round in it.

Not wired into a model family yet: the family file swaps the layer in and passes ``cpvlm_cp``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpvlm.attention.linear.conv import cp_causal_conv1d
from cpvlm.attention.linear.delta_rule import compute_dtype
from cpvlm.attention.linear.ssd import cp_ssd_scan
from cpvlm.distributed.shard_plan import ShardPlan


def _gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, norm) -> torch.Tensor:
    """``NemotronHRMSNormGated(y, gate)`` in ``y``'s dtype (the compute dtype)."""
    h = y * F.silu(gate.to(y.dtype))
    *prefix, width = h.shape
    groups = h.view(*prefix, width // norm.group_size, norm.group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * groups.view(*prefix, width)


def cp_mamba2_mixer(
    mixer: torch.nn.Module,
    hidden_states: torch.Tensor,
    *,
    plan: ShardPlan,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``mixer``'s forward on this rank's shard ``[B, L, D]`` of ``plan`` -> ``[B, L, D]``.

    ``mixer`` is a ``NemotronHMamba2Mixer`` (or a module with its attributes: in_proj, conv1d,
    dt_bias, A_log, D, norm, out_proj, num_heads, head_dim, n_groups, ssm_state_size,
    intermediate_size, conv_dim, activation, chunk_size, time_step_limit). The output is 0 at
    padding positions. Every rank of the group must call this with the same plan and shapes,
    forward and backward.
    """
    batch, s, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, n_groups = mixer.num_heads, mixer.head_dim, mixer.n_groups
    state_size, inner = mixer.ssm_state_size, mixer.intermediate_size
    gate, xbc, dt = mixer.in_proj(hidden_states).split([inner, mixer.conv_dim, heads], dim=-1)
    xbc = cp_causal_conv1d(
        xbc,
        mixer.conv1d.weight.squeeze(1),
        mixer.conv1d.bias,
        plan=plan,
        group=group,
        activation=mixer.activation,
    )
    x, b, c = xbc.split([inner, n_groups * state_size, n_groups * state_size], dim=-1)
    cdtype = compute_dtype(dtype)
    y = cp_ssd_scan(
        x.reshape(batch, s, heads, head_dim),
        dt,
        -torch.exp(mixer.A_log.to(cdtype)),
        b.reshape(batch, s, n_groups, state_size),
        c.reshape(batch, s, n_groups, state_size),
        plan=plan,
        group=group,
        D_H=mixer.D,
        dt_bias_H=mixer.dt_bias,
        dt_softplus=True,
        dt_limit=tuple(mixer.time_step_limit),
        chunk_size=mixer.chunk_size,
    )
    y = _gated_rms_norm(y.reshape(batch, s, inner), gate, mixer.norm)
    out = mixer.out_proj(y.to(dtype))
    # out_proj's bias would make padding rows nonzero; they are 0 like every CP layer's.
    real = ~plan.is_padding[plan.indices(dist.get_rank(group))]
    return out * real.to(out.device).view(1, -1, 1).to(out.dtype)
