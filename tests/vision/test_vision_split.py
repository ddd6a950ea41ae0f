"""vision="split": a unit sharded across CP ranks gives the one-process tower's rows and gradients.

The real Qwen2.5-VL (windowed blocks, window reordering) and Qwen3-VL (learned position table,
deepstack) tiny towers in float64 on gloo ranks, through ``EncoderDataParallel(mode="split")``:
every rank gets the rows of the visual positions it owns (one document of all rows, head-tail),
and the loss sum over ranks of <rows, fixed random weights> back-propagates through the routing,
``cp_attention`` and the local tower. Reference: the unwrapped tower on every unit in one call.
Tolerance 1e-10: the same float64 math (the towers' float32 casts are per value, on the same
values), summed in a different order across ranks.
"""

import copy
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from cpvlm import ShardPlan  # noqa: E402
from cpvlm.encoders import EncoderDataParallel, vision_units  # noqa: E402
from cpvlm.encoders.split import Piece, SplitAttention  # noqa: E402
from cpvlm.hf import adapter_for, build_model  # noqa: E402
from cpvlm.hf.vision_attention import SplitTower  # noqa: E402
from cpvlm.options import (
    AttentionOptions,  # noqa: E402
    CPOptions,  # noqa: E402
)
from cpvlm.testing import rel_err, run_distributed  # noqa: E402

FAMILIES = ("qwen2.5-vl-tiny", "qwen3-vl-tiny")
# (name, grids, ranks): the grids in patches; what each case shows is in the test below.
CASES = {
    2: [("one image", [(1, 8, 12)])],
    3: [("one image", [(1, 8, 12)]), ("mix", [(1, 4, 4), (1, 8, 12), (1, 4, 8), (1, 8, 4)])],
    4: [
        ("one image", [(1, 8, 12)]),
        ("video", [(1, 4, 4), (2, 8, 8)]),
        ("two groups", [(1, 2, 4)]),  # 2 merge groups over 4 ranks: two ranks hold nothing
    ],
}

_towers: dict = {}


def _tower(name):
    if name not in _towers:
        model = build_model(name, dtype=torch.float64)
        _towers[name] = (adapter_for(model), model)
    return _towers[name]


def _inputs(adapter, grids, seed):
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids)
    patches = int(grid.prod(dim=1).sum())
    pixels = torch.randn(patches, adapter.pixel_width, generator=gen, dtype=torch.float64)
    rows = patches // adapter.merge_size**2
    return grid, pixels, rows, gen


def _weights(gen, rows, widths):
    return [torch.randn(rows, d, generator=gen, dtype=torch.float64) for d in widths]


def _as_list(out):
    return [out[0], *out[1]] if isinstance(out, tuple) else [out]


def _reference(name, grids, seed):
    adapter, base = _tower(name)
    model = copy.deepcopy(base)
    tower = adapter.vision_tower(model)
    grid, pixels, rows, gen = _inputs(adapter, grids, seed)
    outs = _as_list(adapter.encode(model, pixels, grid))
    weights = _weights(gen, rows, [o.shape[1] for o in outs])
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    return outs, {n: p.grad.clone() for n, p in tower.named_parameters()}


def _split_rank(rank, world, name, grids, seed, attn="ring", local=False):
    adapter, base = _tower(name)
    model = copy.deepcopy(base)
    tower = adapter.vision_tower(model)
    grid, pixels, rows, gen = _inputs(adapter, grids, seed)
    vdp = EncoderDataParallel(
        SplitTower(adapter, model),
        dist.group.WORLD,
        mode="split",
        merge_size=adapter.merge_size,
        cost=adapter.vision_cost(),
        attention=AttentionOptions(attn),
    )
    plan = ShardPlan(rows, world)
    positions = plan.padded_index
    units = vision_units(grid, adapter.merge_size)
    if local:  # only the rows of the units this rank reads, as a loader decodes them
        pixels = pixels[units.pixel_index(vdp.pixel_assignment(units)[rank])]
    outs, encoded = vdp(
        pixels,
        grid,
        plan=plan,
        row_positions=positions,
        local_pixels=local,
        with_unit_count=True,
    )
    outs = _as_list(outs)
    owner, local = plan.locate(positions)
    mine = torch.nonzero(owner == rank).squeeze(1)
    mine = mine[torch.argsort(local[mine])]
    weights = _weights(gen, rows, [o.shape[1] for o in outs])
    sum((o * w[mine]).sum() for o, w in zip(outs, weights)).backward()
    grads = {}
    for n, p in tower.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        grads[n] = g
    sa = vdp.split_assignment(units)
    return {
        "pixel_rows": pixels.shape[0],
        "rows": [o.detach() for o in outs],
        "mine": mine,
        "grads": grads if rank == 0 else None,
        "encoded": encoded,
        "split": sa.split,
        "pieces": len(sa.pieces(rank)),
    }


