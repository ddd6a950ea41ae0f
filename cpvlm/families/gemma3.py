"""Gemma 3 (gemma3): 1D RoPE, sliding-window layers, images attended bidirectionally.

The processor writes every image as ``<start_of_image>``, ``mm_tokens_per_image`` image tokens,
``<end_of_image>``; a pan-and-scan image is the full image followed by its crops, each written
and encoded as an image of its own. The SigLIP tower encodes each image (or crop) of the fixed
``image_size`` alone, so **a vision unit is one image or one pan-and-scan crop**. The model takes
``pixel_values [N, 3, H, W]`` and ``token_type_ids`` (1 at image tokens); the CP core takes
images as pixel rows with a grid: each image is ``(1, p, p)`` with p = image_size / patch_size
patches a side and the projector's average-pool kernel k = p / sqrt(mm_tokens_per_image) as its
merge size (k*k patches per image token), and its ``[3, H, W]`` pixels are the ``p*p`` rows of
``reshape(p*p, -1)`` (an exact view; ``from_model_batch`` / ``to_model_batch`` convert).

Text: ``Gemma3TextScaledWordEmbedding`` multiplies by sqrt(hidden_size) inside the embedding
module, so the core's ``embed_tokens(ids)`` is the model's own embedding; positions are 1D
(``arange`` per document: the model has no ``get_rope_index``). Attention masks per layer
(``create_masks_for_vision_model`` in transformers' ``models/gemma3/modeling_gemma3.py``): full
layers causal OR same image (``blockwise_overlay`` of ``get_block_sequence_ids_for_mask``: one
block per run of image tokens); sliding layers ``sliding_window_overlay`` AND (causal OR same
image). Under CP each image run is one span of the attention mask (``mask_spans``), on every
layer.
"""

from __future__ import annotations

import torch
from transformers import Gemma3Config

from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.hf.adapter import ModulePaths, VLMAdapter
from cpvlm.hf.chat_media import ChatMedia
from cpvlm.hf.kit import FamilyKit, TinyProcessor
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import TEXT, split_overrides, with_overrides

BOI_TOKEN_ID = 500
EOI_TOKEN_ID = 501
IMAGE_TOKEN_ID = 502

_TEXT = {
    **TEXT,
    "num_hidden_layers": 4,  # sliding, sliding, full, sliding: both kinds, a sliding one last
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ],
    "sliding_window": 8,  # shorter than the test rows and than an image (16 tokens)
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    },
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": 64,  # 8 x 8 patches of 8 pixels, pooled 2 x 2: 16 tokens per image
    "patch_size": 8,
    "vision_use_head": False,  # Gemma 3 uses the last hidden state, not SigLIP's pooling head
}


def tiny_gemma3_config(**overrides) -> Gemma3Config:
    """A Gemma 3 config small enough for float64 CPU tests (~150k parameters)."""
    vision, text, top = split_overrides(overrides)
    top = with_overrides(
        {
            "mm_tokens_per_image": 16,
            "boi_token_index": BOI_TOKEN_ID,
            "eoi_token_index": EOI_TOKEN_ID,
            "image_token_index": IMAGE_TOKEN_ID,
            "attn_implementation": "sdpa",
        },
        top,
    )
    return Gemma3Config(
        text_config=with_overrides(_TEXT, text),
        vision_config=with_overrides(_VISION, vision),
        **top,
    )


def siglip_vision_cost(vc) -> EncoderCost:
    """SigLIP: a P w patch embedding, blocks 4 w^2 + 2 w I, full attention within the image (the
    projector's pooling and projection are small and the same for every unit)."""
    w = vc.hidden_size
    linear = vc.num_channels * vc.patch_size**2 * w + vc.num_hidden_layers * block_linear_macs(
        w, vc.intermediate_size, gated=False
    )
    return EncoderCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.num_hidden_layers)


def untied_lm_head(config) -> tuple:
    """The "lm head" module group, or none when it is the token embedding (tied weights)."""
    return () if config.tie_word_embeddings else (("lm head", (r"lm_head\.",)),)


# ---- the kit: checks and tiny models -------------------------------------------------------------

_SPECIAL = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
# Gemma 3's template, reduced to what matters here: turns, <start_of_image> per image.
_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _config_ids(tokenizer) -> dict:
    t = tokenizer.convert_tokens_to_ids
    return {
        "boi_token_index": t(_SPECIAL["boi_token"]),
        "eoi_token_index": t(_SPECIAL["eoi_token"]),
        "image_token_index": t(_SPECIAL["image_token"]),
        "text_config": {
            "pad_token_id": t("<pad>"),
            "bos_token_id": t("<bos>"),
            "eos_token_id": t("<eos>"),
        },
    }


