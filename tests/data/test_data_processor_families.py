"""The processor path of LLaVA-OneVision, InternVL and Gemma 4 against their own processors.

The reference is the checkpoint's processor class running its own ``apply_chat_template(...,
tokenize=True, return_dict=True)`` around the PIL image processor (AutoProcessor where
torchvision works; their video processors need it, so without it the reference takes videos
through a stand-in for the video processor, LLaVA-OneVision's and InternVL's, on frames of the
tower's size; Gemma 4's through a stand-in that gives its processor's replacement code the
video processor's outputs). The data path reads grids from headers, expands the text itself and decodes each image
alone. Ids and pixels must be equal exactly (the same float32 operations on the same pixels);
labels are checked against their definition: each run of labelled tokens decodes to one
assistant answer and its end-of-turn token. Video frames (processed as the video processors do,
written out without torchvision) are checked against the image processor on the same frames at
the tower's size (no resize on either side), to float32 round-off (1e-6: the video processors
rescale and normalise in one fused step, the image processors in two).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from cpvlm.data import Record
from cpvlm.hf.data.processor import ChatEncoder
from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint, write_frames, write_images

FAMILIES = ["llava_onevision", "internvl", "gemma4"]
SIZES = [(20, 30), (50, 70), (100, 40), (12, 90), (64, 64)]
END = {"llava_onevision": "<|im_end|>", "internvl": "<|im_end|>", "gemma4": "<end_of_turn>"}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_images(root, SIZES, seed=1)
    return root


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    family = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family)
    return family, path, ChatEncoder(path, AutoConfig.from_pretrained(path))


def _reference(family: str, path: Path):
    """The processor class itself, around a freshly loaded tokenizer and PIL image processor."""
    try:
        return transformers.AutoProcessor.from_pretrained(path)
    except Exception:  # torchvision missing: the video processor cannot be built
        pass
    config = json.loads((path / "processor_config.json").read_text())
    cls = getattr(transformers, config.pop("processor_class"))
    config.pop("image_processor"), config.pop("video_processor", None)
    lenient = type(cls.__name__, (cls,), {"check_argument_for_proper_class": lambda *a: None})
    parts = {"feature_extractor": None} if family == "gemma4" else {}
    return lenient(
        image_processor=AutoImageProcessor.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        video_processor=None,
        chat_template=(path / "chat_template.jinja").read_text(),
        **parts,
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


def _processor_rows(family, adapter, out, grids) -> torch.Tensor:
    """The reference's pixels in cpvlm's layout: each tile's or crop's [C, S, S] values as rows
    (LLaVA-OneVision: an image's crops without the batch's padding), Gemma 4's real patches."""
    pixels = out["pixel_values"]
    if family == "llava_onevision":
        return torch.cat([pixels[i, : g[0]].reshape(-1, adapter.pixel_width)
                          for i, g in enumerate(grids)])  # fmt: skip
    if family == "internvl":
        return pixels.reshape(-1, adapter.pixel_width)
    return adapter.from_model_batch(dict(out))["pixel_values"]


def _answers(labels, ids, tokenizer) -> list[str]:
    runs, run = [], []
    for label, token in zip(labels.tolist(), ids.tolist(), strict=True):
        if label != -100:
            assert label == token
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    return [tokenizer.decode(r).strip() for r in [*runs, run] if r]


def test_ids_grids_pixels_and_labels_equal_the_processor(checkpoint, media):
    family, path, encoder = checkpoint
    reference, adapter = _reference(family, path), encoder.adapter
    for messages in _conversations(media):
        out = reference.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_tensors="pt"
        )
        plan = encoder.plan(Record(0, "test", {"messages": messages}, None))
        assert torch.equal(plan.input_ids, out["input_ids"][0])
        answers = [m["content"][0]["text"] for m in messages if m["role"] == "assistant"]
        want = [a + END[family] for a in answers]
        assert _answers(plan.labels, plan.input_ids, encoder.tokenizer) == want
        if not plan.images:
            assert "pixel_values" not in out
            continue
        grids = [it.grid for it in plan.images]
        if family == "llava_onevision":  # (crops, H, W): the sizes, and crops per image
            assert out["image_sizes"].tolist() == [[h, w] for _, h, w in grids]
            assert [t for t, _, _ in grids] == (
                [1] * len(grids) if len(grids) > 1 else [out["pixel_values"].shape[1]]
            )
        elif family == "internvl":  # (tiles, s, s)
            assert sum(t for t, _, _ in grids) == out["pixel_values"].shape[0] > len(grids)
        else:
            core = adapter.from_model_batch(dict(out))
            assert core["image_grid_thw"].tolist() == [list(g) for g in grids]
        rows = torch.cat([encoder.decode(item, None) for item in plan.images])
        assert torch.equal(rows, _processor_rows(family, adapter, out, grids))
        if family == "internvl":  # each tile decoded alone gives its rows
            item = plan.images[0]
            tiles = [encoder.decode(item, [j]) for j in range(item.grid[0])]
            assert torch.equal(torch.cat(tiles), encoder.decode(item, None))


def _video_stand_in(videos, **kwargs):
    """LLaVA-OneVision's and InternVL's video processors on frames of the tower's size (no
    resize): rescale and normalise with the CLIP mean and std, ``[videos, F, C, S, S]``."""
    from transformers import BatchFeature
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    x = torch.stack([torch.as_tensor(v) for v in videos]).permute(0, 1, 4, 2, 3).float()
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
    return BatchFeature({"pixel_values_videos": (x / 255 - mean) / std})


