"""The processor path of every family with a tiny processor against its own processor.

The families come from the registry (``cpvlm.hf.registry``: the kits with a ``tiny_processor``),
and what differs between them from what they declare: the end-of-turn text and a video frame size
of the tiny processor (``TinyProcessor.end_of_turn`` / ``frame_size``), the parts of the
processor class (the family's ``chat_media``), the core's layout of the processor's output (the
adapter's ``from_model_batch``) and the rows of an item (its ``item_sizes``). A new family with a
tiny processor is tested here without editing this file.

The reference is the checkpoint's processor class running its own ``apply_chat_template(...,
tokenize=True, return_dict=True)`` around the image processor (the family's
``chat_media.load_image_processor``: Nemotron Omni's steps written out; AutoProcessor where it
builds). Video processors need torchvision: where it imports the reference takes videos through
the checkpoint's own video processor, and the data path's videos are compared with it on
awkward clips (odd and tiny frames, one frame, a long odd clip), ids, grids and pixels exactly;
without it, through a stand-in for a fixed-size video processor on frames of its size (Gemma
4's video ids are then checked in tests/hf/test_gemma.py). The data path reads grids from headers, expands the text
itself and decodes each image alone. Ids and pixels must be equal exactly (the same float32
operations on the same pixels); labels are checked against their definition: each run of
labelled tokens decodes to one assistant answer and its end-of-turn token. Video frames
(processed as the video processors do, written out without torchvision) are checked against
the image processor on the same frames (no resize on either side), to float32 round-off (1e-6:
the video processors rescale and normalise in one fused step, the image processors in two).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoTokenizer

from cpvlm.data import Record
from cpvlm.hf.data.processor import ChatEncoder
from cpvlm.hf.registry import tiny_adapters
from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint, write_frames, write_images

# every family whose kit has a tiny processor: its tiny processor
TINY = {a.family: a.kit.tiny_processor for a in tiny_adapters().values() if a.kit.tiny_processor}
FAMILIES = sorted(TINY)
VIDEO_FAMILIES = sorted(f for f, tiny in TINY.items() if tiny.frame_size)  # videos checked here
SIZES = [(20, 30), (50, 70), (100, 40), (12, 90), (64, 64)]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_images(root, SIZES, seed=1)
    return root


def _encoder(family: str, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family)
    return family, path, ChatEncoder(path, AutoConfig.from_pretrained(path))


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return _encoder(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def video_checkpoint(request, tmp_path_factory):
    return _encoder(request.param, tmp_path_factory)


def _no_torchvision() -> str | None:
    """None where torchvision imports, else why it does not."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # missing, or a wheel that does not match torch (RuntimeError)
        return f"torchvision does not import ({type(err).__name__}: {err})"
    return None


NO_TORCHVISION = _no_torchvision()


def _reference(encoder: ChatEncoder, path: Path):
    """The processor class itself, around a freshly loaded tokenizer and image processor and,
    where torchvision imports, the checkpoint's video processor. ``AutoProcessor`` where it
    builds; it does not without torchvision (no video processor) nor for a checkpoint without a
    part its class requires (Gemma 4's feature extractor, none without audio): then the class
    with its part checks waived, the missing parts None."""
    try:
        return transformers.AutoProcessor.from_pretrained(path)
    except Exception:
        pass
    config = json.loads((path / "processor_config.json").read_text())
    cls = getattr(transformers, config.pop("processor_class"))
    config.pop("image_processor"), config.pop("video_processor", None)
    lenient = type(cls.__name__, (cls,), {"check_argument_for_proper_class": lambda *a: None})
    if encoder.adapter.takes_videos:  # the family's processor class takes a video processor
        config["video_processor"] = None
        if NO_TORCHVISION is None:
            config["video_processor"] = transformers.AutoVideoProcessor.from_pretrained(path)
    return lenient(
        image_processor=encoder.media.load_image_processor(path),  # AutoImageProcessor's
        tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=(path / "chat_template.jinja").read_text(),
        **encoder.media.processor_parts,  # the further parts the class requires
        **config,
    )