def _image_processor(config):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    side = config.vision_config.image_size
    return Gemma3ImageProcessorPil(size={"height": side, "width": side})


def gemma3_27b_config() -> Gemma3Config:
    """gemma3-27b: the published checkpoint's config.json dimensions (``cpvlm plan --model gemma3-27b``)."""
    return Gemma3Config(
        text_config={
            "vocab_size": 262208,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "query_pre_attn_scalar": 168,
            "sliding_window": 1024,
            "max_position_embeddings": 131072,
        },
        vision_config={
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "image_size": 896,
            "patch_size": 14,
        },
        mm_tokens_per_image=256,
    )


class Gemma3Kit(FamilyKit):
    tiny_configs = {"gemma3-tiny": tiny_gemma3_config}
    published_configs = {"gemma3-27b": gemma3_27b_config}
    traits = frozenset({"image_spans"})
    zero_gradients = (r"model\.vision_tower\..*\.self_attn\.k_proj\.bias$",)
    tiny_processor = TinyProcessor(
        special_tokens=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
        + tuple(_SPECIAL.values()),
        tokenizer_kwargs={
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "extra_special_tokens": _SPECIAL,
        },
        chat_template=_TEMPLATE,
        processor_class="Gemma3Processor",
        config_ids=_config_ids,
        image_processor=_image_processor,
        processor_settings=lambda config: {"image_seq_length": config.mm_tokens_per_image},
        end_of_turn="<end_of_turn>",
    )

    def synthetic_items(self, kind, grid, *, images_in_sample=1):
        # one fixed image size: every image gets the tower's grid, whatever is asked
        side = self.adapter.side
        return [(kind, (1, side, side) if kind == "image" else grid)]

    def item_tokens(self, kind, grid, text):
        if kind != "image":
            raise ValueError(f"{self.adapter.family} takes images only, not {kind}s")
        c = self.config
        return (
            [c.boi_token_index] + [c.image_token_id] * c.mm_tokens_per_image + [c.eoi_token_index]
        )

    def module_groups(self):
        v = r"model\.vision_tower\."
        return (
            ("vision patch embed", (v + r"embeddings\.",)),
            ("vision blocks", (v + r"(encoder|post_layernorm)\.",)),
            ("vision projector", (r"model\.multi_modal_projector\.",)),
            ("token embeddings", (r"model\.language_model\.embed_tokens\.",)),
            ("decoder layers", (r"model\.language_model\.(layers|norm)\.",)),
            *untied_lm_head(self.config),
        )

    def init_tiny(self, model):
        # Gemma initialises the projection at zero and every (1 + w) norm weight at zero: the
        # tower would get no gradient and the norms would all be the identity scale.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mm_input_projection_weight"):
                    p.normal_(0.0, p.shape[0] ** -0.5)
                elif "norm" in name and name.endswith("weight") and "vision_tower" not in name:
                    p.normal_(0.0, 0.1)

    # Gemma3RMSNorm computes in float32 whatever the model dtype: its weight gradients are float32
    # sums over the tokens (and images) of one call, which CP groups differently.
    float32_islands = ("Gemma3RMSNorm",)


# ---- the adapter ---------------------------------------------------------------------------------


class FixedImageMedia(ChatMedia):
    """The data path of a processor of fixed-size images (Gemma 3's): every image resized to the
    tower's one size, a ``(1, s, s)`` grid; images only (the processor class built without a video
    processor, ``takes_videos`` False)."""

    def image_grid(self, height: int, width: int):
        """The grid of an image through the checkpoint's image processor: its one size (resized,
        whatever the image's); pan-and-scan (crops as extra images) is not planned here."""
        image_processor, adapter = self.image_processor, self.adapter
        if getattr(image_processor, "do_pan_and_scan", None):
            raise ValueError("pan-and-scan (do_pan_and_scan) is not supported by the data path")
        size = image_processor.size
        if (size["height"], size["width"]) != (adapter.config.vision_config.image_size,) * 2:
            raise ValueError(
                f"the image processor resizes to {size['height']}x{size['width']}, the tower "
                f"takes {adapter.config.vision_config.image_size} a side"
            )
        return (1, adapter.side, adapter.side)

    def image_inputs(self, items, i):
        """What ``Gemma3Processor.replace_image_token`` reads: no pan-and-scan crops."""
        return {"num_crops": [0] * len(items)}, i


