"""Nemotron 3 Nano Omni's processor on the data path: images, audio clips and text.

Legend: p patch side, m = 1 / downsample_ratio, (gh, gw) an image's grid in patches, C channels.

Images. transformers' ``NemotronH_Omni_Reasoning_V3ImageProcessor`` needs torchvision (a
``TorchvisionBackend``), which cpvlm's data path does not require, so its steps are written out
here (``NemotronOmniImages``, the checkpoint's image processor entries; the tests compare them
with the class itself where torchvision works, else with its module's functions): every image of a call gets one patch budget
(``patch_budget``: the context length in patches, within ``[min_num_patches, max_num_patches]``);
an image's grid is its own grid (``floor(side / p) + 1`` where ``side / p`` is not whole) scaled
down into the budget, up to ``min_num_patches``, each side rounded to a multiple of m
(``patch_grid``); the RGB image (one with transparency composited onto white, as the class's
``convert_to_rgb``), as float32, is resized bicubic with antialias to ``(gh p, gw p)``
(kept in float32: no clamp), rescaled and normalised in one step, and cut into row-major patches
of ``C * p * p`` (channel-major), which are cpvlm's pixel rows. The processor writes ``<img>``,
``gh * gw / m**2`` ``<image>``, ``</img>`` per image (its own ``replace_image_token``).

Audio. Each clip is decoded to mono at the extractor's rate (``cpvlm.data.audio``) and its mel
frames made by the checkpoint's ``ParakeetFeatureExtractor`` on the clip alone: its n = L // hop
valid frames (the extractor normalises each clip over its own frames: in the processor's batch
call the same frames, the padding zero).
The processor's own ``replace_audio_token`` writes ``<so_start>``, f(1 + L // hop)
``<so_embedding>``, ``<so_end>``, its count from the processor's ``_estimate_audio_num_embeddings``
(which reads only L // hop, so n * hop samples give the clip's count).

The processor class is built around ``NemotronOmniImages``, no video processor (videos are not
in this step) and the feature extractor; the tiny checkpoint writes them all
(``tiny_nemotron_omni_processor``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cpvlm.data.audio import load_audio
from cpvlm.data.errors import DataError
from cpvlm.data.sample import AudioItem, VisionItem
from cpvlm.hf.chat_media import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ChatMedia
from cpvlm.hf.kit import TinyProcessor

IMAGE_PROCESSOR = "NemotronH_Omni_Reasoning_V3ImageProcessor"
PROCESSOR = "NemotronH_Omni_Reasoning_V3Processor"

# ---- the image processor's steps -----------------------------------------------------------------


def patch_grid(height, width, patch, merge, min_patches, max_patches) -> tuple[int, int]:
    """``(gh, gw)``: the grid an image of ``height x width`` pixels is resized to (the module
    docstring, "Images")."""
    gh, gw = round(height / patch + 0.5), round(width / patch + 0.5)  # the class's rule
    factor = min(math.sqrt(max_patches / (gh * gw)), 1.0)
    gh, gw = math.floor(factor * gh), math.floor(factor * gw)
    if gh * gw == 0:  # the class divides by it
        raise ValueError(f"an image of {height}x{width} pixels is too thin for the patch budget")
    if max_patches > min_patches and gh * gw < min_patches:
        factor = math.sqrt(min_patches / (gh * gw))
        gh, gw = math.ceil(factor * gh), math.ceil(factor * gw)
    if rem := gh % merge:
        gh = gh + merge - rem if (gh + merge - rem) * gw <= max_patches else max(merge, gh - rem)
    if rem := gw % merge:
        gw = gw + merge - rem if gh * (gw + merge - rem) <= max_patches else max(merge, gw - rem)
    return gh, gw


def patch_budget(images: int, merge, min_patches, max_patches, max_model_len) -> int:
    """The patch budget of every image of a call of ``images`` images."""
    budget = max((max_model_len - 4) * merge**2, min_patches * images)
    if max_patches:
        budget = min(budget, max_patches)
    return max(budget, min_patches)


class NemotronOmniImages:
    """The checkpoint's ``NemotronH_Omni_Reasoning_V3ImageProcessor`` entries and its steps in
    PIL and torch (module docstring, "Images"); what the processor class reads of it
    (``downsample_ratio``) and ``to_dict`` for the checkpoint files."""

    def __init__(
        self,
        *,
        patch_size: int = 16,
        downsample_ratio: float = 0.5,
        min_num_patches: int = 1024,
        max_num_patches: int = 13312,
        max_model_len: int = 16384,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD,
        norm_mean=None,  # published checkpoints' names of the statistics
        norm_std=None,
        **_,
    ):
        self.patch_size, self.downsample_ratio = int(patch_size), float(downsample_ratio)
        self.merge_size = round(1 / self.downsample_ratio)
        self.min_num_patches, self.max_num_patches = int(min_num_patches), int(max_num_patches)
        self.max_model_len = int(max_model_len)
        self.do_rescale, self.rescale_factor = bool(do_rescale), float(rescale_factor)
        self.do_normalize = bool(do_normalize)
        self.image_mean = list(norm_mean if norm_mean is not None else image_mean)
        self.image_std = list(norm_std if norm_std is not None else image_std)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> NemotronOmniImages:
        """From ``processor_config.json``'s ``image_processor`` or ``preprocessor_config.json``."""
        nested, flat = (
            Path(model_dir) / n for n in ("processor_config.json", "preprocessor_config.json")
        )
        entries = (
            json.loads(nested.read_text()).get("image_processor") if nested.is_file() else None
        )
        if entries is None and flat.is_file():
            entries = json.loads(flat.read_text())
        if entries is None:
            raise ValueError(f"{model_dir}: no image processor config (processor_config.json)")
        return cls(**entries)

    def to_dict(self) -> dict:
        keys = ("patch_size", "downsample_ratio", "min_num_patches", "max_num_patches")
        keys += ("max_model_len", "do_rescale", "rescale_factor", "do_normalize")
        return {
            "image_processor_type": IMAGE_PROCESSOR,
            **{k: getattr(self, k) for k in keys},
            "image_mean": self.image_mean,
            "image_std": self.image_std,
        }

    def grids(self, sizes) -> list[tuple[int, int]]:
        """``(gh, gw)`` of each image of one call, from its ``(height, width)``."""
        m, lo, hi = self.merge_size, self.min_num_patches, self.max_num_patches
        budget = patch_budget(len(sizes), m, lo, hi, self.max_model_len)
        return [patch_grid(h, w, self.patch_size, m, lo, budget) for h, w in sizes]

    def pixels(self, image, grid) -> torch.Tensor:
        """``[gh * gw, C * p * p]`` float32: a PIL image's pixel rows at ``grid``."""
        p, (gh, gw) = self.patch_size, grid
        x = torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1)[None]
        x = x.to(torch.float32)  # resized in float32: the bicubic overshoot is kept
        if tuple(x.shape[-2:]) != (gh * p, gw * p):
            x = F.interpolate(x, size=(gh * p, gw * p), mode="bicubic", antialias=True)
        mean, std = torch.tensor(self.image_mean), torch.tensor(self.image_std)
        if self.do_normalize:
            if self.do_rescale:  # fused: (x - mean / r) / (std / r)
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            x = x.sub(mean.view(-1, 1, 1)).div(std.view(-1, 1, 1))
        elif self.do_rescale:
            x = x * self.rescale_factor
        c = x.shape[1]
        x = x.reshape(c, gh, p, gw, p).permute(1, 3, 0, 2, 4)
        return x.reshape(gh * gw, c * p * p)

    def __call__(self, images, return_tensors="pt", **_) -> dict:
        """The class's output for one call: ``pixel_values`` and ``image_grid_hw``."""
        images = _flat_pil(images)
        grids = self.grids([(im.height, im.width) for im in images])
        return {
            "pixel_values": torch.cat([self.pixels(im, g) for im, g in zip(images, grids)]),
            "image_grid_hw": torch.tensor(grids, dtype=torch.long).reshape(-1, 2),
        }


