"""Context-parallel attention over a ShardPlan: exact ring, all-gather, Ulysses and hybrid."""

from cpvlm.attention.api import cp_attention, impl_label, resolve_impl
from cpvlm.attention.cost import Shapes, choose_impl, estimate_seconds, wire_bytes
from cpvlm.attention.hybrid import hybrid_groups
from cpvlm.attention.mask_spec import MaskSpec
from cpvlm.attention.schedule import AttentionSchedule, attention_schedule
from cpvlm.attention.ulysses import HeadSplit, head_split

__all__ = [
    "AttentionSchedule",
    "HeadSplit",
    "MaskSpec",
    "Shapes",
    "attention_schedule",
    "choose_impl",
    "cp_attention",
    "estimate_seconds",
    "head_split",
    "hybrid_groups",
    "impl_label",
    "resolve_impl",
    "wire_bytes",
]
