"""Nemotron Omni on the data path (its tiny checkpoint): images by the image processor's steps
written out (transformers' class needs torchvision), audio clips through Parakeet's extractor.

Where torchvision imports, the written-out steps are compared with transformers'
``NemotronH_Omni_Reasoning_V3ImageProcessor`` itself (its own torchvision resize, rescale and
normalise) on awkward images: tiny, odd sizes, extreme aspect ratios, several images of one call
(one patch budget), images with transparency; grids and pixels equal exactly (the same float32
operations: torchvision's resize of a float32 image is ``interpolate`` bicubic with antialias).
Where transformers finds no torchvision, its image processor module is imported with a stand-in
for ``torchvision.transforms.v2.functional`` (its ``normalize``; the resize as torchvision's on
float32 images, ``interpolate`` bicubic with antialias) and the grid rule, the patch cut and the
pixels are compared with the module's functions and the class's ``_preprocess``; with a
hand-computed case (an image already at its grid: no resize, each row
``(x - 255 mean) / (255 std)`` of its patch) either way. Ids and features are compared with
``NemotronH_Omni_Reasoning_V3Processor`` itself called on the images and the decoded samples
(built around the checkpoint's extractor and its image processor class where torchvision
imports, the written-out steps elsewhere).
"""

import importlib
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from transformers import AutoConfig, AutoTokenizer

from cpvlm.data import Record
from cpvlm.data.audio import AudioRef, load_audio
from cpvlm.families.nemotron_h_omni_media import NemotronOmniImages, parakeet_features
from cpvlm.hf.data.processor import ChatEncoder
from cpvlm.hf.tiny_checkpoint import example_clip, make_tiny_checkpoint, write_images, write_wav

RATE = 16000
MODULE = "transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni"


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("nemotron"), "nemotron_h_omni")
    return path, ChatEncoder(path, AutoConfig.from_pretrained(path))


def _normalize(x, mean, std, inplace=False):  # torchvision's normalize: (x - mean) / std
    mean, std = (torch.as_tensor(v, dtype=x.dtype).view(-1, 1, 1) for v in (mean, std))
    return x.sub(mean).div(std)


def _no_torchvision() -> str | None:
    """None where torchvision imports, else why it does not."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # missing, or a wheel that does not match torch (RuntimeError)
        return f"torchvision does not import ({type(err).__name__}: {err})"
    return None


NO_TORCHVISION = _no_torchvision()  # asked before any fixture stands in for it


@pytest.fixture
def image_module(monkeypatch):
    """transformers' image processor module: as it is where torchvision imports; where
    transformers finds no torchvision, its torchvision import stood in for (a module with
    ``normalize``; transformers' own check still finds no torchvision)."""
    import transformers.image_processing_backends as backends
    from transformers.utils import is_torchvision_available

    if NO_TORCHVISION is None:
        yield importlib.import_module(MODULE)
        return
    if is_torchvision_available():  # installed but broken: its import cannot be stood in for
        pytest.skip(f"{NO_TORCHVISION}, but transformers takes it as installed")
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
    for name in (*names, names[-1] + ".functional"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    functional = sys.modules[names[-1] + ".functional"]
    functional.normalize = _normalize
    sys.modules[names[-1]].functional = functional
    monkeypatch.setattr(backends, "tvF", functional, raising=False)
    try:
        yield importlib.import_module(MODULE)
    finally:
        sys.modules.pop(MODULE, None)


def test_grids_follow_the_image_processors_rule(image_module):
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 400, (300, 2))]
    sizes += [(16, 16), (32, 48), (8, 8), (7, 900), (900, 7)]  # whole grids, extreme aspects
    for patch, lo, hi, length in [(16, 1024, 13312, 16384), (8, 16, 64, 16384), (8, 4, 0, 7)]:
        ip = NemotronOmniImages(
            patch_size=patch, min_num_patches=lo, max_num_patches=hi, max_model_len=length
        )
        for count in (1, 3):
            budget = image_module.get_num_patches_budget(count, 2, lo, hi, length)
            for i in range(0, len(sizes) - count + 1, count):
                call = sizes[i : i + count]
                try:
                    want = [
                        image_module.get_patch_grid_size(*s, patch, 2, lo, budget) for s in call
                    ]
                except ZeroDivisionError:  # an image too thin for the budget: refused
                    with pytest.raises(ValueError, match="too thin"):
                        ip.grids(call)
                    continue
                assert ip.grids(call) == want, call


