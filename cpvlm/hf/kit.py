"""The family kit: what tests, ``cpvlm verify`` and synthetic data know of a family.

The CP step never reads a kit; it reads the adapter (``cpvlm.hf.adapter``). A kit
holds the knowledge that serves checks and tiny models: tiny configs and how to initialise them,
where a float64 model still computes in float32 and how to compute those parts in float64, the
module groups a check reports, the gradients that are zero in exact arithmetic, the items and
tokens a synthetic sample of the family has, and a tiny processor for a checkpoint directory.
Each family defines its kit in its own file (``class <Family>Kit(FamilyKit)``) and links it
from its adapter (``kit = <Family>Kit``); ``cpvlm.hf.registry.kit_for(model_or_config)``
gives the kit of a model.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from cpvlm.hf.float64 import KeepFloat64

TRAITS = {
    "tiled": "square tiles or crops of an image through a ViT, image tokens only, 1D RoPE",
    "deepstack": "the tower returns deepstack levels that the decoder adds after its layers",
    "frame_timestamps": "each video frame its own vision group after a timestamp (Qwen3-VL's)",
    "linear_attention": "decoder layers other than attention (a recurrence over the sequence)",
    "frames_as_images": "video frames are image tokens inside video markers, one tower call each",
    "image_spans": "images attended bidirectionally and sliding windows; the model's own images",
    "own_layout": "pixel rows with its own image tokens and grids, 1D positions, images only",
}
"""What the shared tests select families by (``FamilyKit.traits``)."""


@dataclass(frozen=True)
class TinyProcessor:
    """What a tiny checkpoint directory of the family holds besides the model
    (``cpvlm.hf.tiny_checkpoint.make_tiny_checkpoint``)."""

    special_tokens: tuple[str, ...]  # the tokenizer's special tokens, in id order
    tokenizer_kwargs: dict[str, Any]  # PreTrainedTokenizerFast keywords (eos, pad, ...)
    chat_template: str
    processor_class: str  # the transformers processor class name
    config_ids: Callable[[Any], dict]  # tokenizer -> the tiny config's token-id overrides
    image_processor: Callable[[Any], Any]  # model config -> the image processor
    video_processor: Callable[[Any], dict] | None = None  # model config -> its config (or none)
    feature_extractor: Callable[[Any], Any] | None = None
    """Model config -> the audio feature extractor (None: the processor takes no audio)."""
    processor_settings: Callable[[Any], dict] = field(default=lambda config: {})
    """Extra entries of ``processor_config.json`` from the model config."""
    end_of_turn: str | None = None
    """The text that closes an assistant turn in the template (labelled with the answer; None: the
    eos token). The data-path tests check labels by it."""
    frame_size: tuple[int, int] | None = None
    """``(H, W)``: a video frame size that the tiny processor's video path and its image processor
    take alike (no resize on either side, a frame's rows the leading rows of the picture's as an
    image); the data-path tests check videos on frames of it. None: no such size (no videos, or
    frames paired into temporal patches)."""


class FamilyKit:
    """The test- and verify-side knowledge of one family (defaults: nothing particular)."""

    tiny_configs: ClassVar[dict[str, Callable[..., Any]]] = {}
    """``{"<name>-tiny": config builder}``: tiny configs built from the real config classes."""
    default_model: ClassVar[bool] = False
    """The first of ``tiny_configs`` is cpvlm's default model (``cpvlm train``, ``cpvlm verify``);
    exactly one family's kit declares it (``registry.default_model``; subclasses do not inherit it)."""
    shared_tests: ClassVar[bool] = True
    """The shared HF tests run on the tiny models (else only the family's own tests do)."""
    traits: ClassVar[frozenset[str]] = frozenset()
    """What the shared tests select the family by: names from ``TRAITS``."""
    float64_load_kwargs: ClassVar[dict[str, str]] = {}
    """Loading keywords a float64 model needs (MoE: eager experts; grouped_mm rejects float64)."""
    float32_groups: ClassVar[tuple[str, ...]] = ()
    """Module groups (``module_groups`` labels) whose gradients the model computes in float32 even
    in a float64 model; float64 checks of the unchanged model hold them to float32 round-off.
    ``("*",)``: every group and the loss (a float32 part in the forward, such as a router)."""
    zero_gradients: ClassVar[tuple[str, ...]] = ()
    """Parameter-name regexes whose gradient is zero in exact arithmetic and round-off in floats
    (a key bias: it adds q.b to every logit of a query, which softmax cancels). A relative
    error of round-off means nothing: checks hold them to their module group's gradient scale."""
    unused_parameters: ClassVar[str | None] = None
    """A regex of the parameters the forward never uses (zero gradient in every run)."""
    mixes_images_and_videos: ClassVar[bool] = True
    """The model's own forward takes images and videos in one call (a reference can use it)."""
    published_configs: ClassVar[dict[str, Callable[[], Any]]] = {}
    """``{name: config builder}`` of published checkpoints: the model's config class with the
    dimensions of the checkpoint's config.json (written out, nothing is fetched), for ``cpvlm
    plan --model <name>`` and the scale benchmark. Declared on the kit class itself (not
    inherited by a kit that subclasses it)."""
    published_towers: ClassVar[dict[str, dict]] = {}
    """``{checkpoint: vision_config fields the cost model reads}`` of published checkpoints (their
    config.json), for cost-model tests and benchmarks: ``AutoConfig.for_model(model_types[0],
    vision_config=...)`` builds one."""
    tiny_processor: ClassVar[TinyProcessor | None] = None
    """The processor files of a tiny checkpoint directory (None: the family has none)."""
    audio_clips: ClassVar[tuple[int, ...]] = ()
    """Feature frames of the audio clips checks put in their batches (families with an audio
    encoder): lengths that cross the encoder's chunks and windows."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.config = adapter.config

    def module_groups(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(label, parameter-name regexes)`` that ``cpvlm verify`` reports; first match wins.
        Default: the base layout's modules (a tower with its merger inside) at the adapter's
        ``modules`` paths."""
        tower, text, head = _paths(self.adapter, "vision_tower", "text_model", "lm_head")
        return (
            ("vision patch embed", (rf"{tower}\.(patch_embed|pos_embed)\.",)),
            ("vision blocks", (rf"{tower}\.blocks\.",)),
            ("vision merger", (rf"{tower}\.merger\.",)),
            ("token embeddings", (rf"{text}\.embed_tokens\.",)),
            ("decoder layers", (rf"{text}\.(layers|norm)\.",)),
            ("lm head", (rf"{head}\.",)),
        )

    def init_tiny(self, model: nn.Module) -> None:
        """Re-initialise, under the tiny model's seed, what the family initialises so that a test
        would see no gradient (a projector starting at zero). Default: nothing."""

    float32_islands: tuple[str, ...] = ()
    """Names of transformers classes whose forward computes in float32 whatever the model's
    dtype, where a CP run would show the round-off (sums it groups differently): the family's
    entries of docs/hf_internals.md, "Where transformers rounds"."""

    def float64_islands(self, model: nn.Module) -> None:
        """In a float64 ``model``, run ``float32_islands`` with their float32 casts kept in
        float64 (``with_float64_forward``). ``cpvlm verify`` and the tests apply it to both sides
        of a float64 check."""
        with_float64_forward(model, self.float32_islands)

    def synthetic_items(
        self, kind: str, grid: tuple[int, int, int], *, images_in_sample: int = 1
    ) -> list[tuple[str, tuple[int, int, int]]]:
        """The items (kind, grid) the family's processor makes of an image of ``grid`` (1, h, w)
        or a video of (t, h, w) patches in a sample of ``images_in_sample`` images, for synthetic
        batches. Default: that item."""
        return [(kind, grid)]

    def item_tokens(
        self, kind: str, grid: tuple[int, int, int], text: Callable[[int], list[int]]
    ) -> list[int]:
        """The token ids the processor writes for one item of ``grid`` in cpvlm's batch (an item
        of ``synthetic_items``); ``text(n)`` gives n text tokens where the layout has text
        (timestamps). Default: the base layout, ``<vision_start> pads <vision_end>``."""
        t, h, w = grid
        c = self.config
        pad = c.image_token_id if kind == "image" else c.video_token_id
        frame = h * w // self.adapter.merge_size**2
        return [c.vision_start_token_id] + [pad] * (t * frame) + [c.vision_end_token_id]


