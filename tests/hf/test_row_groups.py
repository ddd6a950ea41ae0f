"""Dynamic CP's row groups: one ContextParallelVLM runs each row on the block group it is given.

At cp 4 (float64, real gloo ranks) a step of two rounds: in the first, rows on a block of 2 ranks
and on two blocks of 1 at once; in the second, a packed row on all 4. The sum over ranks of every
round's loss shares and gradients must be the sum of transformers' one-process steps on each row
alone (rows' own token means), relative error <= 1e-10: float64 round-off, as every CP exactness
test (tests/hf/test_hf_context_parallel.py). Images, a video and deepstack (qwen3-vl-tiny), and
linear attention passing its state over a block's ranks (qwen3.5-tiny).
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import cached_model, grad_errors  # noqa: E402

from cpvlm import CPOptions  # noqa: E402
from cpvlm.hf import ContextParallelVLM, SampleSpec, synthetic_batch  # noqa: E402
from cpvlm.parallelize import build_mesh, mesh_groups  # noqa: E402
from cpvlm.parallelize.row_groups import row_groups  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    mixed_batch,
    packed_documents,
    reference,
    rel_err,
    run_distributed,
    summed_gradients,
)

TIMEOUT = 600  # s; seconds on an idle 2-core machine, minutes when it is shared
# (batch kind, CP size, block) per round: every rank in exactly one job of each round
ROUNDS = [
    [("mixed", 2, 0), ("single", 1, 2), ("text", 1, 3)],
    [("packed", 4, 0)],
]


def _batch(model, kind):
    if kind == "packed":
        packed, _, doc_lens = packed_documents(model, torch.float64)
        return packed, doc_lens
    if kind == "mixed":
        return mixed_batch(model, torch.float64), None
    specs = {
        "single": [SampleSpec(images=((4, 4),), text_len=60)],
        "text": [SampleSpec(text_len=23), SampleSpec(text_len=17)],
    }[kind]
    return synthetic_batch(model.config, specs, dtype=torch.float64, seed=2), None


def _dynamic_step(rank, world_size, name, configs):
    base = cached_model(name)
    mesh = build_mesh(dp_replicate=1, dp_shard=1, cp=world_size, device_type="cpu")
    groups = mesh_groups(mesh)
    blocks = row_groups(groups)
    results = []
    for attn, vision, flow in configs:
        model = copy.deepcopy(base)
        options = CPOptions(attn=attn, vision=vision, flow=flow)
        cp_model = ContextParallelVLM(model, groups.cp_group, options=options, row_groups=blocks)
        loss = torch.zeros((), dtype=torch.float64)
        sizes = []
        for jobs in ROUNDS:
            kind, size, _ = next(j for j in jobs if j[2] * j[1] <= rank < (j[2] + 1) * j[1])
            batch, doc_lens = _batch(base, kind)
            out = cp_model(**batch, doc_lens=doc_lens, cp_size=size)
            out.loss.backward()
            loss += out.loss.detach()
            sizes.append(cp_model._row.size)
        dist.all_reduce(loss)
        grads = summed_gradients(cp_model.model)
        results.append({"loss": loss, "grads": grads if rank == 0 else None, "sizes": sizes})
    return results


@pytest.mark.parametrize(
    "name, configs",
    [
        ("qwen3-vl-tiny", [("ring", "route", "scalable"), ("allgather", "allgather", "compat")]),
        ("qwen3.5-tiny", [("ring", "route", "scalable")]),
    ],
)
def test_rows_on_block_groups_match_one_process_float64(name, configs):
    model = cached_model(name)
    ref_loss, ref_grads = 0.0, {}
    for kind in sorted({j[0] for jobs in ROUNDS for j in jobs}):
        loss, grads = reference(model, *_batch(model, kind))
        ref_loss += loss
        for n, g in grads.items():
            ref_grads[n] = ref_grads.get(n, 0) + g
    per_rank = run_distributed(_dynamic_step, 4, name, configs, timeout=TIMEOUT)
    assert [r[0]["sizes"] for r in per_rank] == [[2, 4], [2, 4], [1, 4], [1, 4]]
    for result in per_rank[0]:
        assert rel_err(result["loss"], ref_loss) <= 1e-10
        errors = grad_errors(name, result["grads"], ref_grads)
        assert errors and max(errors.values()) <= 1e-10, max(errors.items(), key=lambda e: e[1])


def _bad_size(rank, world_size):
    model = copy.deepcopy(cached_model("qwen3-vl-tiny"))
    mesh = build_mesh(dp_replicate=1, dp_shard=1, cp=world_size, device_type="cpu")
    groups = mesh_groups(mesh)
    cp_model = ContextParallelVLM(model, groups.cp_group, row_groups=row_groups(groups))
    batch, _ = _batch(cached_model("qwen3-vl-tiny"), "text")
    with pytest.raises(ValueError, match=r"cp_size=3 is not one of this module's row CP sizes"):
        cp_model(**batch, cp_size=3)
    with pytest.raises(ValueError, match="row_groups size 3 does not divide the CP size 4"):
        ContextParallelVLM(copy.deepcopy(model), groups.cp_group, row_groups={3: groups.cp_group})
    return cp_model.row_sizes


def test_row_sizes_must_be_those_of_its_groups():
    assert run_distributed(_bad_size, 4, timeout=TIMEOUT) == [[1, 2, 4]] * 4
