"""cpvlm: context-parallel training of vision-language models with exact gradients.

The model-agnostic API lives here: the sequence layout (``ShardPlan``), CP attention and its
masks, vision data parallelism, the global token-mean loss, data parallelism on a (dp, cp) mesh,
and the one options object every entry point validates (``CPOptions``). The transformers VLM
integration (every supported family; it needs ``transformers``) is ``cpvlm.hf``;
``cpvlm verify`` and its engine are ``cpvlm.verify``.
"""

from cpvlm.attention import MaskSpec, cp_attention
from cpvlm.distributed import ShardPlan, pad_and_shard
from cpvlm.loss import IGNORE_INDEX, count_valid_labels, shift_labels, token_mean_loss
from cpvlm.options import CPOptions
from cpvlm.parallelize import (
    MeshGroups,
    build_mesh,
    mesh_groups,
    parallelize,
    sync_gradients,
)
from cpvlm.vision import (
    EncoderDataParallel,
    VisionCost,
    assign_vision_units,
    gather_vision_embeddings,
    route_to_owners,
    vision_units,
)

__version__ = "0.1.0"

__all__ = [
    "CPOptions",
    "IGNORE_INDEX",
    "MaskSpec",
    "MeshGroups",
    "ShardPlan",
    "VisionCost",
    "EncoderDataParallel",
    "assign_vision_units",
    "build_mesh",
    "count_valid_labels",
    "cp_attention",
    "gather_vision_embeddings",
    "mesh_groups",
    "pad_and_shard",
    "parallelize",
    "route_to_owners",
    "shift_labels",
    "sync_gradients",
    "token_mean_loss",
    "vision_units",
]
