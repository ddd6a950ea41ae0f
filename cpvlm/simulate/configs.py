"""Real model configs without downloads: published dimensions in transformers' config classes.

The published checkpoints are the family kits' ``published_configs`` (each builds the model's
config from its transformers config class with the dimensions of the checkpoint's
``config.json``, written in the family file, so nothing is fetched); anything else is a local
directory holding a ``config.json``. ``cpvlm plan --model`` takes either.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def published() -> dict[str, Callable]:
    """``{name: config builder}``: the published models ``cpvlm plan`` and the scale table use
    (``cpvlm.hf.registry.published_configs``)."""
    from cpvlm.hf.registry import published_configs

    return published_configs()


def __getattr__(name: str):
    if name == "PUBLISHED":  # from the registry, on first use (importing it needs transformers)
        return published()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_config(name_or_dir: str):
    """The config of a published name, a tiny model (``TINY_MODELS``) or a local directory
    with a ``config.json``; a ValueError says which names exist otherwise."""
    from cpvlm.hf import TINY_MODELS

    configs = published()
    if name_or_dir in configs:
        return configs[name_or_dir]()
    if name_or_dir in TINY_MODELS:
        return TINY_MODELS[name_or_dir]()
    path = Path(name_or_dir)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model {name_or_dir!r}: not a known config ({', '.join(configs)}, or a tiny "
            f"model: {', '.join(TINY_MODELS)}) and not a directory with a config.json"
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)
