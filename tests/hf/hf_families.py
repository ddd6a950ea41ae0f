"""The families every shared HF test runs on, and the per-family facts those tests need.

Every fact comes from the registry and the family kits (``cpvlm.hf.kit``): a family
added to ``cpvlm/families/`` is in FAMILIES at once, and the tests select
families by their kits' ``traits``.

Float32 islands. Some families compute a part of a float64 model in float32 (docs/hf_internals.md
section 8; GLM-4V's bicubic position table, GLM-4.5V's router, Gemma's and Qwen3.5's norms). A CP
run groups the sums in those parts differently (per rank, per tower call), so their float32
round-off (~1e-7) shows. The exactness tests therefore run these families with the same math in
float64 (the kit's ``float64_islands``: the same functions, computed in the model's dtype, in both
runs) and hold every gradient to 1e-10; the unchanged models are checked at FLOAT32_TOL in the
kit's ``float32_groups``.
"""

import torch

from cpvlm.hf import build_model, kit_for
from cpvlm.hf.kit import TRAITS
from cpvlm.hf.registry import tiny_adapters, tiny_models
from cpvlm.verify import gradient_errors

FAMILIES = [n for n, a in tiny_adapters().items() if a.kit.shared_tests]
FAMILY_OF = {n: a.family for n, a in tiny_adapters().items()}


def with_trait(trait: str) -> set[str]:
    """The tiny models whose kit has ``trait`` (``cpvlm.hf.kit.TRAITS``)."""
    if trait not in TRAITS:
        raise KeyError(f"unknown trait {trait!r}; known: {sorted(TRAITS)}")
    return {n for n, a in tiny_adapters().items() if trait in a.kit.traits}


TILED = with_trait("tiled")
DEEPSTACK = with_trait("deepstack")
FRAME_TIMESTAMPS = with_trait("frame_timestamps")  # a group per video frame (Qwen3-VL)
GLM = with_trait("frames_as_images")
LINEAR_ATTENTION = with_trait("linear_attention")
GEMMA = with_trait("image_spans")  # sliding windows, image spans, their own image inputs
OWN_LAYOUT = with_trait("own_layout")  # not the Qwen-VL layout: own tokens, 1D, images only
# Feature frames of the audio clips of the families with an audio encoder (the kits').
AUDIO_CLIPS = {n: a.kit.audio_clips for n, a in tiny_adapters().items() if a.kit.audio_clips}
# Parameters the forward never uses (zero gradient): the kits' unused_parameters.
UNUSED = {n: a.kit.unused_parameters for n, a in tiny_adapters().items() if a.kit.unused_parameters}
# Parameters whose gradient is zero in exact arithmetic and round-off in floats (the kit's
# ``zero_gradients``: SigLIP's key bias, which softmax cancels): a relative error of round-off means
# nothing, so they are held to the tolerance times the largest gradient of their module group.


def grad_errors(name: str, grads, ref_grads) -> dict[str, float]:
    """``cpvlm verify``'s error of every reference gradient (``cpvlm.verify.gradient_errors``,
    with the kit's module groups and ``zero_gradients``)."""
    kit = kit_for(cached_model(name).config)
    return gradient_errors(grads, ref_grads, kit.module_groups(), kit.zero_gradients)


def _float32_pattern(name: str) -> str:
    """A regex of the parameters in the kit's ``float32_groups`` (``"."``: every one)."""
    kit = kit_for(tiny_models()[name]())
    if "*" in kit.float32_groups:
        return r"."
    groups = dict(kit.module_groups())
    return "|".join(p for label in kit.float32_groups for p in groups[label])


# Parameters whose float64 gradients carry float32 round-off in the unchanged models, and the
# tolerance for them: float32 round-off (6e-8) of sums grouped differently; measured <= 2e-7.
FLOAT32_IN_FLOAT64 = {
    n: _float32_pattern(n) for n in FAMILIES if tiny_adapters()[n].kit.float32_groups
}
FLOAT32_TOL = 1e-6

_models: dict = {}


def cached_model(name: str, dtype: torch.dtype = torch.float64, *, islands: bool = True):
    """One model per (name, dtype) and process; callers that train it deep-copy it. In float64
    the float32 islands are computed in float64 (``float64_islands``) unless ``islands=False``."""
    key = (name, dtype, islands and dtype == torch.float64)
    if key not in _models:
        model = build_model(name, dtype=dtype, seed=0)
        if key[2]:
            float64_islands(model)
        _models[key] = model
    return _models[key]


def float64_islands(model) -> None:
    """The kit's float64 islands (the same math as transformers in the model's dtype)."""
    kit_for(model).float64_islands(model)


def reset_text_attention() -> None:
    for model in _models.values():
        model.set_attn_implementation({"text_config": "sdpa"})


def mixes(name_or_model) -> bool:
    """The model's own forward takes images and videos in one call (GLM-4V's does not)."""
    config = name_or_model.config if hasattr(name_or_model, "config") else None
    if config is None:
        config = cached_model(name_or_model).config
    return kit_for(config).mixes_images_and_videos
