"""FSDP2, HSDP, DDP and a manual sync over dp x cp on real gloo ranks, against one process.

The model here is per-token (no attention), so that the data-parallel sync and the loss are tested
on their own; test_parallelize_causal_lm.py adds cp_attention. Tolerance: float64, shares summed in
another order than the reference mean: 1e-10 relative (observed ~1e-16).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from cpvlm import ShardPlan, pad_and_shard
from cpvlm.loss import IGNORE_INDEX, count_valid_labels, token_mean_loss
from cpvlm.parallelize import build_mesh, mesh_groups, parallelize, sync_gradients
from cpvlm.testing import rel_err, run_distributed

VOCAB, DIM, SEQ = 16, 8, 10


class TokenLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(DIM, DIM, dtype=torch.float64) for _ in range(2)
        )
        self.head = torch.nn.Linear(DIM, VOCAB, dtype=torch.float64)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def global_batch(dp, cp, scenario):
    """Two microbatches of [dp * 2, SEQ] ids and pre-shifted labels, identical on every process.

    "uneven": microbatches with different valid counts, the valid labels spread unevenly over the
    ranks, and the (dp 1, cp 0) rank without any valid label in either microbatch.
    "empty": no valid label anywhere in the step.
    """
    g = torch.Generator().manual_seed(7)
    plan = ShardPlan(SEQ, cp)
    microbatches = []
    for keep in (0.3, 0.8):
        ids = torch.randint(0, VOCAB, (dp * 2, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (dp * 2, SEQ), generator=g)
        labels[torch.rand(dp * 2, SEQ, generator=g) > keep] = IGNORE_INDEX
        if scenario == "empty":
            labels[:] = IGNORE_INDEX
        elif dp > 1:
            # dp rank 1 holds rows 2..3; clear the real positions CP rank 0 owns.
            owned = plan.padded_index[plan.owners[plan.padded_index] == 0]
            labels[2:4, plan.source_index[owned]] = IGNORE_INDEX
        microbatches.append((ids, labels))
    return microbatches


def _grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name.removeprefix("module.")] = g.full_tensor() if isinstance(g, DTensor) else g.clone()
    return out


def _step(rank, world_size, mode, sizes, scenario, sync_last_only, dtype=torch.float64):
    dp_replicate, dp_shard, cp = sizes
    torch.manual_seed(0)
    model = TokenLM().to(dtype)
    mesh = build_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp)
    groups = mesh_groups(mesh)
    model = parallelize(model, mesh, data_parallel=mode, groups=groups, fsdp_units=model.layers)
    dp = dp_replicate * dp_shard
    rows = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
    mine = [(ids[rows], labels[rows]) for ids, labels in global_batch(dp, cp, scenario)]
    n = count_valid_labels([labels for _, labels in mine], groups.dp_group)
    plan = ShardPlan(SEQ, cp)
    loss_sum = torch.zeros((), dtype=dtype)
    local_counts = []
    for i, (ids, labels) in enumerate(mine):
        last = i == len(mine) - 1
        if sync_last_only and mode in ("fsdp", "hsdp"):
            model.set_requires_gradient_sync(last)
        loc = pad_and_shard({"input_ids": ids, "labels": labels}, plan, groups.cp_rank)
        local_counts.append(int((loc["labels"] != IGNORE_INDEX).sum()))
        if sync_last_only and mode == "ddp" and not last:
            with model.no_sync():
                loss = token_mean_loss(model(loc["input_ids"]), loc["labels"], n)
                loss.backward()
        else:
            loss = token_mean_loss(model(loc["input_ids"]), loc["labels"], n)
            loss.backward()
        assert torch.isfinite(loss)
        loss_sum += loss.detach()
    if mode == "none":
        sync_gradients(model, groups)
    dist.all_reduce(loss_sum, group=groups.grad_sync_group)
    return loss_sum, _grads(model), n, local_counts


def _reference(dp, cp, scenario):
    torch.manual_seed(0)
    model = TokenLM()
    microbatches = global_batch(dp, cp, scenario)
    ids = torch.cat([i.reshape(-1) for i, _ in microbatches])
    labels = torch.cat([lab.reshape(-1) for _, lab in microbatches])
    n = int((labels != IGNORE_INDEX).sum())
    loss = F.cross_entropy(model(ids), labels, ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, n


@pytest.mark.parametrize(
    "mode, sizes, sync_last_only",
    [
        ("fsdp", (1, 2, 2), False),
        ("hsdp", (2, 1, 2), True),
        ("ddp", (1, 2, 2), True),
        ("ddp", (1, 1, 3), False),  # W = 3: DDP's mean is not a power of two
        ("none", (2, 1, 2), False),
        ("fsdp", (1, 1, 4), True),
        ("hsdp", (1, 3, 1), False),
    ],
)
def test_loss_and_every_grad_match_one_process(mode, sizes, sync_last_only):
    dp, cp = sizes[0] * sizes[1], sizes[2]
    results = run_distributed(_step, dp * cp, mode, sizes, "uneven", sync_last_only, timeout=90)
    ref_loss, ref_grads, ref_n = _reference(dp, cp, "uneven")
    counts = [c for _, _, _, c in results]
    if dp > 1 and cp > 1:
        assert counts[cp] == [0, 0]  # dp rank 1, cp rank 0: no valid label in the step
        assert len({tuple(c) for c in counts}) == len(counts)  # spread unevenly
    for loss, grads, n, _ in results:
        assert n == ref_n
        assert rel_err(loss, ref_loss) <= 1e-10
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert rel_err(g, ref_grads[name]) <= 1e-10, name


@pytest.mark.parametrize("mode, sizes", [("fsdp", (1, 2, 2)), ("hsdp", (2, 1, 2))])
def test_float32_on_gloo(mode, sizes):
    """float32 reductions: FSDP2 would pick PreMulSum for a divide factor of 1, which gloo lacks."""
    results = run_distributed(_step, 4, mode, sizes, "uneven", False, torch.float32, timeout=90)
    ref_loss, ref_grads, _ = _reference(2, 2, "uneven")
    for loss, grads, _, _ in results:
        # float32 against the float64 reference through a 3-layer tanh MLP: ~1e-7 observed.
        assert loss.dtype == torch.float32 and rel_err(loss, ref_loss) <= 1e-5
        for name, g in grads.items():
            assert g.dtype == torch.float32 and rel_err(g, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "ddp"])
def test_a_step_without_valid_labels_gives_zero_loss_and_zero_grads(mode):
    sizes = (2, 1, 2) if mode == "hsdp" else (1, 2, 2)
    results = run_distributed(_step, 4, mode, sizes, "empty", False, timeout=90)
    for loss, grads, n, _ in results:
        assert n == 0 and loss.item() == 0.0
        for g in grads.values():
            assert torch.equal(g, torch.zeros_like(g))


def _count_two_ways(rank, world_size, sizes):
    """count_valid_labels on full labels over DP, and on CP shards over dp x cp."""
    mesh = build_mesh(dp_replicate=sizes[0], dp_shard=sizes[1], cp=sizes[2])
    groups = mesh_groups(mesh)
    dp, cp = sizes[0] * sizes[1], sizes[2]
    rows = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
    mine = [labels[rows] for _, labels in global_batch(dp, cp, "uneven")]
    plan = ShardPlan(SEQ, cp)
    shards = [plan.shard(plan.pad(lab, value=IGNORE_INDEX), groups.cp_rank) for lab in mine]
    return (
        count_valid_labels(mine, groups.dp_group),
        count_valid_labels(shards, groups.grad_sync_group),
        (groups.dp_rank, groups.cp_rank),
    )


@pytest.mark.parametrize("sizes", [(1, 2, 2), (2, 1, 2), (1, 1, 3), (3, 1, 1)])
def test_counting_full_labels_over_dp_equals_counting_shards_over_dp_x_cp(sizes):
    dp, cp = sizes[0] * sizes[1], sizes[2]
    expected = sum(int((lab != IGNORE_INDEX).sum()) for _, lab in global_batch(dp, cp, "uneven"))
    results = run_distributed(_count_two_ways, dp * cp, sizes)
    assert all(full == sharded == expected for full, sharded, _ in results)
    # Ranks are laid out (dp_replicate, dp_shard, cp), cp innermost.
    assert [coords for _, _, coords in results] == [(r // cp, r % cp) for r in range(dp * cp)]
