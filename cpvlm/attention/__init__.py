"""Context-parallel attention: exact ring and all-gather attention over a ShardPlan."""

from cpvlm.attention.api import cp_attention
from cpvlm.attention.schedule import AttentionSchedule, attention_schedule

__all__ = ["AttentionSchedule", "attention_schedule", "cp_attention"]