def _conversations(media: Path):
    img = lambda i: {"type": "image", "image": str(media / f"img{i}.png")}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    return [
        [{"role": "user", "content": [text("Count the shapes")]},
         {"role": "assistant", "content": [text("one, two")]}],
        [{"role": "user", "content": [img(0), text("Describe the image.")]},
         {"role": "assistant", "content": [text("A red square.")]}],
        [{"role": "user", "content": [img(3), text("What is in the picture?")]},
         {"role": "assistant", "content": [text("two cats")]},
         {"role": "user", "content": [text("And then?")]},
         {"role": "assistant", "content": [text("yes")]}],
        [{"role": "user", "content": [img(1), img(2), img(4), text("What is in the picture?")]},
         {"role": "assistant", "content": [text("The answer is yes.")]}],
    ]  # fmt: skip


def _answers(labels, ids, tokenizer) -> list[str]:
    runs, run = [], []
    for label, token in zip(labels.tolist(), ids.tolist(), strict=True):
        if label != -100:
            assert label == token
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    return [tokenizer.decode(r).strip() for r in [*runs, run] if r]


def _end_of_turn(family: str, encoder: ChatEncoder) -> str:
    return TINY[family].end_of_turn or encoder.tokenizer.eos_token


def test_ids_grids_pixels_and_labels_equal_the_processor(checkpoint, media):
    """Ids, labels, grids (the processor's output in the core's layout) and pixel rows; the rows
    of every vision unit of an image decoded alone are its rows in the whole image's."""
    family, path, encoder = checkpoint
    reference, adapter = _reference(encoder, path), encoder.adapter
    end = _end_of_turn(family, encoder)
    several = 0  # images of several crops or tiles
    for messages in _conversations(media):
        out = reference.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_tensors="pt"
        )
        plan = encoder.plan(Record(0, "test", {"messages": messages}, None))
        assert torch.equal(plan.input_ids, out["input_ids"][0])
        answers = [m["content"][0]["text"] for m in messages if m["role"] == "assistant"]
        want = [a + end for a in answers]
        assert _answers(plan.labels, plan.input_ids, encoder.tokenizer) == want
        if not plan.images:
            assert "pixel_values" not in out
            continue
        core = adapter.from_model_batch(dict(out))
        assert core["image_grid_thw"].tolist() == [list(it.grid) for it in plan.images]
        rows = torch.cat([encoder.decode(item, None) for item in plan.images])
        assert torch.equal(rows, core["pixel_values"])
        several += sum(it.grid[0] > 1 for it in plan.images)
        for item in plan.images:  # an image of several units (tiles): each decoded alone
            if adapter.split_frames and item.grid[0] > 1:
                alone = [encoder.decode(item, [j]) for j in range(item.grid[0])]
                assert torch.equal(torch.cat(alone), encoder.decode(item, None))
    if "tiled" in adapter.kit.traits:  # the conversations exercise the crops or tiles
        assert several > 0


def _fixed_size_video(encoder: ChatEncoder) -> bool:
    """The checkpoint's video processor resizes every frame to one ``size`` (height x width) and
    rescales and normalises it, as ``BaseVideoProcessor`` does: the stand-in below is it on frames
    of that size."""
    size = encoder.media.video_config.get("size") or {}
    return {"height", "width"} <= set(size)


def _video_stand_in(config: dict):
    """A fixed-size video processor on frames of its size (no resize): rescale and normalise with
    the config's mean and std (the CLIP ones, the class defaults, where it has none),
    ``[videos, F, C, S, S]``."""
    from transformers import BatchFeature
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    stats = (
        config.get("image_mean") or OPENAI_CLIP_MEAN,
        config.get("image_std") or OPENAI_CLIP_STD,
    )

    def process(videos, **kwargs):
        x = torch.stack([torch.as_tensor(v) for v in videos]).permute(0, 1, 4, 2, 3).float()
        mean, std = (torch.tensor(v).view(-1, 1, 1) for v in stats)
        return BatchFeature({"pixel_values_videos": (x / 255 - mean) / std})

    return process


