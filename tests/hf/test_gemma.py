"""Gemma 3 and Gemma 4: their tiny models, their own batch layout, and the masks that matter.

The shared family tests (hf_families.FAMILIES) hold both to the model's own forward and backward
at 1e-10 in float64. Here: the tiny models have what those tests must see (sliding and full
layers, a window shorter than an image and than the rows, GQA, a projector that passes gradients
to the tower); the spans the core derives equal transformers' own image blocks; and each part of
the mask is needed: the CP loss with the window dropped, or the image spans dropped, or (Gemma 4)
the spans put on every layer, misses the model's loss by far more than the 1e-10 of the real
mask, so the exactness tests would catch a bridge that got any of them wrong.
The data path: Gemma 3's processor batches, and Gemma 4's video ids against its processor.
"""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import GEMMA, cached_model  # noqa: E402

from cpvlm.hf import (  # noqa: E402
    ContextParallelVLM,
    adapter_for,
    build_model,
    prepare_batch,
)
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    mixed_batch,
    packed_documents,
    reference_loss_and_grads,
    rel_err,
    run_distributed,
)

NAMES = sorted(GEMMA)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_has_both_layer_kinds_a_short_window_and_gqa(name):
    model = cached_model(name)
    text = model.config.text_config
    kinds = set(text.layer_types)
    assert kinds == {"sliding_attention", "full_attention"}
    batch = mixed_batch(model, torch.float64)
    longest_span = max(b - a for a, b in prepare_batch(model, batch, 1).spans[0])
    assert text.sliding_window < longest_span < batch["attention_mask"].sum(-1).min()
    assert text.num_attention_heads == 2 * text.num_key_value_heads
    windows = {layer.self_attn.sliding_window for layer in model.model.language_model.layers}
    assert windows == {None, text.sliding_window}
    assert sum(p.numel() for p in model.parameters()) < 400_000
    # The projector starts random (transformers starts it at zero: no tower gradient at all).
    projector = dict(model.named_parameters())
    key = next(n for n in projector if "mm_input_projection" in n or "embed_vision" in n)
    assert projector[key].abs().max() > 0
    model32 = cached_model(name, torch.float32)
    for (n, p64), (_, p32) in zip(model.named_parameters(), model32.named_parameters()):
        assert torch.equal(p64, p32.double()), n


@pytest.mark.parametrize("name", NAMES)
def test_the_models_own_batch_converts_both_ways(name):
    """``to_model_batch`` gives what the model's forward takes (Gemma 3: [N, 3, H, W] images
    and token_type_ids; Gemma 4: padded patch sequences with positions), ``from_model_batch``
    gives the core's pixel rows and grids back exactly, and the core accepts either."""
    model = cached_model(name)
    adapter = adapter_for(model)
    batch = mixed_batch(model, torch.float64)
    native = adapter.to_model_batch(batch)
    assert "image_grid_thw" not in native
    if name == "gemma3-tiny":
        vc = model.config.vision_config
        assert native["pixel_values"].shape == (2, 3, vc.image_size, vc.image_size)
        assert torch.equal(native["token_type_ids"], batch["mm_token_type_ids"])
    else:
        assert native["pixel_values"].dim() == 3 and "image_position_ids" in native
        assert native["num_frames_per_video"].tolist() == [2]
    back = adapter.from_model_batch(native)
    for key, value in batch.items():
        assert torch.equal(back[key], value), key
    a, b = prepare_batch(model, batch, 2), prepare_batch(model, native, 2)
    assert torch.equal(a.grid_thw, b.grid_thw) and a.spans == b.spans
    assert torch.equal(a.pixel_values(torch.float64), b.pixel_values(torch.float64))


