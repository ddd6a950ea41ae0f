"""vision="split": a rank decodes only its pieces' pixel rows of a sharded unit.

The rows a piece decoder makes equal the whole frame's rows at those groups bit for bit (images
through the Qwen-VL PIL image processor, video frames through the video pipeline, the loader's
rows of a row), and a split step whose ranks pass only those rows (``local_pixels``) equals the
one-process model in float64 (1e-10) at cp 2 and 3, for the pixel-order tower (Qwen3-VL) and
the window-order one (Qwen2.5-VL, whose pieces are scattered groups in pixel order).
"""

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from cpvlm.data import Record  # noqa: E402
from cpvlm.data.loader import select_groups  # noqa: E402
from cpvlm.encoders import vision_units  # noqa: E402
from cpvlm.encoders.pieces import pixel_rows_read  # noqa: E402
from cpvlm.families.qwen2_vl import image_piece_rows  # noqa: E402
from cpvlm.hf import (  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    adapter_for,
    build_model,
    synthetic_batch,
)
from cpvlm.hf.data.processor import ChatEncoder  # noqa: E402
from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint, write_frames  # noqa: E402
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.testing import rel_err, run_distributed  # noqa: E402
from cpvlm.verify import reference_loss_and_grads  # noqa: E402


def _rows_of(groups, m2=4):
    return (torch.tensor(groups).unsqueeze(1) * m2 + torch.arange(m2)).reshape(-1)


