"""One module per model family; importing this package registers every adapter."""

from . import glm4v, qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_vl, qwen3_vl_moe  # noqa: F401
from . import gemma3, gemma4  # noqa: F401