@pytest.mark.parametrize("name", NAMES)
def test_spans_are_transformers_image_blocks_in_padded_positions(name):
    """Each span is one block of transformers' own ``get_block_sequence_ids_for_mask`` (a run of
    image tokens; Gemma 4: image or video tokens), in the plan's padded positions, per document
    of a packed row (cp 3 pads every document)."""
    import importlib

    model = cached_model(name)
    family = "gemma3" if name == "gemma3-tiny" else "gemma4"
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    _, parts, doc_lens = packed_documents(model, torch.float64)
    packed = packed_documents(model, torch.float64)[0]
    prep = prepare_batch(model, packed, 3, doc_lens=doc_lens)
    expected, start = [], 0
    for part in parts:
        blocks = modeling.get_block_sequence_ids_for_mask(part["mm_token_type_ids"], device="cpu")
        for block in blocks[0].unique():
            if block >= 0:
                pos = torch.nonzero(blocks[0] == block).squeeze(1) + start
                padded = prep.plan.padded_index[pos]
                assert torch.equal(padded, torch.arange(padded[0], padded[-1] + 1))
                expected.append((int(padded[0]), int(padded[-1]) + 1))
        start += part["input_ids"].shape[1]
    assert len(expected) >= 4 and prep.spans == (tuple(expected),)


# ---- each part of the mask matters --------------------------------------------------------


def _changed(variant, ctx_spans_layers):
    """A bridge that builds the masks wrongly: ``variant`` drops the window or the spans, or puts
    the spans on every layer."""
    import cpvlm.hf.attention as bridge

    real = bridge._masks

    def masks(module, window, ctx, batch):
        if variant == "spans on every layer":
            ctx = dataclasses.replace(ctx, span_layers="all")
        out = real(module, window, ctx, batch)
        if variant == "no window":
            out = [(rows, dataclasses.replace(m, window=None)) for rows, m in out]
        elif variant == "no spans":
            out = [(rows, dataclasses.replace(m, spans=())) for rows, m in out]
        return out

    return bridge, real, masks


def _cp_losses(rank, world_size, name, variants):
    base = cached_model(name)
    batch = mixed_batch(base, torch.float64)
    losses = []
    for variant in variants:
        bridge, real, masks = _changed(variant, None)
        bridge._masks = masks
        try:
            cp = ContextParallelVLM(
                copy.deepcopy(base), dist.group.WORLD, options=CPOptions(attn="ring")
            )
            with torch.no_grad():
                loss = cp(**batch).loss
        finally:
            bridge._masks = real
        dist.all_reduce(loss)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_the_window_and_the_image_spans_both_change_the_loss(name):
    model = cached_model(name)
    ref, _ = reference_loss_and_grads(model, mixed_batch(model, torch.float64))
    variants = ["real", "no window", "no spans"]
    if name == "gemma4-tiny":
        variants.append("spans on every layer")
    losses = run_distributed(_cp_losses, 2, name, variants)[0]
    errors = dict(
        zip(
            variants,
            (rel_err(torch.tensor(v, dtype=torch.float64), ref) for v in losses),
            strict=True,
        )
    )
    assert errors["real"] <= 1e-10, errors
    # Each wrong mask misses by orders of magnitude more than the exactness tolerance (measured:
    # 1e-3 .. 1e-2 relative on these tiny models).
    for variant in variants[1:]:
        assert errors[variant] > 1e-6, (variant, errors)


def test_data_path_gives_gemma3_processor_batches(tmp_path):
    """The data path on a Gemma 3 checkpoint (tokenizer, chat template, the PIL image processor):
    the same ids as ``Gemma3Processor.apply_chat_template(tokenize=True)`` (``\\n\\n<boi>``, 16
    image tokens, ``<eoi>\\n\\n`` per image), and each image's pixel rows are the processor's
    ``[N, 3, H, W]`` pixels in the core's layout; the core takes the processor's batch as it is."""
    from transformers import AutoConfig, AutoProcessor

    from cpvlm.data.record import Record
    from cpvlm.hf.data.processor import ChatEncoder
    from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint, write_images

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "gemma3")
    names = write_images(tmp_path, [(30, 50), (70, 20)])
    content = [
        {"type": "image", "image": str(tmp_path / names[0])},
        {"type": "text", "text": "Describe the image."},
        {"type": "image", "image": str(tmp_path / names[1])},
    ]
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "two cats"}]},
    ]
    processor = AutoProcessor.from_pretrained(ckpt, local_files_only=True)
    out = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt"
    )
    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    encoder = ChatEncoder(ckpt, config)
    plan = encoder.plan(Record(0, "x", {"messages": messages}, tmp_path))
    assert torch.equal(plan.input_ids, out["input_ids"][0])
    assert int((plan.input_ids == config.image_token_id).sum()) == 2 * 16
    assert (plan.labels != -100).any() and (
        plan.labels[plan.input_ids == config.image_token_id] == -100
    ).all()
    rows = torch.cat([encoder.decode(item, None) for item in plan.images])
    adapter = adapter_for(config)
    core = adapter.from_model_batch({**out, "labels": out["input_ids"]})
    assert torch.equal(rows, core["pixel_values"])
    assert torch.equal(core["mm_token_type_ids"], out["token_type_ids"])
    model = build_model(ckpt)  # the checkpoint round trip, with the tokenizer's ids
    prep = prepare_batch(model, {**out, "labels": out["input_ids"]}, 2)
    assert [b - a for a, b in prep.spans[0]] == [16, 16]


