"""A tiny checkpoint directory with a real processor, built offline for the examples and tests.

``make_tiny_checkpoint(dir, family)`` writes what a downloaded Qwen2.5-VL / Qwen3-VL checkpoint
holds, at toy size: the model (``save_pretrained`` of a tiny config whose special token ids are
the tokenizer's), a byte-level BPE tokenizer trained here with the ``tokenizers`` library, the
family's chat template, a ``Qwen2VLImageProcessor`` with the model's patch / merge sizes and a
video processor config. ``layout="v5"`` writes transformers 5's ``processor_config.json`` (nested
processors) and ``chat_template.jinja``; ``layout="legacy"`` writes ``preprocessor_config.json``,
``video_preprocessor_config.json`` and ``chat_template.json``.

``write_images`` and ``write_frames`` make PNG files of given sizes from a seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_CORPUS = (
    "You are a helpful assistant. Describe the image. What is in the picture? A red square on a "
    "blue field, two cats, a video of a ball that rolls to the left and then stops. Count the "
    "shapes: one, two, three, four. The answer is yes. The answer is no. Seconds 0.5 1.0 2.0."
)
_QWEN_TEMPLATE = """{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{SYSTEM}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}<|im_end|>
{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
_DEFAULT_SYSTEM = """{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}"""
CHAT_TEMPLATES = {
    # Qwen2-VL / Qwen2.5-VL's template (a default system prompt); Qwen3-VL's renders images and
    # videos the same way, without the default system prompt.
    "qwen2_5_vl": _QWEN_TEMPLATE.replace("{SYSTEM}", _DEFAULT_SYSTEM),
    "qwen3_vl": _QWEN_TEMPLATE.replace("{SYSTEM}", ""),
}
# Gemma 3's template, reduced to what matters here: turns, <start_of_image> per image.
CHAT_TEMPLATES["gemma3"] = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_SPECIAL_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
PROCESSOR_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "gemma3": "Gemma3Processor",
}
VIDEO_PROCESSORS = {"qwen2_5_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor"}
IMAGE_MIN_PIXELS = 16 * 16 * 4  # 4 x 4 patches of 8 pixels: 4 merged tokens
IMAGE_MAX_PIXELS = 16 * 16 * 16  # 8 x 8 patches: 16 merged tokens
VIDEO_MIN_PIXELS = 16 * 16 * 4
VIDEO_MAX_PIXELS = 16 * 16 * 4 * 8


def tiny_tokenizer(vocab_size: int = 320, family: str = "qwen3_vl"):
    """A byte-level BPE tokenizer (``tokenizers``) with the family's special tokens (Qwen-VL's;
    Gemma 3's named boi / eoi / image tokens, and <bos>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    gemma = family == "gemma3"
    specials = list(SPECIAL_TOKENS)
    if gemma:
        specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
        specials += list(GEMMA3_SPECIAL_TOKENS.values())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    if gemma:
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            extra_special_tokens=GEMMA3_SPECIAL_TOKENS,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def tiny_model_config(family: str, tokenizer):
    """The tiny config of ``family`` with the tokenizer's special token ids."""
    from cpvlm.integrations.hf.models import tiny_qwen2_5_vl_config, tiny_qwen3_vl_config

    if family == "gemma3":
        from cpvlm.integrations.hf.families.gemma3 import tiny_gemma3_config

        t = tokenizer.convert_tokens_to_ids
        return tiny_gemma3_config(
            boi_token_index=t(GEMMA3_SPECIAL_TOKENS["boi_token"]),
            eoi_token_index=t(GEMMA3_SPECIAL_TOKENS["eoi_token"]),
            image_token_index=t(GEMMA3_SPECIAL_TOKENS["image_token"]),
            text_config={
                "pad_token_id": t("<pad>"),
                "bos_token_id": t("<bos>"),
                "eos_token_id": t("<eos>"),
            },
        )
    ids = {
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    }
    build = {"qwen3_vl": tiny_qwen3_vl_config, "qwen2_5_vl": tiny_qwen2_5_vl_config}[family]
    return build(**ids)


def _image_processor(config):
    if config.model_type == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        side = config.vision_config.image_size
        return Gemma3ImageProcessorPil(size={"height": side, "width": side})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    v = config.vision_config
    return Qwen2VLImageProcessorPil(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        min_pixels=IMAGE_MIN_PIXELS,
        max_pixels=IMAGE_MAX_PIXELS,
    )


def _video_config(family: str, config) -> dict:
    v = config.vision_config
    return {
        "video_processor_type": VIDEO_PROCESSORS[family],
        "patch_size": v.patch_size,
        "merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
        "size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
    }


def make_tiny_checkpoint(
    path: str | Path, family: str = "qwen3_vl", *, layout: str = "v5", seed: int = 0
) -> Path:
    """Write a tiny checkpoint directory (model + processor files) and return its path."""
    from transformers import AutoModelForImageTextToText

    if layout not in ("v5", "legacy"):
        raise ValueError(f"layout must be 'v5' or 'legacy', got {layout!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(family=family)
    config = tiny_model_config(family, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(path)
    template = CHAT_TEMPLATES[family]
    image_processor = _image_processor(config)
    if family == "gemma3":  # no video processor; the processor's own image_seq_length
        tokenizer.chat_template = template
        tokenizer.save_pretrained(path)
        processor = {
            "processor_class": PROCESSOR_CLASSES[family],
            "image_processor": image_processor.to_dict(),
            "image_seq_length": config.mm_tokens_per_image,
        }
        (path / "processor_config.json").write_text(json.dumps(processor, indent=1))
        return path
    video = _video_config(family, config)
    if layout == "v5":
        tokenizer.chat_template = template
        tokenizer.save_pretrained(path)  # writes chat_template.jinja
        processor = {
            "processor_class": PROCESSOR_CLASSES[family],
            "image_processor": image_processor.to_dict(),
            "video_processor": video,
        }
        (path / "processor_config.json").write_text(json.dumps(processor, indent=1))
    else:
        tokenizer.save_pretrained(path)
        image_processor.save_pretrained(path)  # preprocessor_config.json
        (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1))
        (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    return path


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


_WORDS = ("a red square", "two cats", "a blue field", "one, two, three", "yes", "no", "a ball")


def example_records(folder: str | Path, num_samples: int, *, seed: int = 0, videos: bool = True):
    """Write images (and frame folders) under ``folder`` and return ``num_samples`` conversation
    records referring to them by relative paths: text-only, one or two images of several sizes,
    and (with ``videos``) a video of 3 to 5 frames; one or two turns."""
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
    return records


def write_jsonl(path: str | Path, records) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
