"""InternVL (``InternVLForConditionalGeneration``): a Qwen2 decoder with 1D RoPE, an InternViT tower
on square tiles, pixel shuffle and an MLP projector.

Legend: s tile side in patches (image_size // patch_size), m = 1 / downsample_ratio, p patch side.

The processor cuts an image into tiles of ``image_size`` pixels (a grid chosen by its aspect
ratio, plus a thumbnail when there is more than one tile) and writes ``<img>``, then
``image_seq_length`` = s*s/m**2 context tokens per tile, then ``</img>``; ``pixel_values`` is
``[tiles, C, H, W]`` for all images of the batch. A video is written as one-tile images, one per
frame, with its frame labels as text, and its frames join ``pixel_values``: the model has image
tokens only, and so has this adapter (synthetic videos become one-tile images, the kit's
``synthetic_items``).

The unit is one tile. ``get_image_features`` encodes each tile alone (the ViT attends within a
tile, its CLS token and position table are per tile), and pixel shuffle and the projector act on
one tile's features: so a tile's rows depend on that tile's pixels only, and the tiles of one image
may be encoded on different CP ranks exactly (tests/hf/test_tiled_families.py). In cpvlm's batch
an image of k tiles has the grid (k, s, s) and its pixels are the tiles' values viewed as k*s*s
rows of C*p*p values (``to_model_batch`` gives the model its ``[tiles, C, H, W]`` back, and
``from_model_batch`` takes the processor's, the grids read from the ids): the tiles of
an image are the "frames" of the Qwen layout, units of s*s pixel rows and s*s/m**2 output rows.

Positions are 1D (the model has no ``get_rope_index``): the core gives every packed document
positions 0..n-1, as the model's own forward gives a document alone.

The data path (``InternVLMedia``, ``cpvlm.hf.chat_media``): tiles of images, video frames as
one-tile images.

Legend: s tile side in patches, S = s * p in pixels, k tiles of an image, F frames of a video.

``InternVLProcessor`` cuts an image into k tiles (``GotOcr2ImageProcessor`` with
``crop_to_patches``: the tile grid from the aspect ratio, a thumbnail when more than one) and
writes ``<img>``, k * image_seq_length context tokens, ``</img>``; a video's frames are resized to
S x S by its video processor and written as ``Frame1: <img>...</img>\\nFrame2: ...``, and the
processor puts every tile and frame into one ``pixel_values`` in the order of the placeholders.
So the planned items are an image ``(k, s, s)`` and a video ``(F, s, s)``, and the model's items
are all images in text order (the video with its frames as the "tiles"); pixel rows are each
tile's ``[C, S, S]`` values viewed as s*s rows (the adapter's layout). The tile count comes from
the header through the image processor's own ``get_number_of_image_patches``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import torch
from transformers import InternVLConfig

from cpvlm.data.errors import DataError
from cpvlm.data.sample import VisionItem
from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.hf.adapter import ModulePaths, VLMAdapter
from cpvlm.hf.chat_media import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ChatMedia,
    frame_pixels,
    frames_of,
)
from cpvlm.hf.kit import FamilyKit, TinyProcessor
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import (
    IMAGE_TOKEN_ID,
    TEXT,
    VISION,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    split_overrides,
    with_overrides,
)

TILE = 32
"""Tile side of the tiny config in pixels: 4 x 4 patches of 8, 4 context tokens per tile."""


def tiny_internvl_config(**overrides) -> InternVLConfig:
    """An InternVL config small enough for float64 CPU tests (~140k parameters): InternViT of 2
    layers on 32-pixel tiles, a Qwen2 decoder with GQA, tied embeddings as in InternVL3-1B."""
    vision, text, top = split_overrides(overrides)
    vision = with_overrides(
        {
            "hidden_size": VISION["hidden_size"],
            "intermediate_size": VISION["intermediate_size"],
            "num_hidden_layers": VISION["depth"],
            "num_attention_heads": VISION["num_heads"],
            "image_size": TILE,
            "patch_size": VISION["patch_size"],
        },
        vision,
    )
    text = with_overrides(
        {**TEXT, "model_type": "qwen2", "bos_token_id": 1, "eos_token_id": 2}, text
    )
    side = TILE // VISION["patch_size"]
    top = with_overrides(
        {
            "image_token_id": IMAGE_TOKEN_ID,
            # <img> and </img>: the tokenizer's ids, kept in the config for the adapter
            "start_image_token_id": VISION_START_TOKEN_ID,
            "end_image_token_id": VISION_END_TOKEN_ID,
            "image_seq_length": side * side // 4,
            "attn_implementation": "sdpa",
        },
        top,
    )
    return InternVLConfig(text_config=text, vision_config=vision, **top)


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


def internvl_vision_cost(config) -> EncoderCost:
    """Per tile: patch embedding (C p^2 w per patch), blocks 4 w^2 + 2 w I with full attention,
    the projector on pixel-shuffled tokens ((m^2 w) D + D^2 per token, i.e. w D + D^2 / m^2 per
    patch). The CLS token (one of s*s + 1 per tile) is left out: every tile is s x s, so it scales
    every unit alike and changes no assignment."""
    vc, d = config.vision_config, config.text_config.hidden_size
    w, m = vc.hidden_size, round(1 / config.downsample_ratio)
    p = math.prod(_pair(vc.patch_size))
    projector = w * d + d * d // (m * m)
    linear = (
        vc.num_channels * p * w
        + vc.num_hidden_layers * block_linear_macs(w, vc.intermediate_size, gated=False)
        + projector
    )
    return EncoderCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.num_hidden_layers)


# ---- a tiny processor (InternVL-hf's tokens, a chatml template, GotOcr2's tiling) ----------------

_SPECIAL = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
# InternVL's template, reduced to what matters here: chatml turns, "<IMG_CONTEXT>\n" per image and
# "<video>\n" per video (the processor expands both).
_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif item['type'] == 'video' %}<video>\n{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _config_ids(tokenizer) -> dict:
    t = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": t(_SPECIAL["context_image_token"]),
        "start_image_token_id": t(_SPECIAL["start_image_token"]),
        "end_image_token_id": t(_SPECIAL["end_image_token"]),
    }


def _image_processor(config):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    side = config.vision_config.image_size
    side = side[0] if isinstance(side, (list, tuple)) else side
    return GotOcr2ImageProcessorPil(
        size={"height": side, "width": side}, crop_to_patches=True, max_patches=6
    )


def _video_processor(config) -> dict:
    side = config.vision_config.image_size
    side = side[0] if isinstance(side, (list, tuple)) else side
    return {
        "video_processor_type": "InternVLVideoProcessor",
        "size": {"height": side, "width": side},
    }


class InternVLKit(FamilyKit):
    tiny_configs = {"internvl-tiny": tiny_internvl_config}
    traits = frozenset({"tiled"})
    tiny_processor = TinyProcessor(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", *_SPECIAL.values()),
        tokenizer_kwargs={
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "extra_special_tokens": _SPECIAL,
        },
        chat_template=_TEMPLATE,
        processor_class="InternVLProcessor",
        config_ids=_config_ids,
        image_processor=_image_processor,
        video_processor=_video_processor,
        processor_settings=lambda config: {"image_seq_length": config.image_seq_length},
        frame_size=(TILE, TILE),  # one tile
    )

    def synthetic_items(self, kind, grid, *, images_in_sample=1):
        t, h, w = grid
        s = self.adapter.tile_side
        if kind == "video":
            return [("image", (1, s, s))] * t
        return [("image", (self.adapter.tiles(h, w) * t, s, s))]

    def item_tokens(self, kind, grid, text):
        if kind != "image":
            raise ValueError("InternVL writes video frames as images; it has no video tokens")
        a = self.adapter
        rows = a.item_sizes(grid, kind)[1]
        return [a.start_image_token_id] + [a.image_token_id] * rows + [a.end_image_token_id]

    def module_groups(self):
        v = r"model\.vision_tower\."
        groups = [
            ("vision patch embed", (v + r"embeddings\.",)),
            ("vision blocks", (v + r"(encoder|layernorm)\.",)),
            ("vision merger", (r"model\.multi_modal_projector\.",)),
            ("token embeddings", (r"model\.language_model\.embed_tokens\.",)),
            ("decoder layers", (r"model\.language_model\.(layers|norm)\.",)),
        ]
        if not self.config.tie_word_embeddings:  # tied: the head is the token embeddings
            groups.append(("lm head", (r"lm_head\.",)))
        return tuple(groups)


# ---- the data path (the processor) --------------------------------------------------------------

VIDEO_DEFAULTS = {  # InternVLVideoProcessor's class defaults (its config overrides them)
    "size": {"height": 384, "width": 384},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": list(OPENAI_CLIP_MEAN),
    "image_std": list(OPENAI_CLIP_STD),
}


class InternVLMedia(ChatMedia):
    def __init__(self, adapter, image_processor, video_config, **bounds):
        super().__init__(adapter, image_processor, video_config, **bounds)
        self.side = adapter.tile_side
        pixels = self.side * adapter.patch
        size = image_processor.size
        if (size["height"], size["width"]) != (pixels, pixels):
            raise ValueError(
                f"the image processor makes tiles of {size['height']}x{size['width']}, the tower "
                f"takes {pixels} a side"
            )
        video = video_config.get("size") or VIDEO_DEFAULTS["size"]
        if (video["height"], video["width"]) != (pixels, pixels):
            raise ValueError(
                f"the video processor resizes frames to {video['height']}x{video['width']}, the "
                f"tower takes {pixels} a side"
            )
        self.images_kwargs = {}

    def bind(self, processor):
        super().bind(processor)
        merged = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs)
        self.images_kwargs = {
            k: v for k, v in merged["images_kwargs"].items() if k != "return_tensors"
        }
        self.pattern = re.compile(
            f"({re.escape(processor.image_token)})|({re.escape(processor.video_token)})"
        )

    def image_items(self, refs):
        items = []
        for ref in refs:
            height, width = ref.size()
            k = self.image_processor.get_number_of_image_patches(height, width, self.images_kwargs)
            items.append(VisionItem("image", (k, self.side, self.side), image=ref))
        return items

    def video_item(self, frames, fps):
        return VisionItem("video", (len(frames), self.side, self.side), frames=frames, fps=fps)

    def image_inputs(self, items, i):
        return {"num_patches": [it.grid[0] for it in items]}, i

    def video_inputs(self, items, i):
        return {"pixel_values_videos": [torch.empty(it.grid[0], 0) for it in items]}, i

    def model_items(self, images, videos, text):
        images, videos = list(images), list(videos)
        order = []
        for match in self.pattern.finditer(text):
            if match.group(1):
                order.append(images.pop(0))
            else:  # a video's frames are one-tile images, its frames the item's "tiles"
                order.append(dataclasses.replace(videos.pop(0), kind="image"))
        return tuple(order), ()

    def decode(self, item, temporal):
        s = self.side
        if item.frames:  # a video: every frame resized to one tile
            frames = frames_of(item, temporal)
            tiles = frame_pixels(frames, (s * self.adapter.patch,) * 2, self.video_config,
                                 VIDEO_DEFAULTS)  # fmt: skip
            return tiles.reshape(tiles.shape[0] * s * s, -1)
        out = self.image_processor(
            images=[item.image.load()], **self.images_kwargs, return_tensors="pt"
        )
        tiles = out["pixel_values"]
        if tiles.shape[0] != item.grid[0]:
            raise DataError(
                "vision_token_mismatch",
                f"{item.image.name}: the image processor made {tiles.shape[0]} tiles, the image "
                f"header gave {item.grid[0]}",
            )
        if temporal is not None:
            tiles = tiles[list(temporal)]
        return tiles.reshape(tiles.shape[0] * s * s, -1)


@register
class InternVLAdapter(VLMAdapter):
    family = "internvl"
    model_classes = ("InternVLForConditionalGeneration",)
    model_types = ("internvl",)
    # the projector beside the tower is an FSDP unit of its own
    modules = ModulePaths(
        vision_tower="model.vision_tower", extra_units=("model.multi_modal_projector",)
    )
    kit = InternVLKit
    chat_media = InternVLMedia  # the data path's processor hooks

    def __init__(self, config):
        self.config = config
        m = 1 / config.downsample_ratio
        if abs(m - round(m)) > 1e-9:
            raise ValueError(
                f"InternVL: downsample_ratio {config.downsample_ratio} is not 1/integer; pixel "
                "shuffle then has no whole merge size"
            )
        self.merge_size = round(m)
        vc = config.vision_config
        side_h, side_w = (i // p for i, p in zip(_pair(vc.image_size), _pair(vc.patch_size)))
        if side_h != side_w or side_h % self.merge_size:
            raise ValueError(
                f"InternVL: tiles of {side_h} x {side_w} patches; the model needs square tiles "
                f"whose side divides by 1/downsample_ratio = {self.merge_size}"
            )
        self.tile_side = side_h
        self.patch = _pair(vc.patch_size)[0]

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def video_token_id(self) -> int:
        return -1  # no video tokens: video frames are images

    @property
    def start_image_token_id(self) -> int:
        # InternVL-hf tokenizers put <img>, </img>, <IMG_CONTEXT> at consecutive ids
        return getattr(self.config, "start_image_token_id", self.config.image_token_id - 2)

    @property
    def end_image_token_id(self) -> int:
        return getattr(self.config, "end_image_token_id", self.config.image_token_id - 1)

    @property
    def special_token_ids(self):
        return (self.image_token_id, self.start_image_token_id, self.end_image_token_id)

    @property
    def pixel_width(self) -> int:
        return self.config.vision_config.num_channels * self.patch * self.patch

    def mm_token_type_ids(self, input_ids, attention_mask=None):
        types = (input_ids == self.image_token_id).long()
        return types if attention_mask is None else types * attention_mask.bool()

    def tiles(self, h: int, w: int) -> int:
        """Tiles of an image of h x w patches, as the processor's ``crop_to_patches`` cuts one of
        that aspect ratio: a grid of ceil(h/s) x ceil(w/s) tiles, plus a thumbnail if more than
        one (the tiny model's stand-in for the processor's choice among its tile grids)."""
        s = self.tile_side
        n = -(-h // s) * -(-w // s)
        return n + 1 if n > 1 else n

    def from_model_batch(self, batch):
        """The processor's ``[tiles, C, H, W]`` pixels (every image's tiles and video frames, in
        text order) as pixel rows, with each image's grid (k, s, s) read from ``input_ids``: the
        processor writes ``image_seq_length`` context tokens per tile inside ``<img> </img>``."""
        pixels = batch.get("pixel_values")
        if pixels is None or pixels.dim() != 4:  # text only, or the core's layout already
            return batch
        c, p, s = self.config.vision_config.num_channels, self.patch, self.tile_side
        if tuple(pixels.shape[1:]) != (c, s * p, s * p):
            raise ValueError(
                f"InternVL: pixel_values of shape {tuple(pixels.shape)}; the model takes "
                f"[tiles, {c}, {s * p}, {s * p}]"
            )
        batch = dict(batch)
        batch["pixel_values"] = pixels.reshape(-1, self.pixel_width)  # the view _tiles undoes
        if batch.get("image_grid_thw") is None:
            batch["image_grid_thw"] = self._grids_from_ids(batch["input_ids"], batch)
        return batch

    def _grids_from_ids(self, ids: torch.Tensor, batch) -> torch.Tensor:
        """``[images, 3]``: (tiles, s, s) per run of context tokens, row-major (the order of the
        processor's ``pixel_values``)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError("input_ids must be an integer tensor of shape [B, S]")
        inside = self.mm_token_type_ids(ids, batch.get("attention_mask")).bool()
        starts = inside.clone()
        starts[:, 1:] &= ~inside[:, :-1]
        run = starts.reshape(-1).long().cumsum(0)[inside.reshape(-1)]
        lengths = torch.bincount(run)[1:] if run.numel() else run
        per_tile = self.item_sizes((1, self.tile_side, self.tile_side), "image")[1]
        if bool((lengths % per_tile).any()):
            raise ValueError(
                f"InternVL: runs of {lengths.tolist()} image context tokens (id "
                f"{self.image_token_id}) in input_ids; each image has {per_tile} per tile"
            )
        grids = torch.full((len(lengths), 3), self.tile_side, dtype=torch.long)
        grids[:, 0] = lengths // per_tile
        return grids

    def to_model_batch(self, batch):
        out = {k: v for k, v in batch.items() if k not in ("image_grid_thw", "mm_token_type_ids")}
        if batch.get("pixel_values") is not None:
            tile = (self.tile_side, self.tile_side)
            out["pixel_values"] = self._tiles(batch["pixel_values"], tile)
        return out

    # ---- vision ---------------------------------------------------------------------------------

    def _tiles(self, rows: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """``[tiles, C, H, W]`` from the pixel rows of tiles of ``size`` (h, w) patches (a view)."""
        c, p = self.config.vision_config.num_channels, self.patch
        h, w = size
        return rows.reshape(-1, c, h * p, w * p)

    def encode(self, model, pixel_values, grid_thw, kinds=None):
        # InternVLModel.get_image_features: the tower, the feature layer, pixel shuffle and the
        # projector. Consecutive items of one tile size go through one call (all real tiles are
        # s x s; EncoderDataParallel's dummy frame on a rank without units is a smaller one, alone).
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        out, row = [], 0
        for size, group in itertools.groupby(grids, key=lambda g: g[1:]):
            group = list(group)
            n = sum(t * h * w for t, h, w in group)
            tiles = self._tiles(pixel_values[row : row + n], size)
            features = model.model.get_image_features(pixel_values=tiles, return_dict=True)
            feats = features.pooler_output
            out.append(feats.reshape(-1, feats.shape[-1]))
            row += n
        return torch.cat(out)

    def vision_cost(self) -> EncoderCost:
        return internvl_vision_cost(self.config)
