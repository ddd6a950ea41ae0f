"""Linear attention under CP: the causal conv's halo exchange and the gated delta rule's state passing.

``cp_causal_conv1d`` and ``cp_gated_delta_rule`` take a rank's head-tail shard of a
``ShardPlan`` and give exactly what the one-process layer gives on the whole sequence, each
document starting from zeros. ``chunk_gated_delta_rule`` is the local plain-torch kernel.
"""

from cpvlm.attention.linear.conv import cp_causal_conv1d
from cpvlm.attention.linear.delta_rule import cp_gated_delta_rule
from cpvlm.attention.linear.kernel import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "cp_causal_conv1d", "cp_gated_delta_rule"]
