"""A tiny checkpoint directory with a real processor, built offline for the examples and tests.

``make_tiny_checkpoint(dir, family)`` writes what a downloaded checkpoint of the family holds, at
toy size: the model (``save_pretrained`` of a tiny config whose special token ids are the
tokenizer's), a byte-level BPE tokenizer trained here with the ``tokenizers`` library, and the
family's chat template, image processor, video processor config and audio feature extractor
(its kit's ``tiny_processor``). ``layout="v5"`` writes transformers 5's ``processor_config.json`` (nested
processors) and ``chat_template.jinja``; ``layout="legacy"`` writes ``preprocessor_config.json``,
``video_preprocessor_config.json`` and ``chat_template.json`` (a feature extractor's entries
join the image processor's in ``preprocessor_config.json``, with the processor class, as in
published omni checkpoints).

``write_images`` and ``write_frames`` make PNG files of given sizes from a seed; ``write_wav``
a WAV file of given samples (the stdlib ``wave`` module, 16-bit PCM).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

_CORPUS = (
    "You are a helpful assistant. Describe the image. What is in the picture? A red square on a "
    "blue field, two cats, a video of a ball that rolls to the left and then stops. Count the "
    "shapes: one, two, three, four. The answer is yes. The answer is no. Seconds 0.5 1.0 2.0."
)


def _kit_class(family: str):
    from cpvlm.hf.registry import adapter_of_family

    kit = adapter_of_family(family).kit
    if kit.tiny_processor is None or not kit.tiny_configs:
        raise ValueError(f"the {family} kit has no tiny processor (FamilyKit.tiny_processor)")
    return kit


def tiny_tokenizer(family: str, vocab_size: int = 320):
    """A byte-level BPE tokenizer (``tokenizers``) with the family's special tokens (its kit's
    ``tiny_processor``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tiny = _kit_class(family).tiny_processor
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(tiny.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **tiny.tokenizer_kwargs)


def takes_example_videos(family: str) -> bool:
    """Whether the family's tiny checkpoint has a video processor (its example data videos)."""
    return _kit_class(family).tiny_processor.video_processor is not None


def takes_example_audio(family: str, model: str | None = None) -> bool:
    """Whether the tiny checkpoint of the family (of its tiny ``model``) has an audio feature
    extractor (example audio)."""
    extractor = _kit_class(family).tiny_processor.feature_extractor
    return extractor is not None and extractor(_tiny_config(family, model)()) is not None


def _tiny_config(family: str, model: str | None):
    """The config builder of the family's tiny ``model`` (None: its first)."""
    configs = _kit_class(family).tiny_configs
    if model is None:
        return next(iter(configs.values()))
    if model not in configs:
        raise ValueError(f"{model!r} is not a tiny model of {family} ({', '.join(configs)})")
    return configs[model]


def tiny_model_config(family: str, tokenizer, model: str | None = None):
    """The family's tiny config (of its tiny ``model``; None: its first) with the tokenizer's
    special token ids."""
    kit = _kit_class(family)
    return _tiny_config(family, model)(**kit.tiny_processor.config_ids(tokenizer))