def test_pixels_without_resize_are_the_normalised_patches(image_module):
    ip = NemotronOmniImages(patch_size=8, min_num_patches=4, max_num_patches=64)
    rgb = np.random.default_rng(1).integers(0, 256, (16, 32, 3), dtype=np.uint8)
    assert ip.grids([(16, 32)]) == [(2, 4)]  # 16 / 8 = 2 (even: round(2.5) = 2), 4
    rows = ip.pixels(Image.fromarray(rgb), (2, 4))
    x = torch.from_numpy(rgb).permute(2, 0, 1).double()
    mean, std = torch.tensor(ip.image_mean).double(), torch.tensor(ip.image_std).double()
    x = (x - 255 * mean.view(3, 1, 1)) / (255 * std.view(3, 1, 1))
    want = image_module.convert_image_to_patches(x[None], 8)[0]
    assert rows.dtype == torch.float32 and rows.shape == (8, 3 * 64)
    torch.testing.assert_close(rows.double(), want, rtol=0, atol=1e-5)  # float32 rounding
    # row 5 is the patch at (1, 1): channel-major 8 x 8 pixels
    assert torch.equal(want[5], x[:, 8:16, 8:16].reshape(-1))


def test_pixels_equal_the_classs_own_preprocess(image_module):
    """The class's ``_preprocess`` (one budget per call, grids, the float32 cast, its fused
    rescale and normalisation, the patches) on images resized up, down and not at all, its
    resize the call torchvision's ``resize`` makes on float32 images (``interpolate``, bicubic,
    antialias): equal exactly."""
    cls = image_module.NemotronH_Omni_Reasoning_V3ImageProcessor
    reference = cls.__new__(cls)  # its __init__ asks for torchvision
    reference.resize = lambda x, size, resample=None: F.interpolate(
        x, (size.height, size.width), mode="bicubic", antialias=True
    )
    mine = NemotronOmniImages(patch_size=8, min_num_patches=16, max_num_patches=64)
    rng = np.random.default_rng(4)
    sizes = [(40, 56), (90, 20), (16, 32), (12, 12), (40, 56)]
    images = [Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8)) for hw in sizes]
    out = reference._preprocess(
        [torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous() for im in images],
        resample=None,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=tuple(cls.image_mean),
        image_std=tuple(cls.image_std),
        patch_size=8,
        downsample_ratio=0.5,
        min_num_patches=16,
        max_num_patches=64,
        max_model_len=16384,
        disable_grouping=False,
        return_tensors="pt",
    )
    got = mine(images)
    assert got["image_grid_hw"].tolist() == out["image_grid_hw"].tolist()
    assert torch.equal(got["pixel_values"], out["pixel_values"])


def _images_with_transparency(rng) -> dict:
    rgba = rng.integers(0, 256, (21, 34, 4), dtype=np.uint8)
    rgba[:7, :, 3] = 0  # fully transparent rows: white after compositing
    palette = Image.fromarray(rgba[..., :3]).quantize(16)
    palette.info["transparency"] = 3  # palette entry 3 transparent
    grey = Image.fromarray(rgba[..., 0], "L")
    grey_alpha = Image.fromarray(rgba[..., [0, 3]], "LA")
    return {"RGBA": Image.fromarray(rgba, "RGBA"), "P": palette, "L": grey, "LA": grey_alpha}


