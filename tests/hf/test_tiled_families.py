"""What is particular to the tiling families (InternVL, LLaVA-OneVision); the shared exactness,
checkpoint, verify and train tests run on them through tests/hf/hf_families.py.

- InternVL's unit is a tile: the tower call on many tiles equals one call per tile, so the tiles
  of one image may be encoded on different ranks; a 5-tile image at cp 4 is, exactly.
- LLaVA-OneVision's unit is an image: ``item_sizes`` equals the rows the model's own packing
  makes and the token count its processor writes, for base-only, unpadded and downsampled grids;
  images of 3 and 5 crops (one downsampled) and a multi-image sample are exact at cp 4; one
  grid is an image or a video by the kind carried beside it.
- The cost models count the matrix products of a tile / crop (torch's FLOP counter).

Tolerances: float64 relative error 1e-10 against the one-process model
(docs/architecture.md, "Exactness"); two float64 runs of the same math in another batching
agree to 1e-12.
"""

import copy
import types

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

pytest.importorskip("transformers")

from hf_families import cached_model, grad_errors  # noqa: E402
from transformers.models.llava_onevision.processing_llava_onevision import (  # noqa: E402
    LlavaOnevisionProcessor,
)

from cpvlm.hf import (  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    adapter_for,
    build_model,
    pack_documents,
    synthetic_batch,
)
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    cp_loss_and_grads,
    reference_loss_and_grads,
    rel_err,
    run_distributed,
)

CONFIGS = [("ring", "route", "scalable"), ("allgather", "allgather", "compat")]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- InternVL --------------------------------------------------------------------------------


def test_internvl_tiles_are_independent_units_and_follow_the_aspect_ratio():
    model = cached_model("internvl-tiny")
    adapter = adapter_for(model)
    # (h, w) patches -> tiles of 4 x 4 patches, + a thumbnail when more than one
    expected = {(4, 4): 1, (8, 4): 3, (4, 8): 3, (8, 8): 5, (12, 4): 4}
    batch = synthetic_batch(
        model.config, [SampleSpec(images=tuple(expected), text_len=6)], dtype=torch.float64
    )
    assert batch["image_grid_thw"].tolist() == [[n, 4, 4] for n in expected.values()]
    starts = (batch["input_ids"][0] == adapter.start_image_token_id).sum()
    assert starts == len(expected)
    assert (batch["input_ids"] == model.config.image_token_id).sum() == 4 * sum(expected.values())
    grids = batch["image_grid_thw"]
    with torch.no_grad():
        together = adapter.encode(model, batch["pixel_values"], grids)
        one_tile = torch.tensor([[1, 4, 4]])
        per_tile = [
            adapter.encode(model, rows, one_tile) for rows in batch["pixel_values"].split(16)
        ]
        # the model's own forward takes the batch (it checks tokens against its features)
        model(**adapter.to_model_batch(batch), use_cache=False)
    assert together.shape == (4 * sum(expected.values()), model.config.text_config.hidden_size)
    assert _rel(torch.cat(per_tile), together) < 1e-12


def _cp_step(rank, world_size, name, batch, doc_lens):
    base = cached_model(name)
    results = []
    for attn, vision, flow in CONFIGS:
        model = copy.deepcopy(base)
        cp_model = ContextParallelVLM(
            model, dist.group.WORLD, options=CPOptions(attn=attn, vision=vision, flow=flow)
        )
        out, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
        results.append((loss, grads if rank == 0 else None, out.encoded_units))
    return results


def _check(name, per_rank, ref_loss, ref_grads):
    for loss, grads, _ in per_rank[0]:
        assert rel_err(loss, ref_loss) <= 1e-10
        for n, err in grad_errors(name, grads, ref_grads).items():
            assert err <= 1e-10, n


