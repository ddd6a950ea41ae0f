"""Build a supported transformers VLM: a tiny random one by name, or a local checkpoint.

See docs/hf_internals.md for how transformers 5.x runs these models.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

from cpvlm.hf.registry import adapter_class, adapter_for, kit_for, tiny_models

TINY_MODELS = tiny_models()
"""``{"<family>-tiny": config builder}``: random tiny models of every supported family."""

__all__ = ["TINY_MODELS", "build_model", "model_family"]


def model_family(model_or_config) -> str:
    """The family name of a model or config (its adapter's ``family``); raises for unsupported
    ones."""
    return adapter_class(getattr(model_or_config, "config", model_or_config)).family


def build_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A ``*ForConditionalGeneration`` model of a supported family, in train mode.

    A tiny name (``TINY_MODELS``) is initialised in float32 from ``seed`` (without touching the
    global RNG) and then cast, so every dtype holds the same weights. Anything else is a local
    checkpoint directory (``save_pretrained`` layout), loaded without network access.
    """
    if isinstance(name_or_path, str) and name_or_path in TINY_MODELS:
        config = TINY_MODELS[name_or_path](attn_implementation=attn_implementation)
        extra = _dtype_kwargs(config, dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(config, **extra)
            kit_for(model).init_tiny(model)
        model = model.to(dtype)
        _record_dtype(model.config, dtype)
    else:
        path = Path(name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{str(name_or_path)!r} is neither a tiny model ({', '.join(TINY_MODELS)}) nor an "
                "existing local checkpoint directory (hub downloads are not supported)"
            )
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = AutoModelForImageTextToText.from_pretrained(
            path,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=_attn_implementation(config, attn_implementation),
            **_dtype_kwargs(config, dtype),
        )
        # one dtype for FSDP: transformers keeps some modules float32 whatever the dtype asked
        # (_keep_in_fp32_modules_strict: NemotronH's router), as a tiny model's cast does not
        model = model.to(dtype)
    adapter_for(model)
    return model.train()


def _record_dtype(config, dtype: torch.dtype) -> None:
    """Say ``dtype`` in the config and its sub-configs, as ``from_pretrained(dtype=)`` does: a
    model that casts its inputs to its config's dtype (Nemotron Omni's pixels) then casts them
    to its weights' dtype."""
    config.dtype = dtype
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            sub.dtype = dtype


def _attn_implementation(config, impl: str) -> str | dict[str, str]:
    """``impl``, or per sub-config where a sub-model has no SDPA attention (Gemma 4's audio
    tower: eager only), "eager" for it: transformers refuses "sdpa" for the whole model then."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    subs = {k: getattr(config, k, None) for k in getattr(config, "sub_configs", {})}
    eager = {
        k
        for k, sub in subs.items()
        if sub is not None
        and type(sub) in MODEL_MAPPING
        and not MODEL_MAPPING[type(sub)]._supports_sdpa
    }
    if impl != "sdpa" or not eager:
        return impl
    return {"": impl, **{k: "eager" if k in eager else impl for k in subs}}


def _dtype_kwargs(config, dtype: torch.dtype) -> dict:
    return dict(adapter_class(config).kit.float64_load_kwargs) if dtype == torch.float64 else {}
