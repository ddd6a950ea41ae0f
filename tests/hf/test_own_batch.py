"""Every family takes its own batch: what its processor returns and its forward takes.

- Every family: the model's forward's documented inputs (its own keys, pixel layout and dtypes)
  pass ContextParallelVLM's key check and prepare to the same grids, pixels and positions as the
  core's layout (Gemma 3's real processor: tests/hf/test_gemma.py).
- LLaVA-OneVision and InternVL: the output of their real processors (the transformers classes on
  a word-level tokenizer and the real PIL image processors, built offline) against the model's
  own forward and backward on that same batch, at cp 2 and 3, ring and all-gather: multi-crop
  images and tiles, a multi-image sample, a text-only sample, and a batch with fewer units than
  ranks (ranks that encode no image); LLaVA-OneVision also a sample with an image and a video
  (``pixel_values_videos``; the processor's own token expansion, its video processor replaced by
  the rescale and normalise it does to frames already of the crop's size, as torchvision does not
  load here), where one rank encodes only the video and, at cp 3, one nothing. The processors'
  float32 pixels go to the CP model as they are (it casts them to the tower's dtype); the
  reference gets them in float64.

Tolerance: float64 relative error 1e-10 against the one-process model
(docs/architecture.md, "Exactness").
"""

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import FAMILIES, cached_model, grad_errors  # noqa: E402

from cpvlm.hf import ContextParallelVLM, adapter_for, prepare_batch  # noqa: E402
from cpvlm.hf.inputs import batch_keys  # noqa: E402
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    cp_loss_and_grads,
    mixed_batch,
    reference_loss_and_grads,
    rel_err,
    run_distributed,
)

CONFIGS = [("ring", "route", "scalable"), ("allgather", "allgather", "compat")]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_models_own_batch_is_taken_as_the_cores(name):
    model = cached_model(name)
    adapter = adapter_for(model)
    core = mixed_batch(model, torch.float64)
    native = adapter.to_model_batch(core)
    with torch.no_grad():  # what the forward takes
        model(**{k: v for k, v in native.items() if k != "labels"}, use_cache=False)
    native["labels"] = core["labels"]
    assert set(native) - {"input_ids", "labels"} <= set(batch_keys(adapter))
    a, b = prepare_batch(model, core, 2), prepare_batch(model, native, 2)
    assert torch.equal(a.grid_thw, b.grid_thw)
    assert torch.equal(a.position_ids, b.position_ids) and a.spans == b.spans
    assert torch.equal(a.pixel_values(torch.float64), b.pixel_values(torch.float64))


# ---- the real processors of LLaVA-OneVision and InternVL ------------------------------------

WORDS = [f"w{i}" for i in range(40)]