def with_float64_forward(model: nn.Module, class_names: Iterable[str]) -> None:
    """Run the forward of every module of ``model`` whose class, or a base of it, has one of
    ``class_names`` under ``KeepFloat64`` (its float32 casts kept in float64): how
    ``float64_islands`` computes transformers' float32 parts in float64 with transformers' own
    code. Names, not classes, so that a copy or a reload of a transformers module matches too.
    The forward is looked up on the module's class at each call (a class swapped later, by
    ``install_context_parallel`` or FSDP2, is the one that runs). A CP forward (called with
    ``cpvlm_cp``) runs as it is: it must compute a float64 model in float64 by itself, and a check
    would not see it if the mode did it instead."""
    names = frozenset(class_names)

    def forward(self, *args, **kwargs):
        if kwargs.get("cpvlm_cp") is not None:
            return type(self).forward(self, *args, **kwargs)
        with KeepFloat64():
            return type(self).forward(self, *args, **kwargs)

    for module in model.modules():
        if names & {c.__name__ for c in type(module).__mro__}:
            module.forward = types.MethodType(forward, module)


def _paths(adapter, *names: str) -> list[str]:
    """The adapter's ``modules`` paths of ``names``, as regexes of parameter-name prefixes."""
    return [re.escape(getattr(adapter.modules, name)) for name in names]


class MoeKit:
    """Mixin of the MoE families' kits (listed before the family's kit in the bases): eager
    experts in float64, the router and expert parameters as their own module groups."""

    float64_load_kwargs = {"experts_implementation": "eager"}
    experts_pattern = r"experts\."  # the expert parameters of a layer's mlp

    def module_groups(self):
        text, layers = _paths(self.adapter, "text_model", "decoder_layers")
        layer = rf"{text}\.{layers}\.\d+\.mlp\."
        groups = list(super().module_groups())
        i = [label for label, _ in groups].index("decoder layers")
        groups[i:i] = [
            ("router", (layer + r"gate\.",)),
            ("experts", (layer + self.experts_pattern,)),
        ]
        return tuple(groups)
