"""Linear attention under CP: the causal conv's halo exchange and the gated delta rule's state passing.

``cp_causal_conv1d`` and ``cp_gated_delta_rule`` take a rank's head-tail shard of a
``ShardPlan`` and give exactly what the one-process layer gives on the whole sequence, each
document starting from zeros. ``chunk_gated_delta_rule`` is the local plain-torch kernel.
``cp_ssd_scan`` (local kernel ``chunk_ssd_scan``) does the same for Mamba-2's SSD scan, and
``cp_mamba2_mixer`` runs a transformers Mamba-2 mixer with both.
"""

from cpvlm.attention.linear.conv import cp_causal_conv1d
from cpvlm.attention.linear.delta_rule import cp_gated_delta_rule
from cpvlm.attention.linear.kernel import chunk_gated_delta_rule
from cpvlm.attention.linear.mamba2 import cp_mamba2_mixer
from cpvlm.attention.linear.ssd import chunk_ssd_scan, cp_ssd_scan

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_ssd_scan",
    "cp_causal_conv1d",
    "cp_gated_delta_rule",
    "cp_mamba2_mixer",
    "cp_ssd_scan",
]
