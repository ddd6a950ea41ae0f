"""The processor path against the model's real processor: the same ids, grids, pixels, labels.

The reference is the checkpoint's processor class running its own ``apply_chat_template(...,
tokenize=True, return_dict=True)`` (AutoProcessor where torchvision works; elsewhere the same
class built around the PIL image processor, its video processor type check waived, which is
all an image-only conversation uses). The data path instead reads grids from image headers,
renders and expands the text itself and decodes each image separately. Everything must be
equal: ids, grids and pixel values exactly (the same float32 operations on the same pixels).
Labels are checked against their definition, computed from the reference ids alone: the tokens
after each ``<|im_start|>assistant\\n`` up to and including its ``<|im_end|>``.
"""

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from cpvlm.data import DataError, Record
from cpvlm.families.qwen2_vl import VIDEO_DEFAULTS, patchify_video
from cpvlm.hf.data.processor import ChatEncoder
from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint, write_frames, write_images

# (family, layout): both families, both checkpoint layouts.
CHECKPOINTS = [("qwen3_vl", "v5"), ("qwen2_5_vl", "legacy")]
SIZES = [(20, 30), (50, 70), (100, 40), (9, 300), (64, 64)]  # up-, down-scaled, odd aspect


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_images(root, SIZES, seed=1)
    write_frames(root / "clip", 5, 30, 40, seed=2)
    # An image stored sideways with an EXIF orientation of 6 (rotate 90 degrees to display).
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.open(root / "img1.png").save(root / "sideways.jpg", exif=exif, quality=95)
    return root


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=lambda c: f"{c[0]}-{c[1]}")
def checkpoint(request, tmp_path_factory):
    family, layout = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family, layout=layout)
    return path, ChatEncoder(path, AutoConfig.from_pretrained(path))


def _reference(encoder: ChatEncoder):
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(encoder.model_dir)
        if hasattr(processor, "image_processor"):
            return processor
    except Exception:  # torchvision missing or broken: the video processor cannot be built
        pass
    return encoder.processor  # the checkpoint's processor class, around the same image processor


def _conversations(media: Path):
    img = lambda i: {"type": "image", "image": str(media / f"img{i}.png")}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    return [
        [{"role": "user", "content": [text("Count the shapes")]},
         {"role": "assistant", "content": [text("one, two")]}],
        [{"role": "user", "content": [img(0), text("Describe the image.")]},
         {"role": "assistant", "content": [text("A red square.")]}],
        [{"role": "system", "content": [text("You are a helpful assistant.")]},
         {"role": "user", "content": [img(1), img(2), text("What is in the picture?")]},
         {"role": "assistant", "content": [text("two cats")]},
         {"role": "user", "content": [img(3), img(4)]},
         {"role": "assistant", "content": [text("The answer is yes.")]}],
        [{"role": "user", "content": [{"type": "image", "image": str(media / "sideways.jpg")}]},
         {"role": "assistant", "content": "The answer is no."}],
    ]  # fmt: skip


def _assistant_labels(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    header = [start, *tokenizer("assistant\n", add_special_tokens=False)["input_ids"]]
    labels = torch.full_like(ids, -100)
    i = 0
    while i < len(ids):
        if ids[i : i + len(header)].tolist() == header:
            j = i + len(header)
            while ids[j] != end:
                j += 1
            labels[i + len(header) : j + 1] = ids[i + len(header) : j + 1]
            i = j
        i += 1
    return labels


def _plan_and_decode(encoder, messages):
    plan = encoder.plan(Record(0, "test", {"messages": messages}, None))
    pixels = [encoder.decode(item, None) for item in plan.images]
    return plan, pixels


def test_ids_grids_pixels_and_labels_equal_the_processor(checkpoint, media):
    _, encoder = checkpoint
    reference = _reference(encoder)
    for messages in _conversations(media):
        ref = reference.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_tensors="pt"
        )
        plan, pixels = _plan_and_decode(encoder, messages)
        ids = ref["input_ids"][0]
        assert torch.equal(plan.input_ids, ids)
        assert torch.equal(plan.labels, _assistant_labels(ids, encoder.tokenizer))
        if plan.images:
            grids = torch.tensor([it.grid for it in plan.images])
            assert torch.equal(grids, ref["image_grid_thw"])
            assert torch.equal(torch.cat(pixels), ref["pixel_values"])
        else:
            assert "pixel_values" not in ref
    # The EXIF-rotated image: the header size is the displayed (rotated) one.
    sideways, _ = _plan_and_decode(encoder, _conversations(media)[3])
    upright, _ = _plan_and_decode(encoder, _conversations(media)[2])
    t, h, w = upright.images[0].grid  # img1.png, 50 high x 70 wide
    assert sideways.images[0].grid == (t, w, h) and h != w


