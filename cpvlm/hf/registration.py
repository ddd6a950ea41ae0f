"""The registered adapters: ``@register`` makes an adapter class serve its model classes and types.

A family file registers its adapter here; ``registry.py`` imports every family and looks the
registered adapters up. Kept apart from the lookups so that a family imports no module that
imports the families.
"""

from __future__ import annotations

from cpvlm.hf.adapter import VLMAdapter

ADAPTERS: list[type[VLMAdapter]] = []
"""Registered adapter classes, in registration order."""


def register(cls: type[VLMAdapter]) -> type[VLMAdapter]:
    """Class decorator: make ``cls`` the adapter of its ``model_classes`` and ``model_types``."""
    if not (cls.family and cls.model_classes and cls.model_types):
        raise ValueError(f"{cls.__name__}: set family, model_classes and model_types")
    for other in ADAPTERS:
        taken = (set(other.model_classes) & set(cls.model_classes)) | (
            set(other.model_types) & set(cls.model_types)
        )
        if taken and other is not cls:
            raise ValueError(f"{cls.__name__}: {sorted(taken)} already served by {other.__name__}")
        if set(other.kit.tiny_configs) & set(cls.kit.tiny_configs) and other is not cls:
            raise ValueError(f"{cls.__name__}: tiny model names clash with {other.__name__}")
    if cls not in ADAPTERS:
        ADAPTERS.append(cls)
    return cls
