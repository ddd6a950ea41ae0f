"""The family adapter: the runtime protocol between cpvlm's CP step and one transformers VLM family.

Legend: B batch, S full length, L local length, D hidden size, R visual rows.

The core knows the CP step: replicated integer inputs and the plan (``prepare_batch``), local
embeddings, vision data parallelism (``VisionDataParallel``, the split tower), the decoder on the
shard, the token-mean loss (``ContextParallelVLM``), FSDP units and freezing (the trainer), and
the data path (``cpvlm.hf.data.processor``, the loader). Everything it asks a family is a
hook declared on ``VLMAdapter`` below, with its contract; nothing else is read from an adapter:

- tokens and batch layout: ``image_token_id``, ``video_token_id``, ``special_token_ids``,
  ``pixel_width``, ``merge_size``, ``mm_token_type_ids`` (0 text, 1 image, 2 video),
  ``item_sizes`` (pixel and output rows of an item of a grid and kind), ``video_keys``, ``model_batch_keys``,
  ``takes_videos``, ``from_model_batch`` / ``to_model_batch`` (the model's own batch <-> the
  core's pixel rows with grids);
- the processor (data path): a ``chat_media`` class (``cpvlm.hf.chat_media``: grids, placeholder
  inputs, pixel rows);
- modules: ``text_model``, ``decoder_layers``, ``embed_tokens``, ``lm_head``, ``vision_tower``
  (the tower's own parameters), ``projector``, ``fsdp_units``, ``freeze_vision_encoder``,
  ``install_context_parallel`` (sequence mixers other than attention);
- vision: ``encode`` (the model's vision side on pixel rows: rows, and deepstack levels),
  ``split_frames``, ``vision_cost``; ``vision="split"``: ``split_vision``, ``unit_order``,
  ``windowed_attention``, ``split_tower_kwargs``;
- positions and masks: ``rope_index`` (M-RoPE from the model's own ``get_rope_index``; None for
  1D RoPE, then per-document positions), ``span_token_types``, ``span_layers``;
- decoder and losses: ``decoder_inputs`` (deepstack rows, per-layer embeddings, router logits),
  ``router_loss``, ``extra_losses``, ``logit_softcap``.

What only tests, ``cpvlm verify`` and synthetic data need (tiny configs, float64 islands, module
groups, zero-gradient parameters, synthetic items and tokens, a tiny processor) is the family's
kit (``cpvlm.hf.kit.FamilyKit``), in the same family file, linked as ``kit``.

The defaults are the base layout: one ``<vision_start> pads <vision_end>`` group per item, a tower
``model.model.visual(pixel_rows, grid_thw)`` with the merger inside that returns
``pooler_output``, t*h*w pixel rows and t*h*w/m**2 tokens per item, M-RoPE from
``model.model.get_rope_index`` when the model has one, no extra keywords or losses. A family
overrides what differs; facts that a config or the model says are read from it, not declared.

Adding a family is one file, one import line and one line in the tests:

1. ``cpvlm/families/<family>.py``::

       class MyKit(FamilyKit):
           tiny_configs = {"<family>-tiny": tiny_<family>_config}  # from the real config class

       @register
       class MyAdapter(VLMAdapter):
           family = "<family>"
           model_classes = ("<Name>ForConditionalGeneration",)
           model_types = ("<model_type>",)
           kit = MyKit
           ...  # the hooks whose default does not hold, and vision_cost

2. ``cpvlm/families/__init__.py``: import the module (that registers it).
3. ``tests/hf/test_<family>.py``: what is particular to the family. The shared exactness,
   checkpoint, training and verify tests take their families from the registry
   (``tests/hf/hf_families.py``) and run on the new tiny model at once; they select families by
   the kit's ``traits``. The families tables (README, docs/adding_a_family.md) get a row
   (tests/test_docs.py fails until they do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from cpvlm.hf.chat_media import ChatMedia
from cpvlm.hf.kit import FamilyKit
from cpvlm.router_loss import load_balancing_loss_share
from cpvlm.vision.cost import VisionCost
from cpvlm.vision.split import Piece, UnitOrder, pixel_order

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
    load-balancing loss from the text config."""

    def router_loss(self) -> RouterLoss | None:
        text = self.config.text_config
        if not text.output_router_logits:
            return None
        return RouterLoss(top_k=text.num_experts_per_tok, weight=text.router_aux_loss_coef)


@dataclass(frozen=True)
class ExtraLoss:
    """One extra loss term, ``weight * share``; the CP ranks' shares sum to the batch's loss."""

    share: torch.Tensor
    weight: float


