"""A value that differs on one rank only: every rank raises the same error, quickly, no hang.

Each case makes one rank's input wrong in a way only that rank can see (a tower that returns a
row too few, rows that disagree with ``counts``, a wrong local length given to ``cp_attention``)
or gives the ranks inputs that disagree (counts, plans). Before the agreement of
``cpvlm.distributed.collectives.agree`` the wrong rank raised alone and the others waited in the
collective until the process-group timeout (30 minutes). Every rank catches its error and
returns the message and the seconds it took; the cases run one after another on the same ranks,
so a case that hung would stop the run at the timeout.
"""

import time

import pytest
import torch
import torch.distributed as dist

from cpvlm import ShardPlan, cp_attention, gather_embeddings
from cpvlm.distributed.collectives import StepAgreement, agree
from cpvlm.encoders import EncoderDataParallel
from cpvlm.options import CPOptions
from cpvlm.testing import run_distributed
from cpvlm.testing.toy_tower import ToyVisionTower

MERGE = 2
GRIDS = [[1, 4, 4], [1, 2, 4], [1, 2, 2]]  # 4 + 2 + 1 rows, one or two units per rank
LIMIT_S = 10.0


class _ShortOnRank(torch.nn.Module):
    """A tower that drops its last output row on one rank only."""

    def __init__(self, tower, rank):
        super().__init__()
        self.tower, self.rank = tower, rank

    def forward(self, pixels, grid_thw):
        main, deep = self.tower(pixels, grid_thw)
        if dist.get_rank() == self.rank:
            return main[:-1], [d[:-1] for d in deep]
        return main, deep