def parakeet_features(feature_extractor, samples) -> torch.Tensor:
    """``[n, F]`` float32: the extractor on one clip's ``samples`` alone, its n valid frames
    (``input_features`` [1, n + 1, F] and its mask)."""
    out = feature_extractor(
        samples,
        sampling_rate=feature_extractor.sampling_rate,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return out["input_features"][0][out["attention_mask"][0].bool()].contiguous()


def to_rgb(image):
    """An RGB PIL image as the class's ``do_convert_rgb`` makes it (transformers'
    ``convert_to_rgb``): an image with transparency (an alpha band, or a palette or grayscale
    image with a ``transparency`` entry) composited onto white, any other converted."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _flat_pil(images) -> list:
    """PIL images from what a processor call passes: nested lists of PIL images, paths (loaded
    as ``fetch_images`` does) or ``[H, W, C]`` uint8 arrays."""
    from PIL import Image
    from transformers.image_utils import load_image

    if isinstance(images, (list, tuple)):
        return [im for x in images for im in _flat_pil(x)]
    if isinstance(images, Image.Image):
        return [images]
    if isinstance(images, str):
        return [load_image(images)]
    return [Image.fromarray(np.asarray(images))]


# ---- the data path -------------------------------------------------------------------------------


class NemotronOmniMedia(ChatMedia):
    """Nemotron Omni's processor on the data path (module docstring): images by
    ``NemotronOmniImages``, audio clips through the checkpoint's Parakeet feature extractor."""

    @classmethod
    def load_image_processor(cls, model_dir):
        return NemotronOmniImages.from_model_dir(model_dir)

    def processor_kwargs(self, settings):
        # video_processor given (None): build_processor waives the class's part checks, which
        # the stand-in image processor would not pass
        return {"video_processor": None, "feature_extractor": self.feature_extractor, **settings}

    def image_items(self, refs):
        sizes = [ref.size() for ref in refs]  # (height, width), from the headers
        try:
            grids = self.image_processor.grids(sizes)
        except ValueError as err:  # an aspect ratio the processor refuses
            raise DataError("unreadable_media", str(err)) from None
        return [VisionItem("image", (1, *g), image=r) for r, g in zip(refs, grids, strict=True)]

    def image_inputs(self, items, i):
        return {"image_grid_hw": torch.tensor([it.grid[1:] for it in items]).reshape(-1, 2)}, i

    def decode(self, item, temporal):
        if item.kind != "image":
            raise DataError("bad_record", "cpvlm takes no videos for nemotron_h_omni")
        return self.image_processor.pixels(item.image.load(), item.grid[1:])

    def audio_item(self, ref):
        fe = self.feature_extractor
        if fe is None:
            raise DataError("bad_record", "the checkpoint has no audio feature extractor")
        features = parakeet_features(fe, load_audio(ref, fe.sampling_rate))
        if not len(features):
            raise DataError(
                "unreadable_media",
                f"{ref.name}: shorter than one feature frame ({fe.hop_length} samples)",
            )
        return AudioItem(features, ref.name)

    def audio_inputs(self, items, i):
        p = self.processor  # its count reads L // hop only: n * hop samples give the clip's
        counts = [p._estimate_audio_num_embeddings(it.frames * p.audio_hop_length) for it in items]
        return {"num_tokens": [max(1, n) for n in counts]}, i


# ---- a tiny processor ----------------------------------------------------------------------------

_SPECIAL = {
    "image_token": "<image>",
    "image_start_token": "<img>",
    "image_end_token": "</img>",
    "audio_token": "<so_embedding>",
}
# A chatml template, as the checkpoint's, reduced to what matters here: "<image>\n" per image,
# "<so_embedding>\n" per audio clip (the processor expands both).
_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'audio' %}<so_embedding>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _config_ids(tokenizer) -> dict:
    t = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": t("<image>"),
        "image_start_token_id": t("<img>"),
        "image_end_token_id": t("</img>"),
        "audio_token_id": t("<so_embedding>"),
        "audio_start_token_id": t("<so_start>"),
        "audio_end_token_id": t("<so_end>"),
    }


def _image_processor(config) -> NemotronOmniImages:
    # grids of 4 x 4 to 8 x 8 patches of 8 pixels: the example images (12 to 90 pixels a side)
    # are scaled up and down
    return NemotronOmniImages(
        patch_size=config.vision_config.patch_size,
        downsample_ratio=config.downsample_ratio,
        min_num_patches=16,
        max_num_patches=64,
    )


def _feature_extractor(config):
    from transformers import ParakeetFeatureExtractor

    return ParakeetFeatureExtractor(feature_size=config.audio_config.num_mel_bins)


tiny_nemotron_omni_processor = TinyProcessor(
    special_tokens=(
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        *_SPECIAL.values(),
        "<so_start>",
        "<so_end>",
    ),
    tokenizer_kwargs={
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "extra_special_tokens": _SPECIAL,
    },
    chat_template=_TEMPLATE,
    processor_class=PROCESSOR,
    config_ids=_config_ids,
    image_processor=_image_processor,
    feature_extractor=_feature_extractor,
)
"""Nemotron Omni's processor at toy size: a chatml template with image and audio items, the
image steps of ``NemotronOmniImages`` (grids of 16 to 64 patches), Parakeet's feature extractor at
the model's mel bins."""
