"""cpvlm: context-parallel training of vision-language models with exact gradients."""

from cpvlm.distributed import ShardPlan, ensure_requires_grad_for_cp_collective, pad_and_shard

__version__ = "0.1.0"

__all__ = ["ShardPlan", "ensure_requires_grad_for_cp_collective", "pad_and_shard"]