def _vision_inputs(world_size):
    torch.manual_seed(0)
    tower = ToyVisionTower(merge_size=MERGE, deepstack=(0,)).double()
    grids = torch.tensor(GRIDS)
    pixels = torch.randn(int(grids.prod(-1).sum()), tower.pixel_dim, dtype=torch.float64)
    rows = int((grids.prod(-1) // MERGE**2).sum())
    plan = ShardPlan(rows + 5, world_size)
    positions = plan.padded_index[torch.arange(2, 2 + rows)]
    return tower, grids, pixels, plan, positions


def _cases(rank, world):
    """name -> a call that must raise on every rank."""
    bad = world - 1  # the one rank that is wrong
    tower, grids, pixels, plan, positions = _vision_inputs(world)
    short = _ShortOnRank(tower, bad)
    x = torch.zeros(3, 4, dtype=torch.float64)
    q_plan = ShardPlan(16, world)
    q = torch.zeros(1, 2, q_plan.local_len + (rank == bad), 8, dtype=torch.float64)
    ok_q = torch.zeros(1, 2, q_plan.local_len, 8, dtype=torch.float64)
    return {
        "gather: rows differ from counts": lambda: gather_embeddings(
            x[: 3 - (rank == bad)], [3] * world, dist.group.WORLD
        ),
        "gather: counts differ": lambda: gather_embeddings(
            x, [3 + (rank == bad)] + [3] * (world - 1), dist.group.WORLD
        ),
        "route: the tower returns a row too few": lambda: EncoderDataParallel(
            short, dist.group.WORLD, mode="route", merge_size=MERGE
        )(pixels, grids, plan=plan, row_positions=positions),
        "allgather: the tower returns a row too few": lambda: EncoderDataParallel(
            short, dist.group.WORLD, mode="allgather", merge_size=MERGE
        )(pixels, grids),
        "cp_attention: a wrong local length": lambda: cp_attention(
            q, ok_q, ok_q, plan=q_plan, group=dist.group.WORLD
        ),
        "cp_attention: the plans differ": lambda: cp_attention(
            ok_q,
            ok_q,
            ok_q,
            # Two documents whose padding gives the same local length: only the plans differ.
            plan=q_plan
            if rank != bad
            else ShardPlan(16, world, doc_lens=[2 * world, 16 - 2 * world]),
            group=dist.group.WORLD,
        ),
    }


def _diverge(rank, world_size):
    out = {}
    for name, call in _cases(rank, world_size).items():
        start = time.monotonic()
        try:
            call()
            out[name] = (None, time.monotonic() - start)
        except ValueError as err:
            out[name] = (str(err), time.monotonic() - start)
    return out


EXPECTED = {  # every rank's message contains these; {bad} is the wrong rank, {w} the world
    "gather: rows differ from counts": [
        "rank {bad} of {w}: gather_embeddings: tensor 0 has 2 rows but counts says 3"
    ],
    "gather: counts differ": ["gather_embeddings: the ranks", "different counts", "(4, 3"],
    "route: the tower returns a row too few": [
        "rank {bad} of {w}: EncoderDataParallel: encoder output 0 has shape",
        "is merge_size right?",
    ],
    "allgather: the tower returns a row too few": [
        "rank {bad} of {w}: EncoderDataParallel: encoder output 0 has shape"
    ],
    "cp_attention: a wrong local length": [
        "rank {bad} of {w}: cp_attention: q has",
        "gives each rank local_len=",
    ],
    "cp_attention: the plans differ": ["cp_attention: the ranks", "different plan", "(16,)"],
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_value_wrong_on_one_rank_raises_the_same_error_on_every_rank(world_size):
    per_rank = run_distributed(_diverge, world_size, timeout=120)
    for name, fragments in EXPECTED.items():
        messages = [r[name][0] for r in per_rank]
        assert messages[0] is not None, f"{name}: no error"
        assert all(m == messages[0] for m in messages), (name, messages)
        for fragment in fragments:
            assert fragment.format(bad=world_size - 1, w=world_size) in messages[0], (
                name,
                messages[0],
            )
        slowest = max(r[name][1] for r in per_rank)
        assert slowest < LIMIT_S, (name, slowest)


def _count_agreements(rank, world_size, attn, vision):
    """All-reduces of the agreement (three int64s) in one ContextParallelVLM forward."""
    from cpvlm.hf import ContextParallelVLM, SampleSpec, build_model, synthetic_batch

    model = build_model("qwen3-vl-tiny", dtype=torch.float64)
    cp_model = ContextParallelVLM(
        model, dist.group.WORLD, options=CPOptions(attn=attn, vision=vision)
    )
    batch = synthetic_batch(
        model.config, [SampleSpec(images=((4, 4),), text_len=30)], dtype=torch.float64
    )
    seen = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if tensor.dtype == torch.int64 and tensor.numel() == 3:
            seen.append(1)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        cp_model(**batch).loss.backward()
    finally:
        dist.all_reduce = real
    return len(seen), model.config.text_config.num_hidden_layers


@pytest.mark.parametrize("vision", ["route", "replicate"])
def test_one_agreement_per_forward_however_many_layers(vision):
    for count, layers in run_distributed(_count_agreements, 2, "ring", vision):
        assert layers >= 2 and count == 1, (count, layers)


def _step_agreement_carries_a_local_error(rank, world_size):
    step = StepAgreement({"plan": (world_size, (16,))})
    if rank == 1:
        step.fail("the tower returned 3 rows, expected 4")
    try:
        agree("route_to_owners", dist.group.WORLD, {"rows": 4}, step=step)
    except ValueError as err:
        return str(err), step.agreed
    return None, step.agreed


def test_an_error_recorded_before_the_first_collective_is_raised_everywhere():
    results = run_distributed(_step_agreement_carries_a_local_error, 2)
    assert [r[0] for r in results] == ["rank 1 of 2: the tower returned 3 rows, expected 4"] * 2
    assert [r[1] for r in results] == [False, False]


def _divergent_batches(rank, world_size):
    """ContextParallelVLM under FSDP2 (tower and decoder layers as units, sharded over the CP
    ranks), one case per vision mode: the last rank alone is handed a batch with one pixel row
    too few (it finds it before the tower runs, while the others enter the tower's parameter
    all-gather); in replicate mode also a tower that returns one row too few on that rank."""
    from cpvlm.hf import ContextParallelVLM, SampleSpec, build_model, synthetic_batch
    from cpvlm.parallelize import build_mesh, mesh_groups, parallelize

    bad = world_size - 1
    mesh = build_mesh(dp_shard=1, cp=world_size)
    groups = mesh_groups(mesh)
    out = {}
    for case in (
        "route",
        "allgather",
        "split",
        "replicate",
        "replicate: the tower returns a row too few",
    ):
        vision = case.split(":")[0]
        model = build_model("qwen3-vl-tiny", dtype=torch.float64)
        cp_model = ContextParallelVLM(model, groups.cp_group, options=CPOptions(vision=vision))
        units = [*model.model.language_model.layers, model.model.visual]
        runner = parallelize(cp_model, mesh, groups=groups, fsdp_units=units)
        spec = SampleSpec(images=((4, 4), (2, 4)), text_len=30)
        batch = synthetic_batch(model.config, [spec], dtype=torch.float64)
        if ":" in case:
            if rank == bad:
                model.model.visual.register_forward_hook(_drop_a_row)
        elif rank == bad:
            batch["pixel_values"] = batch["pixel_values"][:-1]
        start = time.monotonic()
        try:
            runner(**batch).loss.backward()
            out[case] = (None, time.monotonic() - start)
        except ValueError as err:
            out[case] = (str(err), time.monotonic() - start)
    return out


def _drop_a_row(module, args, output):
    output.pooler_output = output.pooler_output[:-1]
    return output


def test_a_batch_invalid_on_one_cp_rank_raises_everywhere_under_fsdp():
    world = 2
    per_rank = run_distributed(_divergent_batches, world, timeout=180)
    for case in per_rank[0]:
        messages = [r[case][0] for r in per_rank]
        assert messages[0] is not None, f"{case}: no error"
        assert all(m == messages[0] for m in messages), (case, messages)
        if "tower" in case:
            want = f"rank {world - 1} of {world}: ContextParallelVLM: the vision tower returned"
        else:
            want = f"rank {world - 1} of {world}: image pixel values have shape"
        assert messages[0].startswith(want), (case, messages[0])
        slowest = max(r[case][1] for r in per_rank)
        assert slowest < LIMIT_S, (case, slowest)
