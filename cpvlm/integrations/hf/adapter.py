"""The family adapter: what one transformers VLM family does differently, and nothing else.

Legend: B batch, S full length, L local length, D hidden size, R visual rows, E experts.

The core (``prepare_batch``, ``ContextParallelVLM``) knows the CP step: replicated integer inputs,
the plan, local embeddings, vision data parallelism, the decoder on the shard, the token-mean
loss. An adapter answers the family's questions:

- tokens: how the processor writes an image or a video into the sequence (``item_tokens``),
  which token type each placeholder has (``mm_token_type_ids``: 0 text, 1 image, 2 video), what
  items it makes of an image (``synthetic_items``: tiles), and the conversion between the
  model's own batch and the core's (``from_model_batch`` / ``to_model_batch``: ``[tiles, C, H,
  W]`` pixels for a tiling family, Gemma's images);
- modules: where the text model, embeddings, lm head and vision tower are, which modules are
  FSDP units, what stays trainable when the encoder is frozen, the module groups that
  ``cpvlm verify`` reports;
- vision: how the tower is called and what it returns (``encode``: rows, or rows and deepstack
  levels), whether video frames are independent units, the per-unit cost model (``vision_cost``),
  and where an item's pixel and output rows are not t*h*w and t*h*w/m**2, what they are
  (``item_sizes`` with ``unit_sizes = True``: LLaVA-OneVision's crops and packed rows);
- positions: ``rope_index`` per document (M-RoPE families: the model's own ``get_rope_index``;
  1D-RoPE families return None and the core uses the plan's per-document positions);
- masks: the token types whose runs attend bidirectionally (``span_token_types``) and on which
  layers (``span_layers``); sliding windows come from the layers themselves (Gemma);
- decoder: extra keywords of the text model's forward (``decoder_kwargs``: deepstack rows, router
  logits; ``decoder_inputs``: Gemma 4's per-layer inputs); extra losses (``extra_losses``: the MoE
  router's load-balancing loss); a final logit soft-cap (``logit_softcap``).

The defaults are the Qwen2-VL layout: one ``<vision_start> pads <vision_end>`` group per item, a
tower ``visual(pixel_rows, grid_thw)`` with the merger inside that returns ``pooler_output``, M-RoPE
from ``model.model.get_rope_index``, no extra keywords or losses. A family overrides what differs.

Adding a family is one file plus its tests:
1. ``cpvlm/integrations/hf/families/<family>.py``: a ``VLMAdapter`` subclass decorated with
   ``@register``, naming ``family``, ``model_classes`` (the transformers
   ``*ForConditionalGeneration`` class names it serves), ``model_types`` (their ``config.model_type``), ``tiny_configs`` (a tiny
   config built from the real config class, under a ``<family>-tiny`` name), and the overrides.
   Import the module in ``families/__init__.py``.
2. ``tests/hf/``: add the tiny name to ``FAMILIES`` in ``tests/hf/hf_families.py`` (the shared
   exactness, checkpoint and verify tests then run on it) and test what is particular to it.
3. README: the families table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from cpvlm.router_loss import load_balancing_loss_share
from cpvlm.vision.cost import VisionCost
from cpvlm.vision.split import Piece, UnitOrder, pixel_order

from .vision_cost import qwen2_vl_vision_cost

VisionRows = torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]
"""What ``encode`` returns: ``[R, D]`` rows, or ``([R, D], [[R, D_l], ...])`` with deepstack
levels."""


@dataclass(frozen=True)
class LossContext:
    """What an extra loss needs besides the decoder's output."""

    group: dist.ProcessGroup | None  # the CP group: the batch's tokens are spread over it
    real_mask: torch.Tensor  # [B, L] bool: this rank's positions holding a real token (not padding)


@dataclass(frozen=True)
class RouterLoss:
    """The model's router load-balancing loss: ``weight * aux`` over its top-``top_k`` routing."""

    top_k: int
    weight: float


class MoeRouter:
    """Mixin of the MoE families (listed before the family's adapter in the bases): the router
    loss from the text config, and the router and expert parameters as their own groups."""

    float64_load_kwargs = {"experts_implementation": "eager"}
    experts_pattern = r"experts\."  # the expert parameters of a layer's mlp

    def router_loss(self) -> RouterLoss | None:
        text = self.config.text_config
        if not text.output_router_logits:
            return None
        return RouterLoss(top_k=text.num_experts_per_tok, weight=text.router_aux_loss_coef)

    def module_groups(self):
        layer = r"model\.language_model\.layers\.\d+\.mlp\."
        groups = list(super().module_groups())
        i = [label for label, _ in groups].index("decoder layers")
        groups[i:i] = [
            ("router", (layer + r"gate\.",)),
            ("experts", (layer + self.experts_pattern,)),
        ]
        return tuple(groups)


