"""The key of a prepared dataset (``cpvlm prepare``) for a Hugging Face checkpoint's processor.

A prepared folder (``cpvlm.data.prepared``) holds plans made by one ``ChatEncoder``; they hold for
another run exactly when its processor plans every record the same way. The key is what decides
that: the processor class, hashes of the tokenizer files, the processor configs and the chat
template (each on its own, so that a change is named as what it is), the model's token ids, and
the data flags that change plans (``--train-on``, the pixel limits).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cpvlm.data.prepared import FORMAT_VERSION, PreparedSource, key_differences

PIXEL_FLAGS = ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
FLAGS = {"train_on": "--train-on", **{k: "--" + k.replace("_", "-") for k in PIXEL_FLAGS}}


def _hash_files(folder: Path, names: tuple[str, ...]) -> str:
    """sha256 over the files that exist; JSON parsed and written canonically, without its
    ``chat_template`` (hashed on its own, so that a template change is named as one)."""
    h = hashlib.sha256()
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if name.endswith(".json"):
            value = json.loads(data)
            if isinstance(value, dict):
                value.pop("chat_template", None)
            data = json.dumps(value, sort_keys=True).encode()
        h.update(name.encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:16]


def prepared_key(encoder, model_config, data) -> dict:
    """What produced the plans of ``encoder`` (a ``ChatEncoder``) under the ``DataConfig``
    ``data``: two runs with equal keys plan every record identically."""
    ids = encoder.ids
    return {
        "format": FORMAT_VERSION,
        "processor": type(encoder.processor).__name__,
        "processor_config": _hash_files(encoder.model_dir, PROCESSOR_FILES),
        "tokenizer": _hash_files(encoder.model_dir, TOKENIZER_FILES),
        "chat_template": hashlib.sha256(encoder.chat_template.encode()).hexdigest()[:16],
        "model_type": model_config.model_type,
        "token_ids": [ids.image, ids.video, ids.merge, ids.vocab_size, ids.pixel_width],
        **{name: getattr(data, name) for name in ("train_on", *PIXEL_FLAGS)},
    }


def check_prepared(source: PreparedSource, encoder, model_config, data) -> None:
    """Refuse a cache prepared with another processor, template or flags than this run's."""
    diffs = key_differences(source.key, prepared_key(encoder, model_config, data), FLAGS)
    if diffs:
        raise ValueError(
            f"data.source = {str(source.path)!r} (--data): prepared with another processor, "
            f"chat template or flags than this run's (it was made with --model "
            f"{source.manifest.get('model')}): {'; '.join(diffs)}; train with the --model and "
            "flags it was prepared with, or run cpvlm prepare again"
        )


def check_prepared_spec(config, model_config) -> None:
    """``check_prepared`` for ``config.data.source`` (the launcher's check before any rank)."""
    from cpvlm.hf.data.processor import ChatEncoder

    d = config.data
    try:
        source = PreparedSource(d.source)
    except ValueError as err:
        raise ValueError(f"data.source {str(err).removeprefix('--data ')} (--data)") from None
    kwargs = {name: getattr(d, name) for name in ("train_on", *PIXEL_FLAGS)}
    check_prepared(source, ChatEncoder(config.model.name, model_config, **kwargs), model_config, d)