def _with_video(encoder, path, messages, image, video):
    """The reference processor's output for ``messages`` with the image and the video's frames
    (its video processor, or the stand-in where torchvision is missing)."""
    reference = _reference(encoder, path)
    if getattr(reference, "video_processor", None) is None:
        reference.video_processor = _video_stand_in(encoder.media.video_config)
    text = reference.apply_chat_template(messages, tokenize=False)
    frames = np.stack([np.array(f.load()) for f in video.frames])
    return reference(
        text=[text], images=[[image.image.load()]], videos=[frames], return_tensors="pt"
    )


def _plan(encoder, content, answer="a ball"):
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    return messages, encoder.plan(Record(0, "test", {"messages": messages}, None))


def _units(grids, split_frames: bool) -> list[tuple[int, int, int]]:
    """The vision units of items of ``grids`` (``cpvlm.encoders.units``' rule)."""
    if not split_frames:
        return [tuple(g) for g in grids]
    return [(1, h, w) for t, h, w in grids for _ in range(t)]


def test_video_tokens_and_frames(video_checkpoint, tmp_path):
    """Videos of frames of the tiny processor's ``frame_size``, after an image: the video's grid
    is its frame's as an image (F frames), the tokens of each kind are the items' (the adapter's
    ``item_sizes``; a family may put frames among the images, as InternVL's one-tile images in
    text order); with a fixed-size video processor the ids equal the processor's (its own
    expansion; its video processor, which needs torchvision, replaced by its rescale and
    normalise on frames of its size) and so do the grids and pixels in the core's layout (the
    image exactly, the frames to 1e-6); each frame decoded alone gives its rows; a frame's rows
    are the leading rows of the image processor's of the same picture (all of them where the
    picture is one unit)."""
    family, path, encoder = video_checkpoint
    adapter = encoder.adapter
    clip = write_frames(tmp_path / "clip", 3, *TINY[family].frame_size, seed=2)
    names = write_images(tmp_path, [(40, 70)], seed=3)
    content = [
        {"type": "image", "image": str(tmp_path / names[0])},
        {"type": "video", "video": str(clip), "fps": 2.0},
        {"type": "text", "text": "Describe the video."},
    ]
    messages, plan = _plan(encoder, content)
    items = [*plan.images, *plan.videos]
    (video,) = [it for it in items if it.frames]
    (image,) = [it for it in items if it.image is not None]
    first = str(sorted(clip.iterdir())[0])
    _, alone = _plan(encoder, [{"type": "image", "image": first}])
    (frame,) = alone.images  # the first frame as an image
    assert video.grid == (3, *frame.grid[1:])
    types = encoder.ids.mm_token_type_ids(plan.input_ids)
    for code, kind_items in ((1, plan.images), (2, plan.videos)):
        tokens = sum(adapter.item_sizes(it.grid, it.kind)[1] for it in kind_items)
        assert int((types == code).sum()) == tokens
    if _fixed_size_video(encoder):
        out = _with_video(encoder, path, messages, image, video)
        assert torch.equal(plan.input_ids, out["input_ids"][0])
        core = adapter.from_model_batch(dict(out))
        for kind_items, grids, pixels in (
            (plan.images, "image_grid_thw", "pixel_values"),
            (plan.videos, "video_grid_thw", "pixel_values_videos"),
        ):
            if not kind_items:
                assert core.get(pixels) is None
                continue
            # the vision units (a family that splits frames: one per temporal frame or tile;
            # the processor may write a video's frames as images of one tile each)
            want_units = _units([it.grid for it in kind_items], adapter.split_frames)
            assert _units(core[grids].tolist(), adapter.split_frames) == want_units
            rows = [encoder.decode(it, None) for it in kind_items]
            want = core[pixels].split([r.shape[0] for r in rows])
            for it, got, ref in zip(kind_items, rows, want, strict=True):
                if it.frames:  # the video processor's fused rescale and normalise
                    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
                else:  # the image processor itself
                    assert torch.equal(got, ref)
    whole = encoder.decode(video, None)
    frames = [encoder.decode(video, [j]) for j in range(3)]
    assert torch.equal(torch.cat(frames), whole)
    picture = encoder.decode(frame, None)
    n = frames[0].shape[0]
    assert picture.shape[0] == n if frame.grid[0] == 1 else picture.shape[0] > n
    torch.testing.assert_close(frames[0], picture[:n], rtol=0, atol=1e-6)