class VLMAdapter:
    """The runtime protocol of one family; the defaults are the base layout (see the module
    docstring), and a family overrides what differs."""

    # ---- identity -------------------------------------------------------------------------------

    family: ClassVar[str] = ""
    """The family's name (``"<family>"``, the name of its file in ``cpvlm/families/``)."""
    model_classes: ClassVar[tuple[str, ...]] = ()
    """The transformers ``*ForConditionalGeneration`` class names the adapter serves."""
    model_types: ClassVar[tuple[str, ...]] = ()
    """Their ``config.model_type`` values (a config is looked up by it, before a model exists)."""
    kit: ClassVar[type[FamilyKit]] = FamilyKit
    """The family's test- and verify-side knowledge (``cpvlm.hf.kit``); the CP step
    never reads it."""

    def __init__(self, config):
        self.config = config
        self.merge_size = int(config.vision_config.spatial_merge_size)
        """m: an item's h x w patches make h*w/m**2 output rows (its tokens)."""

    # ---- tokens and batch layout (prepare_batch, the data path) ---------------------------------

    video_keys: ClassVar[tuple[str, ...]] = ()
    """Batch keys with one entry per video besides pixels and grid; ``rope_index`` takes them
    (``second_per_grid_ts``)."""
    model_batch_keys: ClassVar[tuple[str, ...]] = ()
    """Keys of the model's own batch that ``from_model_batch`` turns into the core's; the
    forward accepts them."""
    takes_videos: ClassVar[bool] = True
    """The family has videos at all; without, the data path plans and decodes images only."""

    @property
    def image_token_id(self) -> int:
        """The placeholder id of an image's rows (``mm_token_type_ids`` 1)."""
        return self.config.image_token_id

    @property
    def video_token_id(self) -> int:
        """The placeholder id of a video's rows (``mm_token_type_ids`` 2); -1 when the family
        writes none."""
        return self.config.video_token_id

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Every id the layout writes around or for vision items (never drawn as text; a rank
        that joins a failed step fills its stand-in batch with another id)."""
        c = self.config
        return (c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id)

    @property
    def pixel_width(self) -> int:
        """Values in one pixel row of cpvlm's batch (one patch): channels * temporal patch *
        patch * patch."""
        v = self.config.vision_config
        return v.in_channels * v.temporal_patch_size * v.patch_size**2

    def mm_token_type_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[B, S]`` long: 1 at image placeholders, 2 at video placeholders, 0 elsewhere (the
        processor's ``mm_token_type_ids``; padding is 0). prepare_batch checks a given one
        against it, and the data path counts placeholders by it."""
        types = (input_ids == self.image_token_id).long()
        types += 2 * (input_ids == self.video_token_id).long()
        return types if attention_mask is None else types * attention_mask.bool()

    def item_sizes(self, grid: tuple[int, int, int], kind: str) -> tuple[int, int]:
        """``(pixel rows, output rows)`` of an item (or vision unit) of ``grid`` and ``kind``
        (``"image"`` or ``"video"``: which grid tensor it came from) in cpvlm's batch: t*h*w
        patch rows and t*h*w/m**2 merged tokens by default, whatever the kind. prepare_batch, the
        data path and VisionDataParallel size items and units by it."""
        t, h, w = grid
        return t * h * w, t * h * w // self.merge_size**2

    def from_model_batch(self, batch: dict) -> dict:
        """The model's own batch (its processor's keys and pixel layout) in the core's layout:
        pixel rows ``[patches, C]`` with ``image_grid_thw``, ``mm_token_type_ids``. Default: the
        same; also given the core's layout, it returns it unchanged."""
        return batch

    def to_model_batch(self, batch: dict) -> dict:
        """The inverse of ``from_model_batch``: the keywords of the model's own forward for a
        batch in the core's layout (a reference step runs the model on it). Default: the same."""
        return batch

    # ---- the processor (the data path) ----------------------------------------------------------

    chat_media: ClassVar[type[ChatMedia]] = ChatMedia
    """The ``cpvlm.hf.chat_media.ChatMedia`` class of the family's processor: how the data path
    builds it, the items' grids, what its placeholder expansion reads, the items in the model's
    order, and the pixel rows of an item (or of a piece of it). Default: the base layout, with no
    resize rule and no videos."""

    # ---- modules (ContextParallelVLM, parallelize, the trainer) ---------------------------------

    projector: ClassVar[tuple[str, ...]] = ("merger",)
    """Name prefixes, inside ``vision_tower``, of the parameters that stay trainable when the
    vision encoder is frozen (a merger inside the tower); a projector beside the tower stays
    trainable anyway (no override needed)."""

    def text_model(self, model: nn.Module) -> nn.Module:
        """The decoder: ``forward(inputs_embeds=, position_ids=, ...)`` -> last_hidden_state;
        its attention implementation becomes cpvlm's."""
        return model.model.language_model

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers, in order (FSDP units)."""
        return list(self.text_model(model).layers)

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        """The token embedding, as the model applies it (any scaling inside the module)."""
        return model.get_input_embeddings()

    def lm_head(self, model: nn.Module) -> nn.Module:
        """The output projection (``weight`` and ``bias``) the loss applies to hidden states."""
        return model.lm_head

    def vision_tower(self, model: nn.Module) -> nn.Module:
        """The vision encoder itself: the module whose parameters are frozen by
        ``freeze_vision_encoder`` (but ``projector``), sharded as an FSDP unit, and whose dtype
        the pixels take. A projector beside it is not part of it; ``encode`` finds both."""
        return model.model.visual

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """FSDP2 units: each decoder layer and the vision tower (ContextParallelVLM calls the
        tower exactly once per forward on every rank, so its parameter all-gathers match)."""
        return [*self.decoder_layers(model), self.vision_tower(model)]

    def freeze_vision_encoder(self, model: nn.Module) -> None:
        """Freeze the tower except its ``projector`` prefixes."""
        for name, p in self.vision_tower(model).named_parameters():
            if not name.startswith(self.projector):
                p.requires_grad_(False)

    def install_context_parallel(self, model: nn.Module) -> None:
        """Make the text model's sequence-mixing layers other than attention (which goes through
        transformers' AttentionInterface) follow the ``cpvlm_cp`` context; called once by
        ``ContextParallelVLM``, must be idempotent. Default: nothing (attention-only decoders)."""

    # ---- vision (VisionDataParallel, the split tower) -------------------------------------------

    split_frames: ClassVar[bool] = True
    """The tower treats a video's temporal frames independently: each frame is a vision unit."""

    def encode(
        self,
        model: nn.Module,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        kinds: Sequence[str] | None = None,
        **kwargs,
    ) -> VisionRows:
        """Run the model's vision side (the tower and any projector beside it) on pixel rows
        ``[patches, C]`` of the items of ``grid_thw``, of ``kinds`` (one per row, ``"image"`` or
        ``"video"``; None: all images); return one row per output token, in item order (and the
        deepstack levels, for families that have them). ``kwargs`` (``vision="split"``, whose
        towers treat images and frames alike, so no kinds): precomputed per-patch inputs and the
        attention context."""
        tower = self.vision_tower(model)
        return tower(pixel_values, grid_thw=grid_thw, return_dict=True, **kwargs).pooler_output

    def vision_cost(self) -> VisionCost:
        """The per-unit cost model of the tower, by which vision units are balanced over the CP
        ranks (VisionDataParallel and a loader that decodes local pixels use it). Default: the
        patch count."""
        return VisionCost.patches()

    split_vision: ClassVar[bool] = False
    """The tower can run sequence-parallel on a unit's patches (``vision="split"``): it takes
    every per-patch input precomputed (``split_tower_kwargs``) and attends through its attention
    function with ``cu_seqlens``; its items have the default ``item_sizes``."""

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
        (``cpvlm.hf.vision_attention``)."""
        from cpvlm.hf.vision_attention import local_rows, single_call, tower_function

        position_ids = tower_function(tower, "get_vision_position_ids")
        m = tower.spatial_merge_size
        positions = local_rows(pieces, lambda g: position_ids(g, m))
        return {"position_ids": positions, "cu_seqlens": single_call(n, positions.device)}

    # ---- positions and masks (prepare_batch, the attention) -------------------------------------

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
        """``[3, B, S]`` M-RoPE positions of one document, from the model's own
        ``get_rope_index`` (a document without vision items: ``arange`` in every row); None for a
        model without one (1D RoPE: the core then uses per-document positions ``[B, S]``)."""
        get_rope_index = getattr(model.model, "get_rope_index", None)
        if get_rope_index is None:
            return None
        if image_grid_thw is None and video_grid_thw is None:
            arange = torch.arange(input_ids.shape[1], device=input_ids.device)
            return arange.expand(3, input_ids.shape[0], -1).clone()
        position_ids, _ = get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            attention_mask=attention_mask,
            **video_extras,
        )
        return position_ids

    span_token_types: ClassVar[tuple[int, ...]] = ()
    """Token types (``mm_token_type_ids``) whose runs attend to each other bidirectionally (one
    mask span per run and document); () for causal-only models."""
    span_layers: ClassVar[str] = "all"
    """Where the spans apply: ``"all"`` layers or the ``"sliding"`` (windowed) ones only."""

    # ---- decoder and losses (ContextParallelVLM) ------------------------------------------------

    def decoder_inputs(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        visual_mask: torch.Tensor,
        deepstack: Sequence[torch.Tensor],
    ) -> dict[str, Any]:
        """Extra keywords of the text model's forward on a shard, from this rank's ``[B, L]``
        ids, its visual positions ``visual_mask`` [B, L] and its deepstack rows in their order
        (deepstack levels, per-layer embeddings, router logits). Default: the router logits when
        the model has a router loss."""
        return {"output_router_logits": True} if self.router_loss() is not None else {}

    def router_loss(self) -> RouterLoss | None:
        """The MoE load-balancing loss the model adds (None: no router loss, or not enabled)."""
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

    @property
    def logit_softcap(self) -> float | None:
        """``cap`` of the model's final logit soft-capping ``cap * tanh(logits / cap)``, or None."""
        return None