def test_train_on_all_labels_every_text_token(checkpoint, media):
    path, encoder = checkpoint
    every = ChatEncoder(path, AutoConfig.from_pretrained(path), train_on="all")
    messages = _conversations(media)[2]
    plan = every.plan(Record(0, "test", {"messages": messages}, None))
    vision = (plan.input_ids == every.ids.image) | (plan.input_ids == every.ids.video)
    assert torch.equal(plan.labels, plan.input_ids.masked_fill(vision, -100))
    assert int(vision.sum()) > 0


def test_pixel_limits_override_the_processor(checkpoint, media):
    path, _ = checkpoint
    small = ChatEncoder(path, AutoConfig.from_pretrained(path), max_pixels=16 * 16 * 4)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": str(media / "img4.png")}]},
        {"role": "assistant", "content": "yes"},
    ]
    plan, pixels = _plan_and_decode(small, messages)  # 64 x 64 pixels, at most 32 x 32
    assert plan.images[0].grid == (1, 4, 4) and pixels[0].shape[0] == 16


def test_images_from_a_column_and_bytes(checkpoint, media):
    _, encoder = checkpoint
    png = (media / "img0.png").read_bytes()
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text",
             "text": "Describe the image.", "image": None}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
        ],
        "images": [{"bytes": png, "path": None}],
    }  # fmt: skip
    plan = encoder.plan(Record(0, "row 0", record, None))
    direct, _ = _plan_and_decode(encoder, _conversations(media)[1])
    assert torch.equal(plan.input_ids, direct.input_ids)
    assert torch.equal(encoder.decode(plan.images[0], None), encoder.decode(direct.images[0], None))


def test_video_frames_grid_tokens_and_temporal_patches(checkpoint, media):
    _, encoder = checkpoint
    messages = [
        {"role": "user", "content": [{"type": "video", "video": str(media / "clip"), "fps": 2}]},
        {"role": "assistant", "content": "a ball"},
    ]
    plan = encoder.plan(Record(0, "test", {"messages": messages}, None))
    (video,) = plan.videos
    t, h, w = video.grid
    assert t == 3  # 5 frames, temporal patch 2: the last frame repeats
    assert int((plan.input_ids == encoder.ids.video).sum()) == t * h * w // 4
    whole = encoder.decode(video, None)
    parts = [encoder.decode(video, [j]) for j in range(t)]
    assert torch.equal(whole, torch.cat(parts))  # each temporal patch alone gives its rows


def test_video_patch_layout_equals_transformers():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    x = torch.randn(4, 3, 32, 48)
    theirs = Qwen3VLVideoProcessor.patchify(None, x[None], 8, 2, 2)[0][0]
    assert torch.equal(patchify_video(x, 8, 2, 2), theirs)
    defaults = VIDEO_DEFAULTS["Qwen3VLVideoProcessor"]
    for key in ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean"):
        assert defaults[key] == getattr(Qwen3VLVideoProcessor, key), key


def test_video_pixels_equal_the_video_processor(checkpoint, media):
    pytest.importorskip("torchvision", exc_type=ImportError)
    _, encoder = checkpoint
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(encoder.model_dir)
    messages = [
        {"role": "user", "content": [{"type": "video", "video": str(media / "clip")}]},
        {"role": "assistant", "content": "a ball"},
    ]
    frames = sorted(str(p) for p in (media / "clip").iterdir())
    messages[0]["content"][0]["video"] = frames
    ref = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"do_sample_frames": False},
    )  # fmt: skip
    plan = encoder.plan(Record(0, "test", {"messages": messages}, None))
    assert torch.equal(plan.input_ids, ref["input_ids"][0])
    assert torch.equal(encoder.decode(plan.videos[0], None), ref["pixel_values_videos"])


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]},
                       {"role": "assistant", "content": "x"}]}, "missing_media"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": "bad.png"}]},
                       {"role": "assistant", "content": "x"}]}, "unreadable_media"),
        ({"text": "no messages"}, "bad_record"),
        ({"input_ids": [1, 2, 100000]}, "out_of_vocab"),
    ],
)  # fmt: skip
def test_bad_samples_raise_a_data_error_naming_the_reason(checkpoint, tmp_path, record, reason):
    _, encoder = checkpoint
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(DataError) as err:
        encoder.plan(Record(3, "data.jsonl line 4", record, tmp_path))
    assert err.value.reason == reason


