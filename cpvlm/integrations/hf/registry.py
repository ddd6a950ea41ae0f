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

from .adapter import VLMAdapter
from .kit import FamilyKit

_ADAPTERS: list[type[VLMAdapter]] = []


def register(cls: type[VLMAdapter]) -> type[VLMAdapter]:
    """Class decorator: make ``cls`` the adapter of its ``model_classes`` and ``model_types``."""
    if not (cls.family and cls.model_classes and cls.model_types):
        raise ValueError(f"{cls.__name__}: set family, model_classes and model_types")
    for other in _ADAPTERS:
        taken = (set(other.model_classes) & set(cls.model_classes)) | (
            set(other.model_types) & set(cls.model_types)
        )
        if taken and other is not cls:
            raise ValueError(f"{cls.__name__}: {sorted(taken)} already served by {other.__name__}")
        if set(other.kit.tiny_configs) & set(cls.kit.tiny_configs) and other is not cls:
            raise ValueError(f"{cls.__name__}: tiny model names clash with {other.__name__}")
    if cls not in _ADAPTERS:
        _ADAPTERS.append(cls)
    return cls


def _registered() -> list[type[VLMAdapter]]:
    from . import families  # noqa: F401  (registers every family)

    return _ADAPTERS


def supported() -> list[str]:
    """The supported transformers model classes, sorted."""
    return sorted(c for a in _registered() for c in a.model_classes)


def families() -> list[str]:
    """The family names, in registration order."""
    return [a.family for a in _registered()]


def tiny_models() -> dict[str, Callable]:
    """``{"<family>-tiny": config builder}`` of every family."""
    return {name: fn for a in _registered() for name, fn in a.kit.tiny_configs.items()}


def tiny_adapters() -> dict[str, type[VLMAdapter]]:
    """``{"<family>-tiny": adapter class}``: which family each tiny model belongs to."""
    return {name: a for a in _registered() for name in a.kit.tiny_configs}


def published_towers() -> dict[str, tuple[str, dict]]:
    """``{checkpoint: (model_type, vision_config)}`` of the kits' published towers."""
    return {
        name: (a.model_types[0], vc)
        for a in _registered()
        for name, vc in vars(a.kit).get("published_towers", {}).items()
    }


def adapter_of_family(family: str) -> type[VLMAdapter]:
    """The adapter class of a family name."""
    for a in _registered():
        if a.family == family:
            return a
    raise ValueError(f"unknown family {family!r}; known: {', '.join(families())}")


def adapter_class(model_or_config) -> type[VLMAdapter]:
    adapters = _registered()
    if isinstance(model_or_config, nn.Module):
        names = [k.__name__ for k in type(model_or_config).__mro__]
        for name in names:
            for a in adapters:
                if name in a.model_classes:
                    return a
        what = f"model class {type(model_or_config).__name__}"
    else:
        model_type = getattr(model_or_config, "model_type", None)
        for a in adapters:
            if model_type in a.model_types:
                return a
        what = f"config model_type {model_type!r}"
    model_types = sorted(t for a in adapters for t in a.model_types)
    raise ValueError(
        f"unsupported {what}: cpvlm supports the image-text-to-text models "
        f"{', '.join(supported())} (model_type {', '.join(model_types)}). "
        "A family is added with one adapter file: see cpvlm/integrations/hf/adapter.py"
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
