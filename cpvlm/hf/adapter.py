"""The family adapter: the runtime protocol between cpvlm's CP step and one transformers VLM family.

Legend: B batch, S full length, L local length, D hidden size, R visual rows.

The core knows the CP step: replicated integer inputs and the plan (``prepare_batch``), local
embeddings, vision data parallelism (``EncoderDataParallel``, the split tower), the decoder on the
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
- modules: ``modules``, a ``ModulePaths`` (where the text model, its layers, the embedding, the
  head, the tower, the projector prefixes and the FSDP units are: data, read by the accessors
  ``text_model``, ``decoder_layers``, ``embed_tokens``, ``lm_head``, ``vision_tower``,
  ``fsdp_units``, which no family overrides), ``install_context_parallel`` (sequence mixers other
  than attention);
- vision: ``encode`` (the model's vision side on pixel rows: rows, and deepstack levels),
  ``split_frames``, ``vision_cost``; ``vision="split"``: ``split_vision``, ``unit_order``,
  ``windowed_attention``, ``split_tower_kwargs``;
- positions and masks: ``span_token_types``, ``span_layers`` (M-RoPE positions come from the
  model's own ``get_rope_index`` at ``modules.rope_index``, called with ``rope_index_kwargs``;
  1D RoPE where it has none);
- audio (families with an audio encoder; each clip a unit of its own ``EncoderDataParallel``):
  ``audio_token_id`` (None: no audio), ``audio_feature_width``, ``audio_rows``,
  ``encode_audio``, ``audio_cost``, ``audio_dummy_frames``, and the tower at
  ``modules.audio_tower``;
- decoder and losses: ``decoder_inputs`` (deepstack rows, per-layer embeddings, router logits),
  ``router_loss`` (the core adds its share, ``cpvlm.router_loss``), ``logit_softcap``.

What only tests, ``cpvlm verify`` and synthetic data need (tiny configs, float64 islands, module
groups, zero-gradient parameters, synthetic items and tokens, a tiny processor) is the family's
kit (``cpvlm.hf.kit.FamilyKit``), in the same family file, linked as ``kit``.

The defaults are the base layout: one ``<vision_start> pads <vision_end>`` group per item, a tower
``model.model.visual(pixel_rows, grid_thw)`` with the merger inside that returns
``pooler_output``, t*h*w pixel rows and t*h*w/m**2 tokens per item, M-RoPE from
``model.model.get_rope_index`` when the model has one, no extra keywords or losses
(``ModulePaths()``'s defaults say where those modules are). A family overrides what differs and
declares its module paths as data; facts that a config or the model says are read from it, not
declared.

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
           modules = ModulePaths(vision_tower="model.vision_tower")  # the paths that differ
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
from torch import nn

from cpvlm.encoders.cost import EncoderCost
from cpvlm.encoders.split import Piece, UnitOrder, pixel_order
from cpvlm.hf.chat_media import ChatMedia
from cpvlm.hf.kit import FamilyKit

VisionRows = torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]
"""What ``encode`` returns: ``[R, D]`` rows, or ``([R, D], [[R, D_l], ...])`` with deepstack
levels."""


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
class ModulePaths:
    """Where a family's modules are in its ``*ForConditionalGeneration`` model: dotted attribute
    paths from the model (``module_at``), unless said otherwise. The defaults are the base layout.
    A family declares ``modules = ModulePaths(...)`` with the paths that differ."""

    text_model: str = "model.language_model"
    """The decoder: ``forward(inputs_embeds=, position_ids=, ...)`` -> last_hidden_state; its
    attention implementation becomes cpvlm's."""
    decoder_layers: str = "layers"
    """The decoder layers, in order, inside ``text_model`` (FSDP units)."""
    embed_tokens: str | None = None
    """The token embedding as the model applies it (any scaling inside the module); None: the
    model's ``get_input_embeddings()``."""
    lm_head: str = "lm_head"
    """The output projection (``weight`` and ``bias``) the loss applies to hidden states."""
    vision_tower: str = "model.visual"
    """The vision encoder itself: frozen by ``freeze_vision_encoder`` (but ``projector``), an
    FSDP unit, and the dtype the pixels take. A projector beside it is not part of it; the
    adapter's ``encode`` finds both."""
    projector: tuple[str, ...] = ("merger",)
    """Name prefixes, inside ``vision_tower``, of the parameters that stay trainable when the
    vision encoder is frozen (a merger inside the tower); a projector beside the tower stays
    trainable anyway."""
    tower_units: tuple[str, ...] = ("",)
    """FSDP units of the vision side, as paths inside ``vision_tower`` (``""``: the tower itself,
    which ContextParallelVLM calls exactly once per forward on every rank, so its parameter
    all-gathers match; a module list: each of its modules)."""
    extra_units: tuple[str, ...] = ()
    """Further FSDP units beside the decoder layers and the tower (a projector beside it)."""
    rope_index: str = "model.get_rope_index"
    """The model's own M-RoPE position function (``get_rope_index``); a model without it has 1D
    RoPE (the core then uses per-document positions)."""
    audio_tower: str | None = None
    """The audio encoder (an FSDP unit, called once per forward on every rank like the vision
    tower); None: the family has none. A projector beside it is not part of it."""


