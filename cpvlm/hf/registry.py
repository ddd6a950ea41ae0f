"""Which adapter serves a model: registered by transformers model class (and config model_type).

``adapter_for(model)`` looks the model's class (and its base classes) up among the registered
``model_classes``; a config (no model yet: the trainer's launcher, synthetic data) is looked up by
``config.model_type``. Anything else gets one error listing what is supported. The lists of
families, tiny models and model classes that help texts, the trainer and the tests show are
derived from the registered adapters, here.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from cpvlm import families as _families  # noqa: F401  (importing it registers every family)
from cpvlm.hf.adapter import VLMAdapter
from cpvlm.hf.kit import FamilyKit
from cpvlm.hf.registration import ADAPTERS


def supported() -> list[str]:
    """The supported transformers model classes, sorted."""
    return sorted(c for a in ADAPTERS for c in a.model_classes)


def families() -> list[str]:
    """The family names, in registration order."""
    return [a.family for a in ADAPTERS]


def tiny_models() -> dict[str, Callable]:
    """``{"<family>-tiny": config builder}`` of every family."""
    return {name: fn for a in ADAPTERS for name, fn in a.kit.tiny_configs.items()}


def default_model() -> str:
    """The tiny model ``cpvlm train`` and ``cpvlm verify`` use by default: the first tiny model of
    the one family whose kit says ``default_model``."""
    # Declared on the kit class itself: a family's kit that subclasses another's does not inherit it.
    chosen = [next(iter(a.kit.tiny_configs)) for a in ADAPTERS if vars(a.kit).get("default_model")]
    if len(chosen) != 1:
        raise RuntimeError(f"exactly one family kit must set default_model; got {chosen}")
    return chosen[0]


def model_help() -> str:
    """The ``--model`` help of ``cpvlm train`` and ``cpvlm verify``, listing the tiny models."""
    return f"a local checkpoint directory or a tiny model: {', '.join(tiny_models())}"


def tiny_adapters() -> dict[str, type[VLMAdapter]]:
    """``{"<family>-tiny": adapter class}``: which family each tiny model belongs to."""
    return {name: a for a in ADAPTERS for name in a.kit.tiny_configs}


def published_towers() -> dict[str, tuple[str, dict]]:
    """``{checkpoint: (model_type, vision_config)}`` of the kits' published towers."""
    return {
        name: (a.model_types[0], vc)
        for a in ADAPTERS
        for name, vc in vars(a.kit).get("published_towers", {}).items()
    }


def published_configs() -> dict[str, Callable]:
    """``{name: config builder}`` of the kits' published checkpoint configs (``cpvlm plan``)."""
    return {
        name: fn for a in ADAPTERS for name, fn in vars(a.kit).get("published_configs", {}).items()
    }


def adapter_of_family(family: str) -> type[VLMAdapter]:
    """The adapter class of a family name."""
    for a in ADAPTERS:
        if a.family == family:
            return a
    raise ValueError(f"unknown family {family!r}; known: {', '.join(families())}")


def adapter_class(model_or_config) -> type[VLMAdapter]:
    if isinstance(model_or_config, nn.Module):
        names = [k.__name__ for k in type(model_or_config).__mro__]
        for name in names:
            for a in ADAPTERS:
                if name in a.model_classes:
                    return a
        what = f"model class {type(model_or_config).__name__}"
    else:
        model_type = getattr(model_or_config, "model_type", None)
        for a in ADAPTERS:
            if model_type in a.model_types:
                return a
        what = f"config model_type {model_type!r}"
    model_types = sorted(t for a in ADAPTERS for t in a.model_types)
    raise ValueError(
        f"unsupported {what}: cpvlm supports the image-text-to-text models "
        f"{', '.join(supported())} (model_type {', '.join(model_types)}). "
        "A family is added with one adapter file: see cpvlm/hf/adapter.py"
    )


def adapter_for(model_or_config) -> VLMAdapter:
    """The adapter of a transformers VLM (``*ForConditionalGeneration``) or of its config."""
    config = getattr(model_or_config, "config", model_or_config)
    if isinstance(model_or_config, nn.Module):
        return adapter_class(model_or_config)(config)
    return adapter_class(config)(config)


def kit_for(model_or_config) -> FamilyKit:
    """The family kit (tests', verify's and synthetic data's knowledge) of a model or config."""
    adapter = adapter_for(model_or_config)
    return adapter.kit(adapter)
