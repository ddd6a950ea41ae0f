"""A checkpoint's processor as the data path uses it: conversations -> planned samples -> pixels.

Legend: L tokens of a sample; a grid (t, h, w) in patches; m spatial merge size.

``ChatEncoder(model_dir, model_config)`` loads the tokenizer, chat template and image processor
of a checkpoint directory (either layout: ``preprocessor_config.json`` + a template in
``tokenizer_config.json`` / ``chat_template.json``, or transformers 5's ``processor_config.json``
+ ``chat_template.jinja``) and gives the data path its two callables:

- ``plan(record)``: what ``processor.apply_chat_template(messages, tokenize=True)`` returns,
  without pixels: the template rendered, each image/video placeholder expanded by the processor's
  own ``replace_image_token`` / ``replace_video_token`` for grids computed from the image headers
  (the family's ``chat_media``), tokenized; labels on the assistant turns only (or on every
  text token with ``train_on="all"``), image/video/audio tokens never labelled. An audio item
  is decoded here (``cpvlm.data.audio``) and its feature frames made by the checkpoint's feature
  extractor (the family's ``chat_media``): its token count needs its length.
- ``decode(item, temporal)``: the pixel rows of one image (the image processor itself) or of some
  temporal patches of a video (the family's ``chat_media``), checked against the planned grid.

Assistant turns are found without template markers: for the i-th message (an assistant turn)
the conversation up to it is rendered with the generation prompt; what the full rendering adds
after that prefix, up to the end of the rendering of messages[:i+1] (trailing whitespace off),
is the turn. A template for which those renderings are not prefixes of each other is reported.

What differs between families (resize rules, crops or tiles, patch budgets, video pipelines)
is asked of the adapter's ``chat_media`` class (``cpvlm.hf.chat_media``): how the processor is
built, the items' grids, what the replacement code reads, the items in the model's order and the
pixel rows (of an item, or of a piece of it); the rest above is shared.

``AutoProcessor`` needs torchvision for processors with a video processor; where it fails, the
processor class is built around the image processor with a stand-in for the video processor, so
that its token-replacement code still runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from cpvlm.constants import IGNORE_INDEX, TRAIN_ON
from cpvlm.data.audio import audio_ref
from cpvlm.data.errors import DataError
from cpvlm.data.media import image_ref, video_frames
from cpvlm.data.record import Record
from cpvlm.data.sample import SamplePlan, TokenIds, VisionItem, check_tokens, plan_tokenized
from cpvlm.hf.data.expanded_text import ExpandedTokenizer, Rendering
from cpvlm.hf.registry import adapter_for


def adapter_token_ids(model_config) -> TokenIds:
    """The data path's ids and sizes of ``model_config`` from its family's adapter (its token-type
    rule, merge size and item sizes)."""
    adapter = adapter_for(model_config)
    return TokenIds(
        image=adapter.image_token_id,
        video=adapter.video_token_id,
        merge=adapter.merge_size,
        vocab_size=getattr(getattr(model_config, "text_config", model_config), "vocab_size", None),
        pixel_width=adapter.pixel_width,
        types=adapter.mm_token_type_ids,
        sizes=adapter.item_sizes,
        split_frames=adapter.split_frames,
        audio=adapter.audio_token_id,
        audio_rows=adapter.audio_rows if adapter.audio_token_id is not None else None,
    )


MEDIA = ("image", "video", "audio")
"""The kinds of a conversation's media items (content items ``{"type": kind, kind: value}``)."""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_chat_template(model_dir: Path, tokenizer) -> str:
    """The template from ``chat_template.jinja``/``tokenizer_config.json`` (the tokenizer reads
    those), else ``chat_template.json`` or ``processor_config.json``."""
    template = getattr(tokenizer, "chat_template", None)
    for name in ("chat_template.json", "processor_config.json"):
        template = template or _read_json(model_dir / name).get("chat_template")
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"{model_dir}: no chat template (chat_template.jinja, tokenizer_config.json, "
            "chat_template.json or processor_config.json); the data path renders conversations "
            "with the model's own template"
        )
    return template