# awkward videos: (frames, height, width, fps); fps None: the processor's default
CLIPS = [
    (3, 30, 40, None),
    (1, 31, 47, None),  # one frame of odd sides
    (7, 5, 3, None),  # tiny frames, 3 pixels wide (a side as long as the channels)
    (2, 1, 1, None),  # frames of one pixel
    (61, 33, 17, 2.0),  # a long odd clip at 2 fps: Gemma 4's timestamps up to 00:30
]


@pytest.mark.skipif(NO_TORCHVISION is not None, reason=str(NO_TORCHVISION))
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: "x".join(map(str, c[:3])) + f"@{c[3]}")
def test_video_pixels_equal_the_video_processor(video_checkpoint, clip, tmp_path):
    """The data path's video (its own resize, rescale and normalise: ``frame_pixels``) against the
    checkpoint's video processor itself (torchvision's resize) on awkward clips: ids, grids (the
    vision units) and pixels equal exactly (both resize the uint8 frames with torch's native
    bicubic antialias kernel, then the same float32 steps). Without fps the processor loads the
    frame files itself (``apply_chat_template``); with it, it is called on the frames and their
    metadata."""
    family, path, encoder = video_checkpoint
    processor = _reference(encoder, path)
    assert type(processor.video_processor).__name__.endswith("VideoProcessor")
    n, height, width, fps = clip
    folder = write_frames(tmp_path / "clip", n, height, width, seed=n + height)
    frames = sorted(str(p) for p in folder.iterdir())
    video = {"type": "video", "video": frames, **({"fps": fps} if fps else {})}
    messages = [
        {"role": "user", "content": [video]},
        {"role": "assistant", "content": [{"type": "text", "text": "a ball"}]},
    ]
    if fps is None:
        ref = processor.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_tensors="pt",
            processor_kwargs={"do_sample_frames": False},
        )  # fmt: skip
    else:
        from PIL import Image
        from transformers.video_utils import VideoMetadata

        pixels = np.stack([np.array(Image.open(f).convert("RGB")) for f in frames])
        metadata = VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n)))
        ref = processor(
            text=[processor.apply_chat_template(messages, tokenize=False)],
            videos=[pixels], video_metadata=[metadata], do_sample_frames=False,
            return_tensors="pt",
        )  # fmt: skip
    plan = encoder.plan(Record(0, "test", {"messages": messages}, None))
    assert torch.equal(plan.input_ids, ref["input_ids"][0])
    (item,) = plan.images + plan.videos  # the video (or its frames as images)
    core = encoder.adapter.from_model_batch(dict(ref))
    kind = "image" if item.kind == "image" else "video"
    split = encoder.adapter.split_frames
    assert _units(core[f"{kind}_grid_thw"].tolist(), split) == _units([item.grid], split)
    rows = encoder.decode(item, None)
    want = core["pixel_values" if kind == "image" else "pixel_values_videos"]
    assert rows.dtype == want.dtype and torch.equal(rows, want)