# (image processor settings, calls of (height, width) image sizes)
AWKWARD = [
    (
        {"patch_size": 8, "min_num_patches": 16, "max_num_patches": 64},
        [[(1, 1)], [(3, 5)], [(7, 90)], [(255, 3)], [(97, 161)], [(500, 333)], [(16, 32)],
         [(33, 17), (16, 32)], [(40, 56), (40, 56), (12, 12)]],
    ),
    (  # the class defaults: a 1024-patch floor, every image resized up
        {"patch_size": 16},
        [[(1, 1)], [(31, 47)], [(7, 900)], [(33, 17), (640, 481)]],
    ),
    (  # no cap, a context of 7 tokens: the budget is the floor, times the images
        {"patch_size": 8, "min_num_patches": 4, "max_num_patches": 0, "max_model_len": 7},
        [[(1, 1)], [(97, 161)], [(33, 17), (16, 32), (5, 5)]],
    ),
]  # fmt: skip


@pytest.mark.skipif(NO_TORCHVISION is not None, reason=str(NO_TORCHVISION))
def test_grids_and_pixels_equal_the_class_itself(image_module):
    """``NemotronOmniImages`` against ``NemotronH_Omni_Reasoning_V3ImageProcessor`` built from its
    ``to_dict`` and called on the same PIL images (its own torchvision resize, its convert to
    RGB): grids and pixels equal exactly, on tiny, odd-sized and extreme images, several images
    of one call, and images with transparency (composited onto white: a plain convert to RGB,
    which drops the alpha, differs)."""
    cls = image_module.NemotronH_Omni_Reasoning_V3ImageProcessor
    rng = np.random.default_rng(5)
    for settings, calls in AWKWARD:
        mine = NemotronOmniImages(**settings)
        reference = cls(**mine.to_dict())
        for sizes in calls:
            images = [
                Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8)) for hw in sizes
            ]
            got, want = mine(images), reference(images, return_tensors="pt")
            assert got["image_grid_hw"].tolist() == want["image_grid_hw"].tolist(), sizes
            assert torch.equal(got["pixel_values"], want["pixel_values"]), sizes
    mine = NemotronOmniImages(**AWKWARD[0][0])
    reference = cls(**mine.to_dict())
    for mode, image in _images_with_transparency(rng).items():
        got, want = mine([image]), reference([image], return_tensors="pt")
        assert torch.equal(got["pixel_values"], want["pixel_values"]), mode
        if mode != "L":  # the test sees the compositing
            plain = mine([image.convert("RGB")])["pixel_values"]
            assert not torch.equal(plain, want["pixel_values"]), mode
    thin = [Image.new("RGB", (1, 255))]  # too thin for a budget of 4 patches: both refuse
    mine = NemotronOmniImages(**AWKWARD[2][0])
    with pytest.raises(ValueError, match="too thin"):
        mine(thin)
    with pytest.raises(ZeroDivisionError):
        cls(**mine.to_dict())(thin, return_tensors="pt")


def test_a_resized_image_keeps_the_bicubic_overshoot():
    """Resized in float32 (no clamp to uint8): a sharp edge rings past the input range."""
    ip = NemotronOmniImages(patch_size=8, min_num_patches=16, max_num_patches=64)
    rgb = np.zeros((12, 12, 3), dtype=np.uint8)
    rgb[:, 6:] = 255
    (grid,) = ip.grids([(12, 12)])
    assert grid == (4, 4)  # 2 x 2 scaled up to the 16 patches
    rows = ip.pixels(Image.fromarray(rgb), grid)
    top = (255 - 255 * torch.tensor(ip.image_mean)) / (255 * torch.tensor(ip.image_std))
    assert bool((rows.reshape(16, 3, 64).amax(dim=(0, 2)) > top).all())