def _decoded_with_pyav(path) -> list:
    """Every frame of a video file, decoded by PyAV directly (the reference)."""
    import av

    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_video_file_sampled_at_fps_equals_the_same_frames_as_a_folder(checkpoint, tmp_path):
    """A video file's frames are sampled at the record's fps (25 frames at 10 fps, fps 4: 10
    frames at int(i * 25 / 10)); its ids, grid and pixel rows equal those of a folder holding the
    same decoded frames, and each temporal patch decoded alone gives its rows."""
    pytest.importorskip("av")
    from cpvlm.hf.tiny_checkpoint import write_video

    _, encoder = checkpoint
    clip = write_video(tmp_path / "clip.mp4", 25, 30, 40, fps=10, seed=3)
    every = _decoded_with_pyav(clip)
    assert len(every) == 25
    picked = [0, 2, 5, 7, 10, 12, 15, 17, 20, 22]
    (tmp_path / "frames").mkdir()
    for k, i in enumerate(picked):
        Image.fromarray(every[i]).save(tmp_path / "frames" / f"{k:05d}.png")

    def plan(video, fps):
        messages = [
            {"role": "user", "content": [{"type": "video", "video": str(video), "fps": fps}]},
            {"role": "assistant", "content": "a ball"},
        ]
        return encoder.plan(Record(0, "test", {"messages": messages}, None))

    from_file, from_folder = plan(clip, 4), plan(tmp_path / "frames", 4.0)
    (video,), (folder_video,) = from_file.videos, from_folder.videos
    assert [f.index for f in video.frames] == picked and video.fps == 4.0
    assert video.grid == folder_video.grid and video.grid[0] == 5
    assert video.second_per_grid == folder_video.second_per_grid
    assert torch.equal(from_file.input_ids, from_folder.input_ids)
    whole = encoder.decode(video, None)
    assert torch.equal(whole, encoder.decode(folder_video, None))
    parts = [encoder.decode(video, [j]) for j in range(video.grid[0])]
    assert torch.equal(whole, torch.cat(parts))


def test_video_file_default_fps_and_bad_files(checkpoint, tmp_path):
    pytest.importorskip("av")
    from cpvlm.hf.tiny_checkpoint import write_video

    _, encoder = checkpoint
    clip = write_video(tmp_path / "clip.mp4", 25, 30, 40, fps=10)
    (tmp_path / "broken.mp4").write_bytes(b"\x00not a video" * 50)

    def plan(video, **item):
        messages = [
            {"role": "user", "content": [{"type": "video", "video": str(video), **item}]},
            {"role": "assistant", "content": "a ball"},
        ]
        return encoder.plan(Record(0, "test", {"messages": messages}, None))

    (video,) = plan(clip).videos  # no fps: 2 frames per second of the 2.5 s clip
    assert [f.index for f in video.frames] == [0, 5, 10, 15, 20] and video.fps == 2.0
    with pytest.raises(DataError, match="broken.mp4") as info:
        plan(tmp_path / "broken.mp4")
    assert info.value.reason == "unreadable_media"
    with pytest.raises(DataError, match="no such video") as info:
        plan(tmp_path / "missing.mp4")
    assert info.value.reason == "missing_media"
    with pytest.raises(DataError, match="fps must be > 0"):
        plan(clip, fps=0)


def test_tokens_spliced_from_the_placeholders_equal_the_expanded_text_tokenized(checkpoint, media):
    """``ExpandedTokenizer`` (the raw rendering tokenized, each replacement once) against the
    tokenizer on the whole expanded text: the same ids and offsets, also where it must fall
    back (a replacement that begins with text, a placeholder that is not an added token)."""
    from cpvlm.hf.data.expanded_text import ExpandedTokenizer, Rendering

    _, encoder = checkpoint
    tok = encoder.tokenizer
    splice = ExpandedTokenizer(tok)
    pad = encoder.processor.image_token
    for messages in _conversations(media):
        plan = encoder.plan(Record(0, "test", {"messages": messages}, None))
        raw = encoder._render(messages)
        full = Rendering(raw, *encoder._expand(raw, (list(plan.images), [], [])))
        cases = [full]
        if full.expansion:  # the same text with a replacement that begins with text
            r = dict(full.expansion[0], replacement="x y" + full.expansion[0]["replacement"])
            c, d = r["new_span"]
            r["new_span"] = (c, d + 3)
            text = full.text[:c] + "x y" + full.text[c:]
            later = [
                dict(e, new_span=(e["new_span"][0] + 3, e["new_span"][1] + 3))
                for e in full.expansion[1:]
            ]
            cases.append(Rendering(raw, text, [r, *later]))
        for k, case in enumerate(cases):
            whole = []
            splice._whole = lambda *a, whole=whole: (
                whole.append(1) or type(splice)._whole(splice, *a)
            )
            ref = tok(case.text, return_offsets_mapping=True)
            ids, offsets = splice(case, True)
            assert ids == ref["input_ids"]
            assert [tuple(o) for o in offsets] == [tuple(o) for o in ref["offset_mapping"]]
            # the images' placeholders are spliced; the text-led replacement falls back
            assert bool(whole) == (k == 1 or not case.expansion)
    assert pad in splice.clean