def _with_video(family, path, messages, image, video):
    """The reference processor's output for ``messages`` with the image and the video's frames
    (its video processor, or the stand-in where torchvision is missing)."""
    reference = _reference(family, path)
    if getattr(reference, "video_processor", None) is None:
        reference.video_processor = _video_stand_in
    text = reference.apply_chat_template(messages, tokenize=False)
    frames = np.stack([np.array(f.load()) for f in video.frames])
    return reference(
        text=[text], images=[[image.image.load()]], videos=[frames], return_tensors="pt"
    )


def test_video_tokens_and_frames(checkpoint, tmp_path):
    """Videos: InternVL's frames are one-tile images among the images in text order, Gemma 4's a
    video of frames, LLaVA-OneVision's a video of (F, S, S) (S x S frames) after the image;
    LLaVA-OneVision's and InternVL's ids equal to their processors' (the processor's own
    expansion; its video processor, which needs torchvision, replaced by its rescale and
    normalise on frames of the tower's size); each frame decoded alone gives its rows; at the
    tower's size a frame's rows are the image processor's of the same picture."""
    family, path, encoder = checkpoint
    size = {"internvl": (32, 32), "gemma4": (96, 160), "llava_onevision": (32, 32)}[family]
    clip = write_frames(tmp_path / "clip", 3, *size, seed=2)
    names = write_images(tmp_path, [(40, 70)], seed=3)
    content = [
        {"type": "image", "image": str(tmp_path / names[0])},
        {"type": "video", "video": str(clip), "fps": 2.0},
        {"type": "text", "text": "Describe the video."},
    ]
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "a ball"}]},
    ]
    record = Record(0, "test", {"messages": messages}, None)
    plan = encoder.plan(record)
    types = encoder.ids.mm_token_type_ids(plan.input_ids)
    if family == "llava_onevision":
        (video,) = plan.videos
        side = encoder.adapter.crop  # each frame one crop
        assert video.grid == (3, side, side) and plan.images[0].grid[1:] == (40, 70)
        out = _with_video(family, path, messages, plan.images[0], video)
        assert torch.equal(plan.input_ids, out["input_ids"][0])
        assert int((types == 2).sum()) == 3 * 2 * 2 + 1  # 3 frames of 2 x 2 pooled rows, newline
        core = encoder.adapter.from_model_batch(dict(out))
        assert core["video_grid_thw"].tolist() == [list(video.grid)]
        torch.testing.assert_close(
            encoder.decode(video, None), core["pixel_values_videos"], rtol=0, atol=1e-6
        )
    elif family == "internvl":
        assert not plan.videos and len(plan.images) == 2
        video = plan.images[1]
        assert video.grid == (3, 4, 4) and video.frames
        text = encoder.tokenizer.decode(plan.input_ids)
        assert [f"Frame{i}: <img>" in text for i in (1, 2, 3, 4)] == [True] * 3 + [False]
        assert int((types == 1).sum()) == (plan.images[0].grid[0] + 3) * 4
        out = _with_video(family, path, messages, plan.images[0], video)
        assert torch.equal(plan.input_ids, out["input_ids"][0])
        rows = torch.cat([encoder.decode(item, None) for item in plan.images])
        want = out["pixel_values"].reshape(rows.shape)
        n = encoder.decode(plan.images[0], None).shape[0]
        assert torch.equal(rows[:n], want[:n])  # the image: its image processor itself
        torch.testing.assert_close(rows[n:], want[n:], rtol=0, atol=1e-6)
    else:  # its ids against its processor: test_gemma4_video_ids_equal_its_processor
        (video,) = plan.videos
        assert video.grid == (3, 12, 20)
        text = encoder.tokenizer.decode(plan.input_ids)
        assert text.count("00:00 <start_of_image>") == 2 and "00:01 <start_of_image>" in text
        assert int((types == 2).sum()) == 3 * 12 * 20 // 4
    whole = encoder.decode(video, None)
    frames = [encoder.decode(video, [j]) for j in range(3)]
    assert torch.equal(torch.cat(frames), whole)
    first = encoder.image_processor(images=[video.frames[0].load()], return_tensors="pt")
    if family == "internvl":
        expect = first["pixel_values"].reshape(-1, encoder.adapter.pixel_width)
    elif family == "llava_onevision":  # the base crop of the frame as an image alone
        expect = first["pixel_values"][0, 0].reshape(-1, encoder.adapter.pixel_width)
    else:
        expect = encoder.adapter.from_model_batch(dict(first))["pixel_values"]
    torch.testing.assert_close(frames[0], expect, rtol=0, atol=1e-6)


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
    import re

    path = make_tiny_checkpoint(tmp_path / "gemma4", "gemma4")
    encoder = ChatEncoder(path, AutoConfig.from_pretrained(path))
    reference = _reference("gemma4", path)
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


def test_video_pixels_equal_the_video_processor(checkpoint, tmp_path):
    pytest.importorskip("torchvision", exc_type=ImportError)
    family, path, encoder = checkpoint
    processor = transformers.AutoProcessor.from_pretrained(path)
    clip = write_frames(tmp_path / "clip", 3, 30, 40, seed=2)
    frames = sorted(str(p) for p in clip.iterdir())
    messages = [
        {"role": "user", "content": [{"type": "video", "video": frames}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a ball"}]},
    ]
    ref = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"do_sample_frames": False},
    )  # fmt: skip
    plan = encoder.plan(Record(0, "test", {"messages": messages}, None))
    assert torch.equal(plan.input_ids, ref["input_ids"][0])
    item = (plan.images + plan.videos)[0]
    rows = encoder.decode(item, None)
    if family == "internvl":
        assert torch.equal(rows, ref["pixel_values"].reshape(rows.shape))
    else:
        assert torch.equal(rows, encoder.adapter.from_model_batch(dict(ref))["pixel_values_videos"])