_MISSING = object()


def module_at(root: Any, path: str, default: Any = _MISSING) -> Any:
    """The attribute at the dotted ``path`` of ``root`` (``""``: ``root`` itself; a module list's
    items by index, ``"layers.0"``); ``default`` if given and a name on the way is missing."""
    obj = root
    for name in path.split(".") if path else ():
        nxt = getattr(obj, name, _MISSING)
        if nxt is _MISSING:
            if default is not _MISSING:
                return default
            raise AttributeError(
                f"{type(root).__name__} has no {path!r} ({type(obj).__name__} has no {name!r}); "
                "the family's adapter declares where its modules are: modules = ModulePaths(...)"
            )
        obj = nxt
    return obj


_NOT_HOOKS = (
    "text_model",
    "decoder_layers",
    "embed_tokens",
    "lm_head",
    "vision_tower",
    "audio_tower",
    "fsdp_units",
    "projector",
    "freeze_vision_encoder",
    "rope_index",
    "extra_losses",
    "image_token_id",
    "processor_image_grid",
    "processor_image_inputs",
    "video_processing",
)
"""Names an adapter does not define: the module accessors read ``modules``, and the rest are
hooks that were removed (see docs/changelog.md)."""


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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        defined = [n for n in _NOT_HOOKS if n in vars(cls)]
        if defined:
            raise TypeError(
                f"{cls.__name__} defines {', '.join(defined)}: module locations are data "
                "(modules = ModulePaths(...)); the processor is the chat_media class; "
                "image_token_id, rope_index, extra_losses and freeze_vision_encoder are no hooks "
                "(docs/changelog.md)"
            )

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
        """The placeholder id of an image's rows (``mm_token_type_ids`` 1): the config's, never
        overridden (the data path reads it here)."""
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
        """``[B, S]`` long: 1 at image placeholders, 2 at video placeholders, 3 at audio
        placeholders, 0 elsewhere (the processor's ``mm_token_type_ids``; padding is 0).
        prepare_batch checks a given one against it, and the data path counts placeholders by
        it."""
        types = (input_ids == self.image_token_id).long()
        types += 2 * (input_ids == self.video_token_id).long()
        if self.audio_token_id is not None:
            types += 3 * (input_ids == self.audio_token_id).long()
        return types if attention_mask is None else types * attention_mask.bool()

    def item_sizes(self, grid: tuple[int, int, int], kind: str) -> tuple[int, int]:
        """``(pixel rows, output rows)`` of an item (or vision unit) of ``grid`` and ``kind``
        (``"image"`` or ``"video"``: which grid tensor it came from) in cpvlm's batch: t*h*w
        patch rows and t*h*w/m**2 merged tokens by default, whatever the kind. prepare_batch, the
        data path and EncoderDataParallel size items and units by it."""
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

    modules: ClassVar[ModulePaths] = ModulePaths()
    """Where the model's modules are: data, read by the accessors below (which no family
    overrides)."""

    def text_model(self, model: nn.Module) -> nn.Module:
        """The decoder (``modules.text_model``)."""
        return module_at(model, self.modules.text_model)

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers, in order (``modules.decoder_layers`` inside the text model)."""
        return list(module_at(self.text_model(model), self.modules.decoder_layers))

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        """The token embedding (``modules.embed_tokens``, or the model's input embeddings)."""
        if self.modules.embed_tokens is None:
            return model.get_input_embeddings()
        return module_at(model, self.modules.embed_tokens)

    def lm_head(self, model: nn.Module) -> nn.Module:
        """The output projection (``modules.lm_head``)."""
        return module_at(model, self.modules.lm_head)

    def vision_tower(self, model: nn.Module) -> nn.Module:
        """The vision encoder itself (``modules.vision_tower``)."""
        return module_at(model, self.modules.vision_tower)

    def audio_tower(self, model: nn.Module) -> nn.Module | None:
        """The audio encoder (``modules.audio_tower``), or None where the model has none."""
        if self.modules.audio_tower is None or self.audio_token_id is None:
            return None
        return module_at(model, self.modules.audio_tower, default=None)

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """FSDP2 units: each decoder layer, the tower's ``modules.tower_units``, the audio tower
        and the ``modules.extra_units`` (a module list gives each of its modules)."""
        tower = self.vision_tower(model)
        units = [module_at(tower, p) for p in self.modules.tower_units]
        audio = self.audio_tower(model)
        units += [] if audio is None else [audio]
        units += [module_at(model, p) for p in self.modules.extra_units]
        flat = [u for unit in units for u in (unit if isinstance(unit, nn.ModuleList) else [unit])]
        return [*self.decoder_layers(model), *flat]

    tp_plan: ClassVar[dict[str, str] | None] = None
    """A ``base_model_tp_plan`` of the family's own for ``--tp`` (``cpvlm.hf.tensor_plan``),
    where the text config's does not split the decoder layers (transformers 5.25's Qwen3-VL plans
    only its embedding). Read from the class that declares it only: a subclass family with other
    layers (MoE, linear attention) declares its own or none. None: the text config's."""

    def install_context_parallel(self, model: nn.Module) -> None:
        """Make the text model's sequence-mixing layers other than attention (which goes through
        transformers' AttentionInterface) follow the ``cpvlm_cp`` context; called once by
        ``ContextParallelVLM``, must be idempotent. Default: nothing (attention-only decoders)."""

    # ---- vision (EncoderDataParallel, the split tower) -------------------------------------------

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

    def vision_cost(self) -> EncoderCost:
        """The per-unit cost model of the tower, by which vision units are balanced over the CP
        ranks (EncoderDataParallel and a loader that decodes local pixels use it). Default: the
        patch count."""
        return EncoderCost.patches()

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

    # ---- audio (the audio EncoderDataParallel; families with an audio encoder) ------------------

    @property
    def audio_token_id(self) -> int | None:
        """The placeholder id of an audio clip's rows (``mm_token_type_ids`` 3); None: the family,
        or this model's config, has no audio encoder (the default)."""
        return None

    @property
    def audio_feature_width(self) -> int:
        """Values in one feature frame of ``audio_features`` (mel bins)."""
        raise NotImplementedError(f"{self.family} has no audio encoder")

    def audio_rows(self, frames: int) -> int:
        """Output rows (placeholders) of a clip of ``frames`` feature frames: the encoder's own
        length rule."""
        raise NotImplementedError(f"{self.family} has no audio encoder")

    audio_dummy_frames: ClassVar[int] = 1
    """Feature frames of the clip a rank with no audio encodes (and keeps none of), so that every
    rank calls the audio tower once per forward."""

    def encode_audio(
        self,
        model: nn.Module,
        features: torch.Tensor,
        lengths: torch.Tensor,
        batch_lengths: tuple[int, ...],
    ) -> torch.Tensor:
        """Run the model's audio side (encoder and any projector) on ``features`` [frames, F],
        the clips of ``lengths`` one after another; return ``[A, D]``, ``audio_rows`` rows per
        clip, in clip order. A clip's rows must be those the model computes for it in the forward
        batch, whose clips' frames are ``batch_lengths`` (an encoder that pads its clips to the
        batch's longest reproduces that padding), and depend on no other clip's features."""
        raise NotImplementedError(f"{self.family} has no audio encoder")

    def audio_cost(self) -> EncoderCost:
        """The per-clip cost model of the audio encoder (a clip is grid (1, 1, frames)); default:
        its frames."""
        return EncoderCost.patches()

    # ---- positions and masks (prepare_batch, the attention) -------------------------------------

    def rope_index_kwargs(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keywords of the model's ``get_rope_index`` (at ``modules.rope_index``) besides
        ``input_ids`` [B, S], from the core's: ``mm_token_type_ids``, ``image_grid_thw``,
        ``video_grid_thw``, ``attention_mask`` (None: no padding), the ``video_keys`` and, where
        the document has audio, ``audio_lengths`` (each clip's feature frames).
        Default: those, as they are (the base layout's signature)."""
        return kwargs

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

    @property
    def logit_softcap(self) -> float | None:
        """``cap`` of the model's final logit soft-capping ``cap * tanh(logits / cap)``, or None."""
        return None