def _processor_class(model_dir: Path, model_type: str):
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = _read_json(model_dir / "processor_config.json").get("processor_class")
    name = name or _read_json(model_dir / "preprocessor_config.json").get("processor_class")
    name = name or PROCESSOR_MAPPING_NAMES.get(model_type)
    if not name or not hasattr(transformers, name):
        raise ValueError(f"{model_dir}: no processor class known for model_type {model_type!r}")
    return getattr(transformers, name)


def build_processor(
    model_dir: Path, model_type: str, tokenizer, image_processor, template, **kwargs
):
    """The checkpoint's processor class around these parts; ``kwargs``: the rest of its keywords
    (the family's ``chat_media.processor_kwargs``).

    Its ``__init__`` type-checks every part, and the video processor class cannot be built without
    torchvision: given a ``video_processor`` (a stand-in holding what the methods used read), the
    class is built with that check waived.
    """
    cls = _processor_class(model_dir, model_type)
    if "video_processor" in kwargs:
        cls = type(cls.__name__, (cls,), {"check_argument_for_proper_class": lambda *a: None})
    return cls(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=template, **kwargs
    )


def video_config(model_dir: Path) -> dict:
    """The video processor's config file entries (either layout; ``{}`` when none)."""
    config = _read_json(model_dir / "video_preprocessor_config.json")
    return config or _read_json(model_dir / "processor_config.json").get("video_processor", {})


def has_feature_extractor(model_dir: Path) -> bool:
    """Whether the checkpoint has an audio feature extractor (either layout)."""
    nested = "feature_extractor" in _read_json(model_dir / "processor_config.json")
    return nested or "feature_extractor_type" in _read_json(model_dir / "preprocessor_config.json")


def processor_settings(model_dir: Path) -> dict:
    """The processor's own settings in ``processor_config.json`` (``image_seq_length``, ...)."""
    parts = (
        "processor_class",
        "image_processor",
        "video_processor",
        "feature_extractor",
        "chat_template",
    )
    config = _read_json(model_dir / "processor_config.json")
    return {k: v for k, v in config.items() if k not in parts}