def _gemma4_processor(path):
    """``Gemma4Processor`` of the checkpoint around a freshly loaded tokenizer and PIL image
    processor, without its video processor (which needs torchvision) and audio part."""
    import json

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    config = json.loads((path / "processor_config.json").read_text())
    cls = getattr(transformers, config.pop("processor_class"))
    config.pop("image_processor"), config.pop("video_processor", None)
    lenient = type(cls.__name__, (cls,), {"check_argument_for_proper_class": lambda *a: None})
    return lenient(
        image_processor=AutoImageProcessor.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        video_processor=None,
        chat_template=(path / "chat_template.jinja").read_text(),
        feature_extractor=None,
        **config,
    )


class _Gemma4VideoStandIn:
    """What ``Gemma4Processor`` reads of its video processor's output, without torchvision (which
    ``Gemma4VideoProcessor`` needs to import): the videos and their metadata as its
    ``preprocess`` makes them (transformers' ``make_batched_videos`` and ``make_batched_metadata``,
    no frame sampling), and each video's soft tokens per frame from transformers' Gemma 4 image
    processor on its first frame at the video processor's ``max_soft_tokens`` (the same
    ``get_aspect_ratio_preserving_size`` target and the same patches // k**2 count as its
    ``_preprocess``)."""

    def __init__(self, image_processor, max_soft_tokens: int):
        self.image_processor, self.max_soft_tokens = image_processor, max_soft_tokens

    def __call__(self, videos, video_metadata=None, return_metadata=False, **kwargs):
        from PIL import Image
        from transformers import BatchFeature
        from transformers.video_utils import make_batched_metadata, make_batched_videos

        assert kwargs.get("do_sample_frames") is False  # the metadata's frames are all frames
        videos = make_batched_videos(videos)
        tokens = [
            int(
                self.image_processor(
                    images=[Image.fromarray(np.asarray(v[0]))],
                    max_soft_tokens=self.max_soft_tokens,
                    return_tensors="pt",
                )["num_soft_tokens_per_image"][0]
            )
            for v in videos
        ]
        data = {"num_soft_tokens_per_video": tokens}
        if return_metadata:
            data["video_metadata"] = make_batched_metadata(videos, video_metadata)
        return BatchFeature(data)