def _tokenizer(specials: dict[str, int], extra: dict[str, str]):
    """A word-level tokenizer: w0.. at ids 3.., the family's special tokens at the tiny model's
    ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{w: 3 + i for i, w in enumerate(WORDS)}}
    vocab.update(specials)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", extra_special_tokens=extra
    )


def _without_video_processor(cls):
    """The processor class, built without its video processor class: ProcessorMixin type-checks
    it through torchvision, which does not import with the CPU torch here (processors-offline
    notes); nothing else changes."""

    class Processor(cls):
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return Processor


def llava_onevision_video_processor(videos, **kwargs):
    """``LlavaOnevisionVideoProcessor`` on frames already S x S (its resize is then none): uint8
    ``[F, S, S, C]`` per video, rescaled and normalised with the CLIP mean and std, as
    ``pixel_values_videos`` ``[videos, F, C, S, S]`` float32."""
    from transformers import BatchFeature
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    x = torch.stack([torch.from_numpy(v) for v in videos]).permute(0, 1, 4, 2, 3).float()
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
    return BatchFeature({"pixel_values_videos": (x / 255 - mean) / std})


def llava_onevision_processor(config):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor,
    )

    side = config.vision_config.image_size
    image_processor = LlavaOnevisionImageProcessorPil(
        image_grid_pinpoints=config.image_grid_pinpoints,
        size={"height": side, "width": side},
        crop_size={"height": side, "width": side},
    )
    tokens = {"<image>": config.image_token_id, "<video>": config.video_token_id}
    tokenizer = _tokenizer(tokens, {"image_token": "<image>", "video_token": "<video>"})
    return _without_video_processor(LlavaOnevisionProcessor)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=llava_onevision_video_processor,
        num_image_tokens=(side // config.vision_config.patch_size) ** 2,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        vision_aspect_ratio=config.vision_aspect_ratio,
    )


def internvl_processor(config):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    side = config.vision_config.image_size[0]  # [height, width] in InternVL's config
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": side, "width": side}, crop_to_patches=True, min_patches=1, max_patches=4
    )
    tokens = {
        "<img>": config.start_image_token_id,
        "</img>": config.end_image_token_id,
        "<IMG_CONTEXT>": config.image_token_id,
        "<video>": 503,
    }
    extra = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    return _without_video_processor(InternVLProcessor)(
        image_processor=image_processor,
        tokenizer=_tokenizer(tokens, extra),
        image_seq_length=config.image_seq_length,
    )


PROCESSORS = {
    "llava-onevision-tiny": (llava_onevision_processor, "<image>"),
    "internvl-tiny": (internvl_processor, "<IMG_CONTEXT>"),
}

# Per batch: each sample's image sizes (height, width) and its text length. The first batch has an
# image of 1 + 2 x 2 crops / tiles (LLaVA-OneVision: downsampled), a multi-image sample (LLaVA:
# base crops only) and a text-only sample; the second one small image (one unit: fewer units
# than ranks).
SAMPLES = (
    [((60, 70),), ((40, 90), (20, 30)), ()],
    [((20, 30),), ()],
)
VIDEO_SAMPLES = [((60, 70), 3), ()]
"""LLaVA-OneVision: an image of 1 + 2 x 2 crops and a video of 3 frames (an int: its frames) in
one sample, and a text-only one: two units."""


def own_batch(name: str, samples, seed: int) -> dict:
    """The processor's output for ``samples`` (right-padded), with labels on every real token."""
    from PIL import Image

    build, token = PROCESSORS[name]
    processor = build(cached_model(name).config)
    rng = np.random.default_rng(seed)
    side = processor.image_processor.size["height"]
    images, videos, texts = [], [], []
    for items in samples:
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), 6 + 2 * len(items))]
        for i, item in enumerate(items):
            words.insert(1 + 2 * i, token if isinstance(item, tuple) else "<video>")
        texts.append(" ".join(words))
        sizes = [item for item in items if isinstance(item, tuple)]
        images.append(
            [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        )
        frames = [item for item in items if isinstance(item, int)]
        videos += [rng.integers(0, 256, (f, side, side, 3), dtype=np.uint8) for f in frames]
    out = processor(
        images=images,
        text=texts,
        videos=videos or None,
        return_tensors="pt",
        padding=True,
        padding_side="right",
    )
    batch = dict(out)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def test_processors_give_the_layouts_the_exactness_test_needs():
    llava = own_batch("llava-onevision-tiny", SAMPLES[0], 0)
    assert llava["pixel_values"].shape == (3, 5, 3, 32, 32)
    assert llava["pixel_values"].dtype == torch.float32
    assert llava["batch_num_images"].tolist() == [1, 2]  # samples with images
    assert llava["image_sizes"].tolist() == [[60, 70], [40, 90], [20, 30]]
    model = cached_model("llava-onevision-tiny")
    prep = prepare_batch(model, llava, 2)
    assert prep.grid_thw.tolist() == [[5, 60, 70], [1, 40, 90], [1, 20, 30]]
    internvl = own_batch("internvl-tiny", SAMPLES[0], 0)
    assert internvl["pixel_values"].shape == (5 + 3 + 1, 3, 32, 32)
    prep = prepare_batch(cached_model("internvl-tiny"), internvl, 2)
    assert prep.grid_thw.tolist() == [[5, 4, 4], [3, 4, 4], [1, 4, 4]]
    assert (internvl["attention_mask"][:, 0] == 1).all()  # right padding, as CP needs
    video = own_batch("llava-onevision-tiny", VIDEO_SAMPLES, 2)
    assert video["pixel_values_videos"].shape == (1, 3, 3, 32, 32)
    assert video["pixel_values"].shape == (1, 5, 3, 32, 32)
    tokens = (video["input_ids"] == model.config.video_token_id).sum()
    assert tokens == 3 * 2 * 2 + 1  # 3 frames of 4 x 4 rows pooled to 2 x 2, one newline
    prep = prepare_batch(model, video, 2)
    assert prep.grid_thw.tolist() == [[5, 60, 70], [3, 32, 32]]  # a video: 3 frames of 32 x 32
    assert prep.kinds == ("image", "video")


def _own_batch_steps(rank, world_size, batches):
    results = []
    for name, batch in batches:
        for attn, vision, flow in CONFIGS:
            model = copy.deepcopy(cached_model(name))
            cp = ContextParallelVLM(
                model, dist.group.WORLD, options=CPOptions(attn=attn, vision=vision, flow=flow)
            )
            out, loss, grads = cp_loss_and_grads(cp, batch)
            results.append((loss, grads if rank == 0 else None, out.encoded_units))
    return results


@pytest.mark.timeout(600)  # five batches, two configurations, gloo processes
@pytest.mark.parametrize("cp_size", [2, 3])
def test_own_batches_of_llava_onevision_and_internvl_equal_the_model(cp_size):
    cases = [(name, samples, i) for name in PROCESSORS for i, samples in enumerate(SAMPLES)]
    cases.append(("llava-onevision-tiny", VIDEO_SAMPLES, 2))
    batches, refs = [], []
    for name, samples, seed in cases:
        batch = own_batch(name, samples, seed=seed)
        as_model = {k: v.double() if k.startswith("pixel_values") else v for k, v in batch.items()}
        refs.append((name, reference_loss_and_grads(cached_model(name), as_model)))
        batches.append((name, batch))
    per_rank = run_distributed(_own_batch_steps, cp_size, batches, timeout=600)
    for k, (loss, grads, _) in enumerate(per_rank[0]):
        name, (ref_loss, ref_grads) = refs[k // len(CONFIGS)]
        assert rel_err(loss, ref_loss) <= 1e-10, (name, k)
        for param, err in grad_errors(name, grads, ref_grads).items():
            assert err <= 1e-10, (name, k, param)
    for k in range(len(per_rank[0])):
        units = sorted(r[k][2] for r in per_rank)
        samples = cases[k // len(CONFIGS)][1]
        if samples is SAMPLES[1]:  # fewer units than ranks: some rank encodes nothing
            assert units[0] == 0
        if samples is VIDEO_SAMPLES:  # one rank the image, one the video (cp 3: one nothing)
            assert units == [0] * (cp_size - 2) + [1, 1]