def test_features_are_the_extractors_on_the_clip_alone(encoder):
    path, enc = encoder
    fe = enc.media.feature_extractor
    assert type(fe).__name__ == "ParakeetFeatureExtractor"
    rng = np.random.default_rng(2)
    short, long = (example_clip(rng, s, RATE, 1)[:, 0].astype(np.float32) for s in (0.3137, 1.2))
    mine = parakeet_features(fe, short)
    alone = fe(short, sampling_rate=RATE, return_attention_mask=True, return_tensors="pt")
    n = len(short) // fe.hop_length
    assert mine.shape == (n, enc.adapter.audio_feature_width)
    assert alone["input_features"].shape[1] == n + 1  # the extractor's extra frame, zero
    assert torch.equal(mine, alone["input_features"][0, :n])
    both = fe([short, long], sampling_rate=RATE, return_attention_mask=True, return_tensors="pt")
    # in a batch (as the processor calls it) the valid frames are the same: normalised over
    # the clip's own frames, the padding zero
    assert torch.equal(both["input_features"][0, :n], mine)
    assert not both["input_features"][0, n:].any() and int(both["attention_mask"][0].sum()) == n


def test_ids_pixels_and_features_equal_the_processor(encoder, tmp_path):
    path, enc = encoder
    write_images(tmp_path, [(40, 56), (90, 20)])
    clip = example_clip(np.random.default_rng(3), 1.37, 22050, 2)
    write_wav(tmp_path / "a.wav", clip, 22050)
    messages = [
        {"role": "user", "content": [{"type": "audio", "audio": "a.wav"},
                                     {"type": "image", "image": "img0.png"},
                                     {"type": "image", "image": "img1.png"},
                                     {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "two cats"}]},
    ]  # fmt: skip
    plan = enc.plan(Record(0, "t", {"messages": messages}, tmp_path))
    samples = load_audio(AudioRef(str(tmp_path / "a.wav")), RATE)
    cls = transformers.NemotronH_Omni_Reasoning_V3Processor
    lenient = type(cls.__name__, (cls,), {"check_argument_for_proper_class": lambda *a: None})
    # the class itself where torchvision imports, else the written-out steps
    image_processor = enc.image_processor
    if NO_TORCHVISION is None:
        image_processor = transformers.AutoImageProcessor.from_pretrained(path)
        assert type(image_processor).__name__ == "NemotronH_Omni_Reasoning_V3ImageProcessor"
    reference = lenient(
        image_processor=image_processor,
        feature_extractor=transformers.AutoFeatureExtractor.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=(path / "chat_template.jinja").read_text(),
    )
    text = reference.apply_chat_template(messages, tokenize=False)
    images = [Image.open(tmp_path / f"img{i}.png") for i in range(2)]
    out = reference(text=[text], images=images, audio=[samples], return_tensors="pt")
    assert torch.equal(plan.input_ids, out["input_ids"][0])
    core = enc.adapter.from_model_batch(dict(out))
    assert [it.grid for it in plan.images] == [tuple(g) for g in core["image_grid_thw"].tolist()]
    pixels = torch.cat([enc.decode(it, None) for it in plan.images])
    assert torch.equal(pixels, core["pixel_values"])
    (item,) = plan.audios
    assert torch.equal(item.features, core["audio_features"])
    assert core["audio_lengths"].tolist() == [item.frames] == [len(samples) // 160]
    a = enc.adapter
    pads = int((plan.input_ids == a.audio_token_id).sum())
    assert pads == a.audio_rows(item.frames) > 0
    image_rows = sum(g[1] * g[2] // a.merge_size**2 for g in (it.grid for it in plan.images))
    assert int((plan.input_ids == a.image_token_id).sum()) == image_rows
    media = torch.isin(plan.input_ids, torch.tensor(a.special_token_ids))
    assert bool((plan.labels[media] == -100).all())
    assert enc.tokenizer.decode(plan.labels[plan.labels != -100]) == "two cats<|im_end|>"