def _clean(value):
    """Drop ``None`` entries (Arrow rows carry every struct key; templates test ``'image' in c``)."""
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class ChatEncoder:
    """``plan`` and ``decode`` of the data path for a Hugging Face checkpoint directory."""

    def __init__(
        self,
        model_dir: str | Path,
        model_config,
        *,
        train_on: str = "assistant",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_min_pixels: int | None = None,
        video_max_pixels: int | None = None,
    ):
        from transformers import AutoTokenizer

        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
        self._args = (model_dir, model_config)
        self._kwargs = dict(
            train_on=train_on,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            video_min_pixels=video_min_pixels,
            video_max_pixels=video_max_pixels,
        )
        self.model_dir = Path(model_dir)
        self.train_on = train_on
        self.adapter = adapter_for(model_config)
        self.ids = adapter_token_ids(model_config)
        model_type = model_config.model_type
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self._tokenize = ExpandedTokenizer(self.tokenizer)
        self.image_processor = self.adapter.chat_media.load_image_processor(self.model_dir)
        self.media = self.adapter.chat_media(
            self.adapter,
            self.image_processor,
            video_config(self.model_dir),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            video_min_pixels=video_min_pixels,
            video_max_pixels=video_max_pixels,
        )
        if self.adapter.audio_token_id is not None and has_feature_extractor(self.model_dir):
            from transformers import AutoFeatureExtractor

            self.media.feature_extractor = AutoFeatureExtractor.from_pretrained(
                self.model_dir, local_files_only=True
            )
        template = load_chat_template(self.model_dir, self.tokenizer)
        self.processor = build_processor(
            self.model_dir,
            model_type,
            self.tokenizer,
            self.image_processor,
            template,
            **self.media.processor_kwargs(processor_settings(self.model_dir)),
        )
        self.media.bind(self.processor)
        self.chat_template = template

    @property
    def temporal_patch(self) -> int:
        """Frames per temporal unit of a video (what the loader names a unit's frames by)."""
        return self.media.temporal_patch_size

    def __reduce__(self):
        # Rebuilt from its arguments in a spawned DataLoader worker (the processor class made
        # by build_processor cannot be pickled by name).
        return _rebuild, (self._args, self._kwargs)

    # ---- planning (every rank, every sample) --------------------------------------------------

    def plan(self, record: Record) -> SamplePlan:
        data = record.data
        if not isinstance(data, Mapping):
            raise DataError("bad_record", f"expected a JSON object, got {type(data).__name__}")
        if "input_ids" in data:
            return plan_tokenized(data, self.ids, record.index, record.where)
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise DataError("bad_record", "no 'messages' list (or 'input_ids') in the record")
        messages, items = self._media_items(_clean(messages), data, record.base_dir)
        rendered = self._render(messages)
        full = Rendering(rendered, *self._expand(rendered, items))
        ids, offsets = self._tokenize(
            full, not self._starts_with_bos(full.text), self.train_on == "assistant"
        )
        input_ids = torch.tensor(ids, dtype=torch.long)
        if self.train_on == "assistant":
            spans = self._assistant_spans(messages, items, full)
            labels = self._labels_in_spans(input_ids, offsets, spans)
            if not spans or bool((labels == IGNORE_INDEX).all()):
                raise DataError(
                    "no_assistant_turn", "nothing to learn (no assistant turn with text)"
                )
        else:
            labels = input_ids.clone()
        vision = (input_ids == self.ids.image) | (input_ids == self.ids.video)
        if self.ids.audio is not None:
            vision |= input_ids == self.ids.audio
        images, videos = self.media.model_items(items[0], items[1], rendered)
        plan = SamplePlan(
            record.index,
            record.where,
            input_ids,
            labels.masked_fill(vision, IGNORE_INDEX),
            images=tuple(images),
            videos=tuple(videos),
            audios=tuple(items[2]),
        )
        check_tokens(plan, self.ids)
        return plan

    def _media_items(self, messages, data, base_dir):
        """Messages with every image/video/audio item resolved; ``(images, videos, audios)``,
        the items of each kind in order (with grids; audio with its feature frames)."""
        pools = {kind: list(data.get(kind + "s") or []) for kind in MEDIA}
        images, videos, audios = [], [], []  # image refs (sized together below), items
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message:
                raise DataError("bad_record", f"a message must have a role, got {message!r}")
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for item in content:
                kind = item.get("type") or next((k for k in MEDIA if k in item), None)
                if kind not in MEDIA:
                    continue
                value = item.get(kind)
                if value is None:  # refers to the record's "images" / "videos" list, in order
                    if not pools[kind]:
                        raise DataError("bad_record", f"a {kind} item without a {kind} to use")
                    value = pools[kind].pop(0)
                    item[kind] = "<from column>"
                if kind == "image":
                    images.append(image_ref(value, base_dir))
                elif kind == "video":
                    videos.append(self._video_item(value, item.get("fps"), base_dir))
                else:
                    audios.append(self.media.audio_item(audio_ref(value, base_dir)))
        return messages, (self.media.image_items(images), videos, audios)

    def _video_item(self, value, fps, base_dir) -> VisionItem:
        fps = float(fps) if fps is not None else None
        frames, fps = video_frames(value, base_dir, fps)
        return self.media.video_item(frames, fps)

    def _render(self, messages, *, generation_prompt: bool = False) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        prompts, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=generation_prompt,
            **self.tokenizer.special_tokens_map,
        )
        return prompts[0]

    def _expand(self, text: str, items) -> tuple[str, list[dict]]:
        """The processor's own placeholder expansion, for the planned grids (``items``: the
        images, videos and audio clips); with the offsets of each replacement
        (``get_text_with_replacements``' ``span`` / ``new_span``)."""
        p, m = self.processor, self.media
        images, videos, audios = items
        counts = self._placeholders(text)
        if counts != tuple(len(x) for x in items):
            wrote = ", ".join(f"{n} {k}" for n, k in zip(counts, MEDIA, strict=True))
            have = ", ".join(f"{len(x)} {k}" for x, k in zip(items, MEDIA, strict=True))
            raise DataError(
                "vision_token_mismatch",
                f"the chat template wrote placeholders of {wrote} items for {have}",
            )
        repl = (
            [p.replace_image_token(*m.image_inputs(images, i)) for i in range(len(images))],
            [p.replace_video_token(*m.video_inputs(videos, i)) for i in range(len(videos))],
        )
        if audios:
            repl += (
                [p.replace_audio_token(*m.audio_inputs(audios, i)) for i in range(len(audios))],
            )
        expanded, offsets = p.get_text_with_replacements([text], *repl)
        return expanded[0], (offsets[0] if offsets else [])

    def _placeholders(self, text: str) -> tuple[int, int, int]:
        """The image, video and audio placeholders in ``text``."""
        p = self.processor
        tokens = (p.image_token, getattr(p, "video_token", None), getattr(p, "audio_token", None))
        return tuple(text.count(t) if t else 0 for t in tokens)

    def _expanded_prefix(self, raw: str, items, full: Rendering) -> str:
        """``raw`` (a rendering of a prefix of the conversation, with the first items of each
        kind, ``items``) expanded: cut from the expanded whole where ``raw`` is a prefix of the
        whole's rendering (replacement i depends on item i alone), else expanded on its own
        (which also reports a placeholder count that does not match)."""
        cut = full.expanded_offset(len(raw))
        if (
            cut is not None
            and full.raw.startswith(raw)
            and self._placeholders(raw) == tuple(len(x) for x in items)
        ):
            return full.text[:cut]
        return self._expand(raw, items)[0]

    def _starts_with_bos(self, text: str) -> bool:
        bos = self.tokenizer.bos_token
        return bos is not None and text.startswith(bos)

    def _assistant_spans(self, messages, items, full: Rendering) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in the expanded text ``full.text``."""
        spans = []
        seen = (0, 0, 0)  # items of each kind before this message
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list):
                kinds = [c.get("type") or ("image" if "image" in c else "") for c in content]
                counts = tuple(kinds.count(k) for k in MEDIA)
            else:
                counts = (0, 0, 0)
            after = tuple(a + b for a, b in zip(seen, counts, strict=True))
            if message["role"] == "assistant":
                prefix = self._render(messages[:i], generation_prompt=True)
                # the last turn's conversation is the whole: rendered already
                upto = full.raw if i + 1 == len(messages) else self._render(messages[: i + 1])
                before = tuple(x[:n] for x, n in zip(items, seen, strict=True))
                start = len(self._expanded_prefix(prefix, before, full))
                upto = self._expanded_prefix(
                    upto, tuple(x[:n] for x, n in zip(items, after, strict=True)), full
                )
                end = len(upto.rstrip())
                if not (
                    full.text.startswith(upto)
                    and upto[:start] == full.text[:start]
                    and start <= end
                ):
                    raise DataError(
                        "bad_record",
                        "the chat template does not render the conversation up to an assistant "
                        "turn as a prefix of the whole (cannot find the turn); use --train-on all",
                    )
                spans.append((start, end))
            seen = after
        return spans

    @staticmethod
    def _labels_in_spans(input_ids, offsets, spans) -> torch.Tensor:
        """The ids of the tokens whose characters lie inside a span (and have some), else -100."""
        ab = torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)
        se = torch.tensor(spans, dtype=torch.long).reshape(-1, 2)
        a, b = ab[:, :1], ab[:, 1:]
        inside = ((se[:, 0] <= a) & (b <= se[:, 1])).any(dim=1) & (ab[:, 1] > ab[:, 0])
        return torch.where(inside, input_ids, IGNORE_INDEX)

    # ---- decoding (only the rank that encodes the unit) ---------------------------------------

    def decode(self, item: VisionItem, temporal, groups=None) -> torch.Tensor:
        """Pixel rows of ``item``'s temporal patches ``temporal`` (None: all); of a patch j in
        ``groups`` only the rows of its merge groups ``groups[j]`` (``vision="split"``)."""
        if groups:
            return self.media.piece_rows(item, temporal, groups)
        return self.media.decode(item, temporal)


def _rebuild(args, kwargs) -> ChatEncoder:
    return ChatEncoder(*args, **kwargs)