def test_internvl_tiles_of_one_image_split_over_ranks_are_exact():
    model = cached_model("internvl-tiny")
    batch = synthetic_batch(
        model.config, [SampleSpec(images=((8, 8),), text_len=9)], dtype=torch.float64, seed=3
    )
    assert batch["image_grid_thw"].tolist() == [[5, 4, 4]]
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    per_rank = run_distributed(_cp_step, 4, "internvl-tiny", batch, None)
    _check("internvl-tiny", per_rank, ref_loss, ref_grads)
    # the 5 tiles of the one image: every rank encoded some
    assert sorted(r[0][2] for r in per_rank) == [1, 1, 1, 2]


# ---- LLaVA-OneVision -------------------------------------------------------------------------


def _processor_features(config, height, width):
    """The processor's own token count for an image alone (its ``_get_number_of_features``)."""
    side = config.vision_config.image_size
    fake = types.SimpleNamespace(
        image_processor=types.SimpleNamespace(image_grid_pinpoints=config.image_grid_pinpoints),
        num_image_tokens=(side // config.vision_config.patch_size) ** 2,
        vision_aspect_ratio=config.vision_aspect_ratio,
    )
    fake._get_unpadded_features = types.MethodType(
        LlavaOnevisionProcessor._get_unpadded_features, fake
    )
    return LlavaOnevisionProcessor._get_number_of_features(fake, height, width, side, side)


def test_llava_onevision_item_sizes_are_the_models_packed_rows_and_the_processors_tokens():
    model = cached_model("llava-onevision-tiny")
    adapter = adapter_for(model)
    sizes = [(32, 32), (32, 64), (64, 32), (64, 64), (40, 90), (96, 30), (50, 50), (20, 70)]
    grids = [(1 + r * c, h, w) for h, w in sizes for r, c in [adapter.crop_grid(h, w)]]
    grids.append((1, 64, 64))  # base crop only (an image of a multi-image sample)
    gen = torch.Generator().manual_seed(0)
    for grid in grids:
        pixels, rows = adapter.item_sizes(grid, "image")
        t, h, w = grid
        if t > 1:
            assert rows == _processor_features(model.config, h, w)
        crops = torch.randn(t, 3, 32, 32, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            feats = model.model.get_image_features(
                pixel_values=crops[None],
                image_sizes=torch.tensor([[h, w]]),
                batch_num_images=torch.tensor([1 if t > 1 else 2]),
                return_dict=True,
            ).pooler_output
            mine = adapter.encode(
                model, crops.reshape(-1, adapter.pixel_width), torch.tensor([grid])
            )
        assert pixels == t * 16 and feats[0].shape[0] == rows == mine.shape[0]
        assert _rel(mine, feats[0]) < 1e-12
    assert adapter.item_sizes((5, 64, 64), "image")[1] == 16 + 5 * 6  # 8 x 8 downsampled to 5 x 5
    with pytest.raises(ValueError, match="has 1 \\+ 2 x 2 crops"):
        adapter.item_sizes((3, 64, 64), "image")


def test_llava_onevision_one_grid_is_an_image_or_a_video_by_its_kind():
    """(2, 32, 32) is both a 32 x 32 image (a base crop and 1 x 1 crops) and a video of two
    32 x 32 frames: the kind beside the grid, not the grid, picks the model's packing or its
    pooling (get_image_features / get_video_features), in sizes and in rows."""
    model = cached_model("llava-onevision-tiny")
    adapter = adapter_for(model)
    grid = torch.tensor([[2, 32, 32], [2, 32, 32]])
    crops = torch.randn(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1)).double()
    with torch.no_grad():
        image = model.model.get_image_features(
            pixel_values=crops[:1], image_sizes=torch.tensor([[32, 32]]), return_dict=True
        ).pooler_output[0]
        video = model.model.get_video_features(crops[1:], return_dict=True).pooler_output[0]
        mine = adapter.encode(
            model, crops.reshape(-1, adapter.pixel_width), grid, kinds=("image", "video")
        )
    sizes = [adapter.item_sizes((2, 32, 32), k) for k in ("image", "video")]
    assert sizes == [(32, image.shape[0]), (32, 2 * 2 * 2 + 1)] and video.shape[0] == 9
    assert image.shape[0] != video.shape[0] and mine.shape[0] == image.shape[0] + video.shape[0]
    assert _rel(mine[: image.shape[0]], image) < 1e-12
    assert _rel(mine[image.shape[0] :], video) < 1e-12
    with pytest.raises(ValueError, match="its frames are one crop"):
        adapter.item_sizes((2, 32, 64), "video")


def test_llava_onevision_images_of_several_crops_are_exact_at_cp_4():
    model = cached_model("llava-onevision-tiny")
    docs = [
        SampleSpec(images=((8, 8),), text_len=7),  # 5 crops, downsampled
        SampleSpec(images=((4, 8),), text_len=5),  # 3 crops
        SampleSpec(images=((4, 4), (8, 4)), text_len=6),  # two base-only images
    ]
    parts = [
        synthetic_batch(model.config, [d], dtype=torch.float64, seed=20 + i)
        for i, d in enumerate(docs)
    ]
    for p in parts:
        p.pop("attention_mask")
    grids = [g for p in parts for g in p["image_grid_thw"].tolist()]
    assert grids == [[5, 64, 64], [3, 32, 64], [1, 32, 32], [1, 64, 32]]
    doc_lens = [p["input_ids"].shape[1] for p in parts]
    ref_loss, ref_grads = reference_loss_and_grads(model, documents=parts)
    per_rank = run_distributed(_cp_step, 4, "llava-onevision-tiny", pack_documents(parts), doc_lens)
    _check("llava-onevision-tiny", per_rank, ref_loss, ref_grads)
    assert sorted(r[0][2] for r in per_rank) == [1, 1, 1, 1]  # one image a rank


# ---- cost models -----------------------------------------------------------------------------


def _macs(fn) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        fn()
    return counter.get_total_flops() // 2


def test_cost_models_count_a_tiles_and_a_crops_matrix_products():
    # Eager attention, so that the counter sees the attention matmuls (it has no formula for the
    # CPU flash kernel); 2 FLOPs per MAC; elementwise work is not counted on either side.
    model = build_model("internvl-tiny", dtype=torch.float64, attn_implementation="eager")
    adapter = adapter_for(model)
    cost, vc = adapter.vision_cost(), model.config.vision_config
    tiles = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    got = _macs(lambda: model.model.get_image_features(pixel_values=tiles))
    # the CLS token, left out of the model (the same for every tile): its block work and pairs
    w, p = vc.hidden_size, 16
    cls = vc.num_hidden_layers * (4 * w * w + 2 * w * vc.intermediate_size + 2 * w * (2 * p + 1))
    assert got == cost.unit_cost((3, 4, 4)) + 3 * cls

    model = build_model("llava-onevision-tiny", dtype=torch.float64, attn_implementation="eager")
    adapter = adapter_for(model)
    rows = torch.randn(5 * 16, adapter.pixel_width, dtype=torch.float64)
    got = _macs(lambda: adapter.encode(model, rows, torch.tensor([[5, 64, 64]])))
    assert got == adapter.vision_cost().unit_cost((5, 64, 64))


@pytest.mark.parametrize("layer", [-2, -3, [-2, -1]])  # -3: the embeddings (2 layers)
def test_llava_onevision_feature_layers_equal_the_models_hidden_states(layer):
    """The adapter catches the feature layers with forward hooks (transformers' hidden-state
    capture returns None under FSDP2): equal to the model's own get_image_features."""
    from transformers import AutoModelForImageTextToText

    from cpvlm.families.llava_onevision import tiny_llava_onevision_config

    config = tiny_llava_onevision_config(vision_feature_layer=layer)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).double()
    adapter = adapter_for(model)
    crops = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        theirs = model.model.get_image_features(
            pixel_values=crops[None], image_sizes=torch.tensor([[32, 64]]), return_dict=True
        ).pooler_output[0]
        mine = adapter.encode(
            model, crops.reshape(-1, adapter.pixel_width), torch.tensor([[3, 32, 64]])
        )
    assert _rel(mine, theirs) < 1e-12