class FixedImageLayout(VLMAdapter):
    """Towers that encode fixed-size ``[N, 3, H, W]`` images (Gemma 3's SigLIP): each image a
    ``(1, p, p)`` grid of pixel rows, merge size k (the projector's pooling)."""

    modules = ModulePaths(vision_tower="model.vision_tower")
    split_frames = False
    takes_videos = False
    chat_media = FixedImageMedia
    model_batch_keys = ("token_type_ids",)

    def __init__(self, config):
        self.config = config
        vc = config.vision_config
        self.side = vc.image_size // vc.patch_size
        tokens_side = int(round(config.mm_tokens_per_image**0.5))
        if tokens_side**2 != config.mm_tokens_per_image or self.side % tokens_side:
            raise ValueError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} must be a square whose side "
                f"divides the {self.side} patches a side of the image"
            )
        self.merge_size = self.side // tokens_side
        if getattr(config.text_config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma 3 with text_config.use_bidirectional_attention (an encoder: two-sided "
                "windows) is not supported under context parallelism"
            )

    @property
    def video_token_id(self) -> int:
        return -1  # no videos

    @property
    def special_token_ids(self):
        c = self.config
        return (c.image_token_id, c.boi_token_index, c.eoi_token_index)

    @property
    def pixel_width(self) -> int:
        vc = self.config.vision_config
        return vc.num_channels * vc.image_size**2 // self.side**2

    # ---- the model's own batch <-> the core's -------------------------------------------------

    def from_model_batch(self, batch):
        batch = dict(batch)
        types = batch.pop("token_type_ids", None)
        if types is not None and batch.get("mm_token_type_ids") is None:
            batch["mm_token_type_ids"] = types
        pixels = batch.get("pixel_values")
        if isinstance(pixels, torch.Tensor) and pixels.dim() == 4:
            vc = self.config.vision_config
            want = (vc.num_channels, vc.image_size, vc.image_size)
            if tuple(pixels.shape[1:]) != want:
                raise ValueError(
                    f"pixel_values has shape {tuple(pixels.shape)}; {self.family} takes images "
                    f"[N, {', '.join(map(str, want))}]"
                )
            batch["pixel_values"] = pixels.reshape(pixels.shape[0] * self.side**2, -1)
            if batch.get("image_grid_thw") is None:
                batch["image_grid_thw"] = torch.tensor([[1, self.side, self.side]]).repeat(
                    pixels.shape[0], 1
                )
        return batch

    def to_model_batch(self, batch):
        batch = dict(batch)
        types = batch.pop("mm_token_type_ids", None)
        batch.pop("image_grid_thw", None)
        if "pixel_values" in batch:
            batch["pixel_values"] = self._images(batch["pixel_values"])
        if types is not None:
            batch["token_type_ids"] = types
        return batch

    def _images(self, rows: torch.Tensor) -> torch.Tensor:
        vc = self.config.vision_config
        return rows.reshape(-1, vc.num_channels, vc.image_size, vc.image_size)

    # ---- vision ------------------------------------------------------------------------------

    def encode(self, model, pixel_values, grid_thw, kinds=None):
        full = grid_thw.new_tensor([1, self.side, self.side])
        if len(grid_thw) == 1 and not torch.equal(grid_thw[0], full):
            # EncoderDataParallel's m x m dummy frame on a rank without images: one zero image,
            # one row of it kept (its value is discarded).
            zeros = pixel_values.new_zeros(self.side**2, self.pixel_width)
            return self.encode(model, zeros, full[None])[
                : int(grid_thw[0].prod()) // self.merge_size**2
            ]
        if not bool((grid_thw == full).all()):
            raise ValueError(f"{self.family} encodes images of one grid {full.tolist()} only")
        # get_image_features: the tower, then the projector beside it
        out = model.model.get_image_features(self._images(pixel_values), return_dict=True)
        return out.pooler_output.flatten(0, 1)

    def vision_cost(self) -> EncoderCost:
        return siglip_vision_cost(self.config.vision_config)


@register
class Gemma3Adapter(FixedImageLayout):
    family = "gemma3"
    model_classes = ("Gemma3ForConditionalGeneration",)
    model_types = ("gemma3",)
    kit = Gemma3Kit
    span_token_types = (1,)  # get_block_sequence_ids_for_mask: token_type_ids == 1
    span_layers = "all"  # create_masks_for_vision_model: full and sliding layers