def _cases_rank(rank, world, cases):
    return [_split_rank(rank, world, *case) for case in cases]


def _case_list(world):
    """(family, grids, seed, attn, local) of every case; ring and all-gather K/V alternate, and
    Qwen2.5-VL (windowed, its patches reordered) reads only its units' pixels (local_pixels)."""
    cases = []
    for name in FAMILIES:
        for _, grids in CASES[world]:
            i = len(cases)
            local = name == "qwen2.5-vl-tiny"
            cases.append((name, grids, i, "allgather" if i % 2 else "ring", local))
    return cases


@pytest.mark.parametrize("world", sorted(CASES))
def test_split_tower_matches_one_process_tower(world):
    cases = _case_list(world)
    per_rank = run_distributed(_cases_rank, world, cases, timeout=240)
    labels = [label for _ in FAMILIES for label, _ in CASES[world]]
    for i, (case, label) in enumerate(zip(cases, labels)):
        name, grids, seed = case[:3]
        ref_rows, ref_grads = _reference(name, grids, seed)
        results = [r[i] for r in per_rank]
        assert len(results[0]["rows"]) == (3 if name == "qwen3-vl-tiny" else 1)  # deepstack
        for res in results:
            for got, want in zip(res["rows"], ref_rows):
                assert rel_err(got, want[res["mine"]]) <= 1e-10, (name, label)
        for n, g in ref_grads.items():
            assert rel_err(results[0]["grads"][n], g) <= 1e-10, (name, label, n)
            assert g.abs().sum() > 0, (name, label, n)  # every parameter took part
        # What each case is about.
        units = vision_units(torch.tensor(grids), 2)
        split = results[0]["split"]
        rows = [r["pixel_rows"] for r in results]
        if case[4]:  # a rank reads its whole units and the units it holds pieces of
            assert sum(rows) < world * units.pixel_offsets[-1] or split == tuple(range(len(grids)))
        else:
            assert rows == [units.pixel_offsets[-1]] * world
        if label == "one image":
            assert split == (0,) and all(r["pieces"] == 1 for r in results)
        elif label == "mix":
            assert split == (1,) and units.num_units == 4  # the 8x12 image sharded, 3 whole
        elif label == "video":
            assert split == (1, 2)  # both 8x8 frames sharded, the 4x4 image whole
        else:
            assert split == (0,) and [r["encoded"] for r in results].count(0) == 2


def _bad_inputs_rank(rank, world):
    from cpvlm.hf import ContextParallelVLM

    adapter, base = _tower("qwen3-vl-tiny")
    model = copy.deepcopy(base)
    grid, pixels, rows, _ = _inputs(adapter, [(1, 8, 12)], 0)
    vdp = EncoderDataParallel(
        SplitTower(adapter, model), dist.group.WORLD, mode="split", cost=adapter.vision_cost()
    )
    plan = ShardPlan(rows, world)
    errors = []
    for case in ("one rank short", "local pixels short", "glm"):
        try:
            if case == "glm":
                ContextParallelVLM(
                    build_model("glm4v-tiny"), dist.group.WORLD, options=CPOptions(vision="split")
                )
            else:
                pix = pixels[:-1] if case != "glm" and rank == 1 else pixels
                vdp(
                    pix,
                    grid,
                    plan=plan,
                    row_positions=plan.padded_index,
                    local_pixels=case == "local pixels short",
                )
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_bad_input_raises_the_same_error_on_every_rank():
    per_rank = run_distributed(_bad_inputs_rank, 2, timeout=120)
    assert per_rank[0] == per_rank[1]
    short, local, glm = per_rank[0]
    assert "rank 1" in short and "pixel_values has 95 rows but the grids have 96" in short
    assert "rank 1" in local and "with local_pixels this rank's units [0] have 96" in local
    assert "vision='split' is not supported for glm4v" in glm
    assert "supported vision modes: ['route', 'allgather', 'replicate']" in glm


def test_a_tower_that_does_not_take_a_precomputed_table_raises(monkeypatch):
    """A transformers whose tower computes its own position table from the grid it is given (not
    the whole unit's: a placeholder) must fail, not give silently different rows."""
    adapter, base = _tower("qwen3-vl-tiny")
    tower = copy.deepcopy(base)
    module = sys.modules[type(tower).__module__]
    own = module.get_vision_interpolation_indices_and_weights
    monkeypatch.setattr(
        module,
        "get_vision_interpolation_indices_and_weights",
        lambda *args, kwargs=None, **kw: own(*args, **kw),  # ignores the precomputed keywords
    )
    grid, pixels, _, _ = _inputs(adapter, [(1, 8, 12)], 0)
    pieces = (Piece(0, (1, 8, 12), torch.arange(96)),)
    attention = SplitAttention((96,), None, None, None, 0, None)
    with pytest.raises(ValueError, match=r"did not take the precomputed \['interp_indices', 'in"):
        SplitTower(adapter, tower).encode_local(pixels, pieces, attention)
