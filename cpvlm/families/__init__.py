"""One module per model family; importing this package registers every adapter."""

from . import (  # noqa: F401
    gemma3,
    gemma4,
    glm4v,
    internvl,
    llava_onevision,
    nemotron_h_omni,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_5,
    qwen3_omni_moe,
    qwen3_vl,
    qwen3_vl_moe,
)