def test_gemma4_video_ids_equal_its_processor(tmp_path):
    """Gemma 4's ids for an image and two videos of frames (one resized, one at 1/40 fps: minute
    timestamps) equal ``Gemma4Processor.apply_chat_template(..., tokenize=True)``'s: its
    template, its ``replace_video_token`` (mm:ss timestamps from transformers' ``VideoMetadata``,
    boi, soft tokens, eoi per frame) and tokenizer, with the stand-in above for the video
    processor; the frames' timestamps and token counts are checked apart too."""
    import json
    import re

    from transformers import AutoConfig

    from cpvlm.data.record import Record
    from cpvlm.hf.data.processor import ChatEncoder
    from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint, write_frames, write_images

    path = make_tiny_checkpoint(tmp_path / "gemma4", "gemma4")
    encoder = ChatEncoder(path, AutoConfig.from_pretrained(path))
    reference = _gemma4_processor(path)
    video_config = json.loads((path / "processor_config.json").read_text())["video_processor"]
    reference.video_processor = _Gemma4VideoStandIn(
        reference.image_processor, video_config["max_soft_tokens"]
    )
    clips = [(write_frames(tmp_path / "a", 3, 96, 160, seed=2), 0.025),
             (write_frames(tmp_path / "b", 4, 50, 200, seed=4), 2.0)]  # fmt: skip
    (image,) = write_images(tmp_path, [(40, 70)], seed=3)
    content = [{"type": "image", "image": str(tmp_path / image)}]
    content += [{"type": "video", "video": str(clip), "fps": fps} for clip, fps in clips]
    content += [{"type": "text", "text": "Describe the videos."}]
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "a ball"}]},
    ]
    plan = encoder.plan(Record(0, "test", {"messages": messages}, None))

    frames = [np.stack([np.array(f.load()) for f in v.frames]) for v in plan.videos]
    decoded = json.loads(json.dumps(messages))
    for block, video in zip(decoded[0]["content"][1:3], frames, strict=True):
        block["video"] = video  # the frames cpvlm read, decoded (the stand-in cannot read files)
    metadata = [{"fps": fps, "total_num_frames": len(v), "frames_indices": list(range(len(v)))}
                for (_, fps), v in zip(clips, frames, strict=True)]  # fmt: skip
    out = reference.apply_chat_template(
        decoded, tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"video_metadata": metadata, "do_sample_frames": False},
    )  # fmt: skip
    assert torch.equal(plan.input_ids, out["input_ids"][0])

    def frames_of(ids) -> list[tuple[str, int]]:
        text = encoder.tokenizer.decode(ids)
        runs = re.findall(r"(\d\d:\d\d) <start_of_image>((?:<\|video\|>)+)<end_of_image>", text)
        return [(stamp, run.count("<|video|>")) for stamp, run in runs]

    mine, theirs = frames_of(plan.input_ids), frames_of(out["input_ids"][0])
    assert mine == theirs and len(mine) == 3 + 4
    seconds = [
        int(i / fps) for (_, fps), v in zip(clips, frames, strict=True) for i in range(len(v))
    ]
    assert [stamp for stamp, _ in mine] == [f"{s // 60:02d}:{s % 60:02d}" for s in seconds]
    assert seconds == [0, 40, 80, 0, 0, 1, 1]  # frame i at i / fps seconds
    k = encoder.adapter.config.vision_config.pooling_kernel_size
    per_frame = [v.grid[1] * v.grid[2] // k**2 for v in plan.videos for _ in range(v.grid[0])]
    assert [n for _, n in mine] == per_frame
    assert [v.grid for v in plan.videos] == [(3, 12, 20), (4, 8, 32)]  # 50 x 200 resized


# ---- no dense mask under CP ------------------------------------------------------------------


def _masks_built(rank, world_size, name):
    """Per mask transformers asks for, whether one was built (not None): in a CP forward, then in
    the wrapped model's own forward (no ``cpvlm_cp``: transformers' sdpa path)."""
    from transformers.masking_utils import AttentionMaskInterface

    import cpvlm.hf.attention as bridge

    base = cached_model(name)
    batch = mixed_batch(base, torch.float64)
    built: list[bool] = []

    def spy(*args, **kwargs):
        out = bridge.context_parallel_mask(*args, **kwargs)
        built.append(out is not None)
        return out

    AttentionMaskInterface.register(bridge.CP_ATTENTION, spy)
    try:
        cp = ContextParallelVLM(
            copy.deepcopy(base), dist.group.WORLD, options=CPOptions(attn="ring")
        )
        with torch.no_grad():
            cp(**batch)
            in_cp = list(built)
        built.clear()
        reference_loss_and_grads(cp.model, batch)  # the model's own batch and forward
    finally:
        AttentionMaskInterface.register(bridge.CP_ATTENTION, bridge.context_parallel_mask)
    return in_cp, built


@pytest.mark.parametrize("name", NAMES)
def test_a_cp_forward_builds_no_dense_mask(name):
    # Sliding windows and image spans make sdpa's masks dense [B, 1, S_loc, S_loc] bools (1 GiB a
    # kind at 32k local tokens); the CP attention never reads them, so a CP forward builds none.
    for in_cp, own in run_distributed(_masks_built, 2, name):
        assert in_cp and not any(in_cp), in_cp  # asked for, none built
        assert own and all(own), own  # the same model outside CP: its masks are dense