def _group_sets(num_groups: int, width_groups: int):
    """A first group, a middle third, the last group, and scattered groups (window order)."""
    scattered = sorted({1, width_groups + 1, num_groups - 2} & set(range(num_groups)))
    return [
        (0,),
        tuple(range(num_groups // 3, max(num_groups // 3 + 1, 2 * num_groups // 3))),
        (num_groups - 1,),
        tuple(scattered),
    ]


def test_image_piece_rows_equal_the_whole_images_rows():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    ip = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32 * 4,
        max_pixels=32 * 32 * 48,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    # up- and down-scaled, odd aspect, one merged row high
    for h, w in [(100, 170), (333, 250), (20, 300), (640, 480)]:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        full = ip(images=[image], return_tensors="pt")
        grid = tuple(int(v) for v in full["image_grid_thw"][0])
        num_groups, wg = grid[1] * grid[2] // 4, grid[2] // 2
        for groups in _group_sets(num_groups, wg):
            piece = image_piece_rows(ip, image, grid, groups)
            assert torch.equal(piece, full["pixel_values"][_rows_of(groups)]), (h, w, groups)
        # a grid that the resize does not give: no band path (the whole path reports it)
        assert image_piece_rows(ip, image, (1, grid[1] + 2, grid[2]), (0,)) is None


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")
    return ChatEncoder(path, AutoConfig.from_pretrained(path))


def test_decoding_pieces_gives_the_whole_decodes_rows(encoder, tmp_path):
    """Through ``ChatEncoder.decode(item, temporal, groups)``: an image and the temporal patches
    of a video, some in part and some whole, equal the whole decode's rows."""
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (90, 130, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    write_frames(tmp_path / "clip", 6, 70, 90, seed=2)
    content = [{"type": "image", "image": "a.png"}, {"type": "video", "video": "clip"}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "x"}]
    plan = encoder.plan(Record(0, "t", {"messages": messages}, tmp_path))
    (image,), (video,) = plan.images, plan.videos
    m = encoder.ids.merge
    for item in (image, video):
        _, h, w = item.grid
        num_groups, wg = h * w // (m * m), w // m
        whole = encoder.decode(item, None)
        temporal = list(range(item.grid[0]))
        for groups in _group_sets(num_groups, wg):
            asked = {temporal[-1]: groups}  # the last temporal patch in part, the others whole
            rows = encoder.decode(item, temporal, asked)
            assert torch.equal(rows, select_groups(whole, temporal, asked, m)), (item.kind, groups)
            assert rows.shape[0] < whole.shape[0]


# ---- a split step from pieces' rows only ----------------------------------------------------------

FAMILIES = ("qwen3-vl-tiny", "qwen2.5-vl-tiny")
_models: dict = {}


def _model(name):
    if name not in _models:
        _models[name] = build_model(name, dtype=torch.float64, seed=0)
    return _models[name]


def _batch(model):
    # the large image and video frames are sharded; the small image is a whole unit
    samples = [
        SampleSpec(images=((14, 22),), text_len=12),
        SampleSpec(images=((4, 4),), videos=((2, 10, 12),), text_len=10),
    ]
    return synthetic_batch(model.config, samples, dtype=torch.float64, seed=3)


def _pieces_only(cp_model, batch, rank, merge):
    """This rank's pixel rows as a loader that decodes pieces gives them."""
    grids = torch.cat([batch["image_grid_thw"], batch["video_grid_thw"]])
    units = vision_units(grids, merge)
    mine = cp_model.vision_assignment(units)[rank]
    groups = cp_model.vision_pieces(units)[rank]
    read = pixel_rows_read(units, mine, groups)
    pixels = torch.cat([batch["pixel_values"], batch["pixel_values_videos"]])
    n_images = batch["pixel_values"].shape[0]
    local = {**batch, "local_pixels": True}
    local["pixel_values"] = pixels[read[read < n_images]]
    local["pixel_values_videos"] = pixels[read[read >= n_images]]
    whole = sum(units.pixel_counts[u] for u in mine)
    return local, len(read), whole


def _split_rank(rank, world):
    results = {}
    for name in FAMILIES:
        model = copy.deepcopy(_model(name))
        m = adapter_for(model).merge_size
        cp_model = ContextParallelVLM(
            model, dist.group.WORLD, options=CPOptions(attn="ring", vision="split")
        )
        local, read, whole = _pieces_only(cp_model, _batch(model), rank, m)
        out = cp_model(**local)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {}
        for n, p in model.named_parameters():
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
            dist.all_reduce(g)
            grads[n] = g
        results[name] = {
            "loss": loss, "grads": grads if rank == 0 else None, "read": read, "whole": whole,
        }  # fmt: skip
    return results


@pytest.mark.timeout(900)  # two families' spawns; minutes on a loaded 2-core machine
@pytest.mark.parametrize("world", [2, 3])
def test_split_step_from_pieces_rows_matches_the_one_process_model(world):
    per_rank = run_distributed(_split_rank, world, timeout=600)
    for name in FAMILIES:
        ref_loss, ref_grads = reference_loss_and_grads(_model(name), _batch(_model(name)))
        result = per_rank[0][name]
        # every rank read fewer rows than whole units would have it read, together no more
        # rows than the batch has
        assert all(r[name]["read"] < r[name]["whole"] for r in per_rank), name
        total = sum(r[name]["read"] for r in per_rank)
        batch = _batch(_model(name))
        assert total == batch["pixel_values"].shape[0] + batch["pixel_values_videos"].shape[0]
        assert rel_err(result["loss"], ref_loss) <= 1e-10, name
        for n, g in ref_grads.items():
            assert rel_err(result["grads"][n], g) <= 1e-10, (name, n)


def test_the_loader_decodes_only_the_pieces_rows(encoder, tmp_path):
    """A ``RankLoader`` given ``pieces``: each CP rank's pixel rows are exactly the rows it
    reads (``pixel_rows_read``) of the full decode, and some rank holds a piece."""
    from cpvlm.data import LoaderConfig, RankLoader, RowStream, open_source
    from cpvlm.encoders import split_assignment
    from cpvlm.encoders.pieces import piece_groups
    from cpvlm.encoders.split import pixel_order
    from cpvlm.hf.tiny_checkpoint import example_records, write_jsonl

    jsonl = write_jsonl(tmp_path / "train.jsonl", example_records(tmp_path, 16, seed=4))
    source, cp = open_source(str(jsonl)), 3

    def split(units):
        return split_assignment(units.pixel_counts, units.row_counts, cp)

    def assign(units):
        return [split(units).units_of(r) for r in range(cp)]

    def pieces(units):
        orders = [pixel_order(n) for n in units.row_counts]
        return [piece_groups(orders, split(units), r) for r in range(cp)]

    def loader(c, decode_mode="local", **kw):
        stream = RowStream(source, encoder.plan, seq_len=192, window=8, seed=5)
        config = LoaderConfig(cp_rank=c, cp_size=cp, decode_mode=decode_mode)
        return RankLoader(stream, encoder.decode, encoder.ids, config, **kw)

    ranks = [loader(c, assign=assign, pieces=pieces) for c in range(cp)]
    full, sharded = loader(0, decode_mode="all"), 0
    for _ in range(4):
        (ref,), rows = full.next_step(), [r.next_step()[0] for r in ranks]
        if not ref.has_vision:
            continue
        units = vision_units(ref.grid_thw, encoder.ids.merge)
        keys = [k for k in ("pixel_values", "pixel_values_videos") if k in ref.media]
        whole = torch.cat([ref.media[k] for k in keys])
        for c, row in enumerate(rows):
            read = pixel_rows_read(units, assign(units)[c], pieces(units)[c])
            assert torch.equal(torch.cat([row.media[k] for k in keys]), whole[read])
        sharded += len(split(units).split)
    assert sharded > 0
