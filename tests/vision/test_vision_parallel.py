"""EncoderDataParallel around a small tower on real gloo ranks, against the one-process tower.

The tower (cpvlm.testing.toy_tower) has a Conv3d patch embedding, attention within each frame, a 2x2
merger and a deepstack tap, like the Qwen-VL towers. The reference encodes every item whole
(videos as one grid) on one process; the wrapped runs split videos into frames across ranks.
"""

import re

import pytest
import torch
import torch.distributed as dist

from cpvlm import ShardPlan
from cpvlm.encoders import EncoderDataParallel, assign_units, vision_units
from cpvlm.testing import rel_err, run_distributed
from cpvlm.testing.toy_tower import ToyVisionTower

MERGE = 2
# Images of different sizes and two videos (t = 3 and t = 2): 8 units.
GRIDS = [[1, 4, 6], [3, 2, 4], [1, 2, 2], [1, 6, 4], [2, 4, 4]]
TOL = 1e-10  # float64: the same ops on the same rows, only summation order may differ


def _tower(dtype=torch.float64):
    torch.manual_seed(0)
    return ToyVisionTower(merge_size=MERGE, deepstack=(0,)).to(dtype)


def _pixels(grids, width):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, width, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _layout(grids, world_size):
    """One packed sequence of two documents: 3 text tokens before each item, 2 at the end."""
    positions, cursor = [], 0
    for t, h, w in grids:
        cursor += 3
        rows = t * h * w // MERGE**2
        positions += range(cursor, cursor + rows)
        cursor += rows
    seq_len = cursor + 2
    doc_lens = [seq_len // 2, seq_len - seq_len // 2]
    plan = ShardPlan(seq_len, world_size, doc_lens=doc_lens)
    return plan, plan.padded_index[torch.tensor(positions, dtype=torch.long)]


def _upstream(n, d, seed):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grads(module):
    return {k: (None if p.grad is None else p.grad.clone()) for k, p in module.named_parameters()}


def _wrapped_step(rank, world_size, grids, mode, dtype=torch.float64, out_dims=None):
    tower = _tower(dtype)
    vdp = EncoderDataParallel(
        tower,
        dist.group.WORLD,
        mode=mode,
        merge_size=MERGE,
        out_dims=out_dims,
        dtype=dtype if out_dims else None,
    )
    grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    pixels = _pixels(grids, tower.pixel_dim).to(dtype).requires_grad_()
    if mode == "route":
        plan, row_positions = _layout(grids, world_size)
        main, deep = vdp(pixels, grid_thw, plan=plan, row_positions=row_positions)
        # Rank-dependent upstream: the gradient at the positions this rank holds.
        slots = vdp_local_positions(plan, row_positions, rank)
        weights = [_upstream(plan.padded_len, main.shape[1], 10 + i)[slots] for i in range(2)]
    else:
        main, deep = vdp(pixels, grid_thw)
        weights = [_upstream(main.shape[0], main.shape[1], 20 + 2 * rank + i) for i in range(2)]
    loss = (main.double() * weights[0]).sum() + (deep[0].double() * weights[1]).sum()
    loss.backward()
    return main.detach(), deep[0].detach(), _grads(tower), pixels.grad


def vdp_local_positions(plan, row_positions, rank):
    """Padded positions of this rank's visual rows in local (shard) order."""
    mine = plan.indices(rank)
    return mine[torch.isin(mine, row_positions)]


def _reference(grids, mode, world_size):
    tower = _tower()
    grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    pixels = _pixels(grids, tower.pixel_dim).requires_grad_()
    main, deep = tower(pixels, grid_thw)
    if mode == "route":
        plan, row_positions = _layout(grids, world_size)
        w = [_upstream(plan.padded_len, main.shape[1], 10 + i)[row_positions] for i in range(2)]
        loss = (main * w[0]).sum() + (deep[0] * w[1]).sum()
    else:
        loss = 0
        for r in range(world_size):  # every rank's loss term, on one process
            w = [_upstream(main.shape[0], main.shape[1], 20 + 2 * r + i) for i in range(2)]
            loss = loss + (main * w[0]).sum() + (deep[0] * w[1]).sum()
    loss.backward()
    return main.detach(), deep[0].detach(), _grads(tower), pixels.grad


def _check_against_reference(results, grids, mode, world_size, tol=TOL):
    ref_main, ref_deep, ref_grads, ref_pixel_grad = _reference(grids, mode, world_size)
    for rank, (main, deep, _, _) in enumerate(results):
        if mode == "route":
            plan, row_positions = _layout(grids, world_size)
            slots = vdp_local_positions(plan, row_positions, rank)
            order = [row_positions.tolist().index(p) for p in slots.tolist()]
            ref_m, ref_d = ref_main[order], ref_deep[order]
        else:
            ref_m, ref_d = ref_main, ref_deep
        assert rel_err(main, ref_m) <= tol and rel_err(deep, ref_d) <= tol
    # Each rank computed the gradient of its own units; their sum is the one-process gradient.
    # A missing gradient (None) is a zero one: no image touched that parameter.
    for name, p in _tower().named_parameters():
        expected = ref_grads[name] if ref_grads[name] is not None else torch.zeros_like(p)
        total = sum((r[2][name].double() for r in results if r[2][name] is not None), 0 * expected)
        assert rel_err(total, expected) <= tol, name
    pixel_grad = sum(r[3].double() for r in results if r[3] is not None)
    assert rel_err(torch.zeros_like(ref_pixel_grad) + pixel_grad, ref_pixel_grad) <= tol


@pytest.mark.parametrize("mode", ["allgather", "route"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_wrapped_tower_matches_the_one_process_tower(world_size, mode):
    results = run_distributed(_wrapped_step, world_size, GRIDS, mode)
    _check_against_reference(results, GRIDS, mode, world_size)


def test_a_video_split_across_ranks_equals_encoding_it_whole():
    units = vision_units(torch.tensor([[4, 4, 2]]), MERGE)
    per_rank = assign_units(units.pixel_counts, 4)
    assert per_rank == [[0], [1], [2], [3]]  # one frame per rank
    for mode in ("allgather", "route"):
        results = run_distributed(_wrapped_step, 4, [[4, 4, 2]], mode)
        _check_against_reference(results, [[4, 4, 2]], mode, 4)


@pytest.mark.parametrize("mode", ["allgather", "route"])
@pytest.mark.parametrize(
    "world_size, grids",
    [
        (4, [[1, 2, 2]]),  # more ranks than units
        (2, [[1, 4, 2]]),  # all units on one rank; in route mode the other rank owns rows
        (3, []),  # no images anywhere
    ],
    ids=["more-ranks-than-units", "all-on-one-rank", "no-images"],
)
def test_empty_ranks(world_size, grids, mode):
    results = run_distributed(_wrapped_step, world_size, grids, mode)
    _check_against_reference(results, grids, mode, world_size)
    # The dummy frame gives every rank zero (not missing) tower gradients: DDP/FSDP see the
    # same gradients on every rank.
    assert all(g is not None for r in results for g in r[2].values())


def test_empty_ranks_with_declared_out_dims():
    results = run_distributed(_wrapped_step, 3, [[1, 2, 4]], "allgather", out_dims=(12, 12))
    _check_against_reference(results, [[1, 2, 4]], "allgather", 3)
    assert all(g is None for r in results[1:] for g in r[2].values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_placeholders_take_the_towers_dtype(dtype):
    grids = [[1, 4, 4]]  # one unit, cp 3: two empty ranks send placeholders
    results = run_distributed(_wrapped_step, 3, grids, "allgather", dtype)
    assert all(r[0].dtype == dtype and r[1].dtype == dtype for r in results)
    # Against float64, the tower itself rounds at the dtype's epsilon (fp32 2^-24, fp16 2^-11,
    # bf16 2^-8): observed worst output/gradient errors are 4e-7, 1.7e-3 and 1.5e-2; the bounds
    # leave >= 6x margin. The collectives add one rounding of the summed upstream gradient.
    tol = {torch.float64: TOL, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-1}
    _check_against_reference(results, grids, "allgather", 3, tol[dtype])


def _frozen_and_no_grad(rank, world_size, grids, mode):
    tower = _tower().requires_grad_(False)
    vdp = EncoderDataParallel(tower, dist.group.WORLD, mode=mode, merge_size=MERGE)
    grid_thw = torch.tensor(grids)
    pixels = _pixels(grids, tower.pixel_dim)
    kwargs = {}
    if mode == "route":
        plan, row_positions = _layout(grids, world_size)
        kwargs = {"plan": plan, "row_positions": row_positions}
    main, deep = vdp(pixels, grid_thw, **kwargs)
    # A frozen tower in grad mode: every rank's rows require grad, every rank joins the backward.
    assert main.requires_grad and deep[0].requires_grad
    (main.sum() + deep[0].sum()).backward()
    with torch.no_grad():
        main_eval, deep_eval = vdp(pixels, grid_thw, **kwargs)
    assert not main_eval.requires_grad
    return main.detach(), main_eval, all(p.grad is None for p in tower.parameters())


@pytest.mark.parametrize("mode", ["allgather", "route"])
def test_frozen_tower_and_no_grad_evaluation(mode):
    grids = [[1, 2, 2], [2, 2, 4]]
    for main, main_eval, no_grads in run_distributed(_frozen_and_no_grad, 4, grids, mode):
        assert torch.equal(main, main_eval) and no_grads


def _bad_call(rank, world_size, case):
    tower = _tower()
    if case == "wrong merge size":  # the tower merges 2x2: 4x fewer rows than promised
        vdp = EncoderDataParallel(tower, dist.group.WORLD, mode="allgather", merge_size=1)
        grids = [[1, 2, 4], [1, 2, 4]]  # a unit on each rank
        return _message(vdp, _pixels(grids, tower.pixel_dim), torch.tensor(grids))
    vdp = EncoderDataParallel(tower, dist.group.WORLD, mode="route", merge_size=MERGE)
    grids = [[1, 2, 4], [1, 2, 2]]
    pixels = _pixels(grids, tower.pixel_dim)
    plan, row_positions = _layout(grids, world_size)
    kwargs = {"plan": plan, "row_positions": row_positions}
    if case == "grid not divisible":
        grids = [[1, 3, 4], [1, 1, 2]]
    elif case == "pixel rows":
        pixels = pixels[:-1]
    elif case == "row positions":
        kwargs["row_positions"] = row_positions[:-1]
    elif case == "no plan":
        kwargs = {}
    return _message(vdp, pixels, torch.tensor(grids), **kwargs)


def _message(vdp, *args, **kwargs):
    try:
        vdp(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "case, message",
    [
        ("grid not divisible", "divisible by the merge size 2"),
        ("pixel rows", "pixel_values has 11 rows but the grids have 12 patches"),
        ("row positions", "2 row_positions for 3 encoder rows"),
        ("no plan", "needs plan= and row_positions="),
        ("wrong merge size", r"expected \d+ rows .* is merge_size right"),
    ],
)
def test_bad_input_raises_on_every_rank(case, message):
    messages = run_distributed(_bad_call, 2, case)
    assert all(m and re.search(message, m) for m in messages), messages


def test_units_carry_their_items_kind_and_are_sized_by_it():
    """Every unit has its item's kind (a video's frames too), and a tower's sizes see it: the
    same grid is sized one way as an image and another as a video."""

    def sizes(grid, kind):
        t, h, w = grid
        return t * h * w, (t * h * w // MERGE**2) + (1 if kind == "video" else 0)

    grids = torch.tensor([[1, 4, 4], [2, 4, 4], [2, 4, 4]])
    units = vision_units(grids, MERGE, kinds=("image", "video", "image"))
    assert units.kinds == ("image", "video", "video", "image", "image")
    assert units.kinds_of([4, 1]) == ("image", "video")
    whole = vision_units(
        grids, MERGE, split_frames=False, sizes=sizes, kinds=("image", "video", "image")
    )
    assert whole.kinds == ("image", "video", "image")
    assert whole.row_counts == [4, 9, 8]  # (2, 4, 4): 8 rows as an image, 8 + 1 as a video
    assert vision_units(grids, MERGE).kinds == ("image",) * 5  # no kinds: images
    for bad in (("image", "video"), ("image", "sound", "image")):
        with pytest.raises(ValueError, match="kinds must be 3 of"):
            vision_units(grids, MERGE, kinds=bad)