@dataclass(frozen=True)
class ExtraLoss:
    """One extra loss term, ``weight * share``; the CP ranks' shares sum to the batch's loss."""

    share: torch.Tensor
    weight: float


class VLMAdapter:
    """The Qwen2-VL layout; subclasses override what their family does differently."""

    family: ClassVar[str] = ""
    model_classes: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    tiny_configs: ClassVar[dict[str, Callable[..., Any]]] = {}
    video_keys: ClassVar[tuple[str, ...]] = ()
    """Batch keys with one entry per video besides pixels and grid (second_per_grid_ts)."""
    split_frames: ClassVar[bool] = True
    """The tower treats a video's temporal frames independently: each frame is a vision unit."""
    projector: ClassVar[tuple[str, ...]] = ("merger",)
    """Tower submodules (name prefixes) that stay trainable when the vision encoder is frozen."""
    mixes_images_and_videos: ClassVar[bool] = True
    """The model's own forward takes images and videos in one call (GLM-4V's does not)."""
    takes_videos: ClassVar[bool] = True
    """The family has videos at all (Gemma 3 does not)."""
    float32_groups: ClassVar[tuple[str, ...]] = ()
    """Module groups (``module_groups`` labels) whose gradients the model computes in float32 even
    in a float64 model; float64 checks hold them to float32 round-off. ``("*",)``: every group and
    the loss (a float32 part in the forward, such as GLM-4.5V's router)."""
    float64_load_kwargs: ClassVar[dict[str, str]] = {}
    """Loading keywords a float64 model needs (MoE: eager experts; grouped_mm rejects float64)."""
    zero_gradients: ClassVar[tuple[str, ...]] = ()
    """Parameter-name regexes whose gradient is zero in exact arithmetic and round-off in floats
    (SigLIP's key bias: it adds q.b to every logit of a query, which softmax cancels). A relative
    error of round-off means nothing: checks hold them to their module group's gradient scale."""
    cost_model: ClassVar[Callable[[Any], VisionCost]] = staticmethod(qwen2_vl_vision_cost)
    """The tower's cost model from its ``vision_config`` (``cpvlm.integrations.hf.vision_cost``)."""
    model_batch_keys: ClassVar[tuple[str, ...]] = ()
    """Keys of the model's own batch that ``from_model_batch`` turns into the core's."""
    span_token_types: ClassVar[tuple[int, ...]] = ()
    """Token types (``mm_token_type_ids``) whose runs attend to each other bidirectionally (one
    mask span per run and document); () for causal-only models."""
    span_layers: ClassVar[str] = "all"
    """Where the spans apply: ``"all"`` layers or the ``"sliding"`` (windowed) ones only."""

    split_vision: ClassVar[bool] = False
    """The tower can run sequence-parallel on a unit's patches (``vision="split"``): it takes
    every per-patch input precomputed (``split_tower_kwargs``) and attends through its attention
    function with ``cu_seqlens``."""

    def __init__(self, config):
        self.config = config
        self.merge_size = int(config.vision_config.spatial_merge_size)

    # ---- tokens: the processor's layout ---------------------------------------------------------

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.config.video_token_id

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Every id the layout writes around or for vision items (never drawn as text)."""
        c = self.config
        return (c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id)

    @property
    def pixel_width(self) -> int:
        """Values in one pixel row (one patch): channels * temporal patch * patch * patch."""
        v = self.config.vision_config
        return v.in_channels * v.temporal_patch_size * v.patch_size**2

    def mm_token_type_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[B, S]`` long: 1 at image placeholders, 2 at video placeholders, 0 elsewhere (the
        processor's ``mm_token_type_ids``; padding is 0)."""
        types = (input_ids == self.image_token_id).long()
        types += 2 * (input_ids == self.video_token_id).long()
        return types if attention_mask is None else types * attention_mask.bool()

    def from_model_batch(self, batch: dict) -> dict:
        """The model's own batch (its processor's keys and pixel layout) in the core's layout:
        pixel rows ``[patches, C]`` with ``image_grid_thw``, ``mm_token_type_ids``. Default: the
        same (the Qwen-VL layout); also given the core's layout, it returns it unchanged."""
        return batch

    def to_model_batch(self, batch: dict) -> dict:
        """The inverse of ``from_model_batch``: the keywords of the model's own forward for a
        batch in the core's layout (InternVL: tiles ``[N, C, H, W]``; LLaVA-OneVision: crops
        and ``image_sizes``; Gemma: images or padded patch sequences)."""
        return batch

    def item_tokens(
        self, kind: str, grid: tuple[int, int, int], text: Callable[[int], list[int]]
    ) -> list[int]:
        """The token ids the processor writes for one image or video of ``grid`` (t, h, w) in
        patches; ``text(n)`` gives n text tokens where the layout has text (timestamps)."""
        t, h, w = grid
        c = self.config
        pad = c.image_token_id if kind == "image" else c.video_token_id
        frame = h * w // self.merge_size**2
        return [c.vision_start_token_id] + [pad] * (t * frame) + [c.vision_end_token_id]

    def synthetic_items(
        self, kind: str, grid: tuple[int, int, int], *, images_in_sample: int = 1
    ) -> list[tuple[str, tuple[int, int, int]]]:
        """The items (kind, grid) the family's processor makes of an image of ``grid`` (1, h, w)
        or a video of (t, h, w) patches in a sample of ``images_in_sample`` images, for synthetic
        batches. Default: that item. A tiling family returns its tiles' or crops' grid (LLaVA-
        OneVision: base crop only in a multi-image sample); one without video tokens, the frames
        as images; a tower of one fixed image size, its grid (Gemma 3)."""
        return [(kind, grid)]

    unit_sizes: ClassVar[bool] = False
    """``item_sizes`` is not the Qwen-VL rule (t*h*w, t*h*w/m**2): VisionDataParallel and the data
    path then size units by it."""

    def item_sizes(self, grid: tuple[int, int, int]) -> tuple[int, int]:
        """``(pixel rows, output rows)`` of an item (or unit) of ``grid`` in cpvlm's batch: t*h*w
        patch rows and t*h*w/m**2 merged tokens (LLaVA-OneVision: an image's crops and its packed
        rows)."""
        t, h, w = grid
        return t * h * w, t * h * w // self.merge_size**2

    # ---- modules --------------------------------------------------------------------------------

    def text_model(self, model: nn.Module) -> nn.Module:
        """The decoder: ``forward(inputs_embeds=, position_ids=, ...)`` -> last_hidden_state."""
        return model.model.language_model

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(self.text_model(model).layers)

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        return model.get_input_embeddings()

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def vision_tower(self, model: nn.Module) -> nn.Module:
        """The module ``encode`` calls; its parameters are the vision side of the model."""
        return model.model.visual

    def encoder_root(self, model: nn.Module) -> nn.Module:
        """The module ``encode`` is given: the tower, or (a projector beside the tower) the model
        part that holds both."""
        return self.vision_tower(model)

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """FSDP2 units: each decoder layer and the vision tower (ContextParallelVLM calls the
        tower exactly once per forward on every rank, so its parameter all-gathers match)."""
        return [*self.decoder_layers(model), self.vision_tower(model)]

    def freeze_vision_encoder(self, model: nn.Module) -> None:
        """Freeze the tower except its projector (``projector`` prefixes)."""
        for name, p in self.vision_tower(model).named_parameters():
            if not name.startswith(self.projector):
                p.requires_grad_(False)

    def module_groups(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(label, parameter-name regexes)`` that ``cpvlm verify`` reports; first match wins."""
        return (
            ("vision patch embed", (r"model\.visual\.(patch_embed|pos_embed)\.",)),
            ("vision blocks", (r"model\.visual\.blocks\.",)),
            ("vision merger", (r"model\.visual\.merger\.",)),
            ("token embeddings", (r"model\.language_model\.embed_tokens\.",)),
            ("decoder layers", (r"model\.language_model\.(layers|norm)\.",)),
            ("lm head", (r"lm_head\.",)),
        )

    def install_context_parallel(self, model: nn.Module) -> None:
        """Make the text model's sequence-mixing layers other than attention (which goes through
        transformers' AttentionInterface) follow the ``cpvlm_cp`` context; called once by
        ``ContextParallelVLM``, must be idempotent. Default: nothing (attention-only decoders)."""

    def init_tiny(self, model: nn.Module) -> None:
        """Re-initialise, under the tiny model's seed, what the family initialises so that a test
        would see no gradient (a projector starting at zero). Default: nothing."""

    def float64_islands(self, model: nn.Module) -> None:
        """In a float64 ``model``, compute in float64 the parts transformers computes in float32
        whose round-off a CP run would show (sums it groups differently). ``cpvlm verify`` and the
        tests apply it to both sides of a float64 check, so that float64 round-off is what they
        compare. Default: nothing (a family lists such parts in ``float32_groups`` instead)."""

    # ---- vision ---------------------------------------------------------------------------------

    def encode(
        self, tower: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs
    ) -> VisionRows:
        """Run the tower on pixel rows ``[patches, C]`` of the items of ``grid_thw``; return one row
        per merged token, in item order (and the deepstack levels, for families that have them).
        ``kwargs`` (``vision="split"``): precomputed per-patch inputs and the attention context."""
        return tower(pixel_values, grid_thw=grid_thw, return_dict=True, **kwargs).pooler_output

    def unit_order(self, grid: tuple[int, int, int]) -> UnitOrder:
        """``vision="split"``: the tower's order of a unit's merge groups (default: pixel order)."""
        t, h, w = grid
        return pixel_order(t * h * w // self.merge_size**2)

    def windowed_attention(self, tower: nn.Module) -> list[nn.Module]:
        """``vision="split"``: the attention modules of windowed blocks (default: none)."""
        return []

    def split_tower_kwargs(self, tower: nn.Module, pieces: Sequence[Piece], n: int) -> dict:
        """``vision="split"``: the tower's precomputed inputs for ``n`` local patches, the
        ``pieces`` one after another: rotary positions of exactly those patches (the tower's own
        function on each whole unit's grid, sliced) and one attention call over all of them
        (``cpvlm.integrations.hf.vision_attention``)."""
        from .vision_attention import local_rows, single_call, tower_function

        position_ids = tower_function(tower, "get_vision_position_ids")
        m = tower.spatial_merge_size
        positions = local_rows(pieces, lambda g: position_ids(g, m))
        return {"position_ids": positions, "cu_seqlens": single_call(n, positions.device)}

    def vision_cost(self) -> VisionCost:
        """The per-unit cost model of this family's tower, by which vision units are balanced
        over the CP ranks (VisionDataParallel and a loader that decodes local pixels use it)."""
        return self.cost_model(self.config.vision_config)

    # ---- positions ------------------------------------------------------------------------------

    def rope_index(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        video_extras: dict[str, torch.Tensor],
    ) -> torch.Tensor | None:
        """``[3, B, S]`` M-RoPE positions of one document with vision items, from the model's own
        ``get_rope_index``; None for 1D-RoPE families (the core then uses per-document
        positions)."""
        position_ids, _ = model.model.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            attention_mask=attention_mask,
            **video_extras,
        )
        return position_ids

    @property
    def rope_rows(self) -> int:
        """Rows of the position ids the text model takes: 3 (M-RoPE) or 0 (``[B, S]``, 1D RoPE)."""
        return 3

    # ---- decoder and losses ---------------------------------------------------------------------

    def router_loss(self) -> RouterLoss | None:
        """The MoE load-balancing loss the model adds (None: no router loss, or not enabled)."""
        return None

    def decoder_kwargs(
        self, visual_mask: torch.Tensor, deepstack: Sequence[torch.Tensor]
    ) -> dict[str, Any]:
        """Extra keywords of the text model's forward on a shard: ``visual_mask`` [B, L] marks the
        local visual positions, ``deepstack`` the local deepstack rows in their order."""
        return {"output_router_logits": True} if self.router_loss() is not None else {}

    def decoder_inputs(
        self, model: nn.Module, input_ids: torch.Tensor, visual_mask: torch.Tensor
    ) -> dict[str, Any]:
        """Extra inputs of the text model's forward computed from this rank's ``[B, L]`` ids
        (Gemma 4: its per-layer embeddings). Default: none."""
        return {}

    @property
    def logit_softcap(self) -> float | None:
        """``cap`` of the model's final logit soft-capping ``cap * tanh(logits / cap)``, or None."""
        return None

    def extra_losses(self, decoder_out, ctx: LossContext) -> dict[str, ExtraLoss]:
        """Losses the model adds to the cross-entropy, as this rank's shares: the router's
        load-balancing loss from statistics summed over the CP group (``cpvlm.router_loss``)."""
        spec = self.router_loss()
        if spec is None:
            return {}
        share = load_balancing_loss_share(
            decoder_out.router_logits, ctx.real_mask, top_k=spec.top_k, group=ctx.group
        )
        return {"router_aux": ExtraLoss(share, spec.weight)}