def make_tiny_checkpoint(
    path: str | Path,
    family: str,
    *,
    layout: str = "v5",
    seed: int = 0,
    model: str | None = None,
) -> Path:
    """Write a tiny checkpoint directory (model + processor files) of the family's tiny ``model``
    (None: its first) and return its path."""
    from transformers import AutoModelForImageTextToText

    if layout not in ("v5", "legacy"):
        raise ValueError(f"layout must be 'v5' or 'legacy', got {layout!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tiny = _kit_class(family).tiny_processor
    tokenizer = tiny_tokenizer(family)
    config = tiny_model_config(family, tokenizer, model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    template = tiny.chat_template
    image_processor = tiny.image_processor(config)
    processor = {
        "processor_class": tiny.processor_class,
        "image_processor": image_processor.to_dict(),
        **tiny.processor_settings(config),
    }
    extractor = tiny.feature_extractor(config) if tiny.feature_extractor else None
    if extractor is not None:  # a config without audio has none
        extractor = {k: _plain(v) for k, v in extractor.to_dict().items()}
        processor["feature_extractor"] = extractor
    if tiny.video_processor is None:  # no video processor: the v5 layout, whatever is asked
        tokenizer.chat_template = template
        tokenizer.save_pretrained(path)
        (path / "processor_config.json").write_text(json.dumps(processor, indent=1))
        return path
    video = tiny.video_processor(config)
    if layout == "v5":
        tokenizer.chat_template = template
        tokenizer.save_pretrained(path)  # writes chat_template.jinja
        processor["video_processor"] = video
        (path / "processor_config.json").write_text(json.dumps(processor, indent=1))
    else:
        tokenizer.save_pretrained(path)
        image_processor.save_pretrained(path)  # preprocessor_config.json
        if extractor is not None:
            pre = json.loads((path / "preprocessor_config.json").read_text())
            pre = {**extractor, **pre, "processor_class": tiny.processor_class}
            (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
        (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1))
        (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
        settings = tiny.processor_settings(config)
        if settings:  # the processor's own settings stay in processor_config.json
            settings = {"processor_class": tiny.processor_class, **settings}
            (path / "processor_config.json").write_text(json.dumps(settings, indent=1))
    return path


def _plain(value):
    """A config value as JSON writes it (Gemma 4's extractor keeps ``mel_floor`` as an array)."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def _png(path: Path, height: int, width: int, rng) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def write_images(folder: str | Path, sizes, *, seed: int = 0, prefix: str = "img") -> list[str]:
    """PNG files ``prefix{i}.png`` of the ``(height, width)`` sizes; returns their names."""
    rng = np.random.default_rng(seed)
    names = []
    for i, (h, w) in enumerate(sizes):
        name = f"{prefix}{i}.png"
        _png(Path(folder) / name, h, w, rng)
        names.append(name)
    return names


def write_frames(folder: str | Path, frames: int, height: int, width: int, *, seed: int = 0):
    """A video as a folder of ``frames`` PNG frames."""
    rng = np.random.default_rng(seed)
    for f in range(frames):
        _png(Path(folder) / f"{f:05d}.png", height, width, rng)
    return Path(folder)


def write_video(path: str | Path, frames: int, height: int, width: int, *, fps: int = 10, seed=0):
    """A video file of ``frames`` random frames at ``fps`` (MPEG-4 part 2, which every FFmpeg build
    of PyAV encodes); returns its path."""
    import av

    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_wav(path: str | Path, samples, rate: int) -> Path:
    """A 16-bit PCM WAV file of ``samples`` ``[n]`` (mono) or ``[n, channels]`` in [-1, 1]."""
    import wave

    x = np.asarray(samples, dtype=np.float64)
    x = x[:, None] if x.ndim == 1 else x
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def example_clip(rng, seconds: float, rate: int, channels: int) -> np.ndarray:
    """``[n, channels]``: a tone of a random pitch under a little noise."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = rng.uniform(150, 900, channels)
    tone = 0.4 * np.sin(2 * np.pi * t[:, None] * pitch)
    return tone + 0.05 * rng.standard_normal((len(t), channels))


_WORDS = ("a red square", "two cats", "a blue field", "one, two, three", "yes", "no", "a ball")


def example_records(
    folder: str | Path, num_samples: int, *, seed: int = 0, videos: bool = True, audio: bool = False
):
    """Write images (and frame folders) under ``folder`` and return ``num_samples`` conversation
    records referring to them by relative paths: text-only, one or two images of several sizes,
    and (with ``videos``) a video of 3 to 5 frames; one or two turns. With ``audio``, every
    other sample also starts with a WAV clip of 0.5 to 2.5 s (a tone under noise, mono or
    stereo, at 16, 22.05 or 8 kHz), from a generator of its own: the rest is as without."""
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    records = []
    for i in range(num_samples):
        kind = ["text", "image", "image", "two_images", "video" if videos else "image"][i % 5]
        content = []
        if kind in ("image", "two_images"):
            for k in range(1 + (kind == "two_images")):
                h, w = (int(v) for v in rng.integers(12, 90, 2))
                name = f"img/s{i}_{k}.png"
                _png(folder / name, h, w, rng)
                content.append({"type": "image", "image": name})
        elif kind == "video":
            name = f"vid/s{i}"
            write_frames(folder / name, int(rng.integers(3, 6)), 24, 40, seed=seed * 1000 + i)
            content.append({"type": "video", "video": name, "fps": 2.0})
        question = "Describe the image." if kind != "text" else "Count the shapes:"
        content.append({"type": "text", "text": question + " " * int(rng.integers(0, 3))})
        answer = " ".join(_WORDS[int(j)] for j in rng.integers(0, len(_WORDS), 1 + i % 4))
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        if i % 3 == 0:
            messages += [
                {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": _WORDS[i % 7]}]},
            ]
        records.append({"messages": messages})
    if audio:
        _add_audio(folder, records, np.random.default_rng([seed, 1]))
    return records


def _add_audio(folder: Path, records, rng) -> None:
    for i, record in enumerate(records):
        if i % 2 == 0:
            continue
        rate = (16000, 22050, 8000)[i % 3]
        clip = example_clip(rng, rng.uniform(0.5, 2.5), rate, 1 + (i % 4 == 3))
        name = f"aud/s{i}.wav"
        write_wav(folder / name, clip, rate)
        record["messages"][0]["content"].insert(0, {"type": "audio", "audio": name})


def write_jsonl(path: str | Path, records) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
