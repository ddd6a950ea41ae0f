"""cpvlm: context-parallel training of vision-language models with exact gradients.

The model-agnostic API lives here: the sequence layout (``ShardPlan``), CP attention and its
masks, encoder data parallelism (vision and audio towers), the global token-mean loss, data
parallelism on a (dp, cp) mesh, and the one options object every entry point validates
(``CPOptions``). The transformers VLM
integration (every supported family; it needs ``transformers``) is ``cpvlm.hf``;
``cpvlm verify`` and its engine are ``cpvlm.verify``.
"""

from cpvlm.attention import MaskSpec, cp_attention
from cpvlm.distributed import ShardPlan, pad_and_shard
from cpvlm.encoders import (
    EncoderCost,
    EncoderDataParallel,
    assign_units,
    gather_embeddings,
    route_to_owners,
    vision_units,
)
from cpvlm.loss import IGNORE_INDEX, count_valid_labels, shift_labels, token_mean_loss
from cpvlm.options import CPOptions
from cpvlm.parallelize import (
    MeshGroups,
    build_mesh,
    mesh_groups,
    parallelize,
    sync_gradients,
)

__version__ = "0.1.0"

__all__ = [
    "CPOptions",
    "IGNORE_INDEX",
    "MaskSpec",
    "MeshGroups",
    "ShardPlan",
    "EncoderCost",
    "EncoderDataParallel",
    "assign_units",
    "build_mesh",
    "count_valid_labels",
    "cp_attention",
    "gather_embeddings",
    "mesh_groups",
    "pad_and_shard",
    "parallelize",
    "route_to_owners",
    "shift_labels",
    "sync_gradients",
    "token_mean_loss",
    "vision_units",
]

_OLD_NAMES = ("VisionCost", "assign_vision_units", "gather_vision_embeddings")


def __getattr__(name: str):
    """The names of before ``cpvlm.encoders`` (deprecated), from ``cpvlm.vision``."""
    if name in _OLD_NAMES:
        import cpvlm.vision

        return getattr(cpvlm.vision, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
