"""A small causal LM with cp_attention, trained one step on DP=2 x CP=2 (4 gloo ranks) with FSDP2,
HSDP and DDP: the loss and every parameter gradient equal the one-process step on the global batch.

The step has 2 accumulation microbatches with different valid counts, packed documents (labels
shifted within each), valid labels spread unevenly over the ranks and one rank without any.
Tolerance: float64; the CP path sums attention blocks and loss shares in another order than the
reference, a few ulps per operation: 1e-10 relative (observed ~1e-15).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from cpvlm import ShardPlan, pad_and_shard
from cpvlm.attention import cp_attention
from cpvlm.loss import IGNORE_INDEX, count_valid_labels, shift_labels, token_mean_loss
from cpvlm.parallelize import build_mesh, mesh_groups, parallelize
from cpvlm.testing import rel_err, run_distributed

VOCAB, DIM, HEADS, KV_HEADS, MAX_POS = 24, 16, 4, 2, 32
DOC_LENS = [7, 6]  # two packed documents per row
SEQ = sum(DOC_LENS)
ROWS = 2  # rows per DP rank and microbatch


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        f64 = {"dtype": torch.float64}
        self.norm1 = nn.LayerNorm(DIM, **f64)
        self.q = nn.Linear(DIM, DIM, **f64)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * (DIM // HEADS), **f64)
        self.o = nn.Linear(DIM, DIM, **f64)
        self.norm2 = nn.LayerNorm(DIM, **f64)
        self.mlp = nn.Sequential(
            nn.Linear(DIM, 2 * DIM, **f64), nn.GELU(), nn.Linear(2 * DIM, DIM, **f64)
        )

    def forward(self, x_BSD, attend):
        b, s, _ = x_BSD.shape
        hd = DIM // HEADS
        h = self.norm1(x_BSD)
        q_BHSD = self.q(h).view(b, s, HEADS, hd).transpose(1, 2)
        k_BSHD, v_BSHD = self.kv(h).view(b, s, 2, KV_HEADS, hd).unbind(2)
        out_BHSD = attend(q_BHSD, k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2))
        x_BSD = x_BSD + self.o(out_BHSD.transpose(1, 2).reshape(b, s, DIM))
        return x_BSD + self.mlp(self.norm2(x_BSD))


class CausalLM(nn.Module):
    """Embedding, learned positions, 2 blocks, head. CP when given a plan, else one process."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.pos = nn.Embedding(MAX_POS, DIM, dtype=torch.float64)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, dtype=torch.float64)

    def forward(self, input_ids, position_ids, plan=None, cp_rank=0, group=None):
        if plan is None:
            attend = _reference_attention
        else:

            def attend(q, k, v):
                return cp_attention(q, k, v, plan=plan, cp_rank=cp_rank, group=group)

        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x)


def _reference_attention(q_BHSD, k_BHSD, v_BHSD):
    """Causal attention within each document of DOC_LENS, GQA expanded: plain SDPA math."""
    doc = torch.repeat_interleave(torch.arange(len(DOC_LENS)), torch.tensor(DOC_LENS))
    pos = torch.arange(SEQ)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    rep = HEADS // KV_HEADS
    k_BHSD, v_BHSD = (t.repeat_interleave(rep, dim=1) for t in (k_BHSD, v_BHSD))
    return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask=allowed)


def global_batch(dp, cp, scenario):
    """Two microbatches of [dp * ROWS, SEQ] ids, position ids and shifted labels."""
    g = torch.Generator().manual_seed(3)
    plan = ShardPlan(SEQ, cp, doc_lens=DOC_LENS)
    positions = torch.cat([torch.arange(n) for n in DOC_LENS]).expand(dp * ROWS, SEQ)
    microbatches = []
    for keep in (0.4, 0.9):
        ids = torch.randint(0, VOCAB, (dp * ROWS, SEQ), generator=g)
        raw = ids.clone()
        raw[torch.rand(dp * ROWS, SEQ, generator=g) > keep] = IGNORE_INDEX  # prompt / image tokens
        labels = shift_labels(raw, doc_lens=DOC_LENS)
        if scenario == "empty":
            labels[:] = IGNORE_INDEX
        elif dp > 1 and cp > 1:
            # DP rank 1 (rows ROWS..2*ROWS) loses every label on the positions CP rank 0 owns.
            owned = plan.padded_index[plan.owners[plan.padded_index] == 0]
            labels[ROWS : 2 * ROWS, plan.source_index[owned]] = IGNORE_INDEX
        microbatches.append((ids, positions.clone(), labels))
    return microbatches


def _step(rank, world_size, mode, sizes, scenario):
    dp_replicate, dp_shard, cp = sizes
    torch.manual_seed(0)
    model = CausalLM()
    mesh = build_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp)
    groups = mesh_groups(mesh)
    model = parallelize(model, mesh, data_parallel=mode, groups=groups, fsdp_units=model.blocks)
    rows = slice(ROWS * groups.dp_rank, ROWS * (groups.dp_rank + 1))
    mine = [
        tuple(t[rows] for t in mb) for mb in global_batch(dp_replicate * dp_shard, cp, scenario)
    ]
    n = count_valid_labels([labels for _, _, labels in mine], groups.dp_group)
    plan = ShardPlan(SEQ, cp, doc_lens=DOC_LENS)
    loss_sum = torch.zeros((), dtype=torch.float64)
    local_counts = []
    for ids, positions, labels in mine:
        batch = {"input_ids": ids, "position_ids": positions, "labels": labels}
        loc = pad_and_shard(batch, plan, groups.cp_rank)
        local_counts.append(int((loc["labels"] != IGNORE_INDEX).sum()))
        logits = model(
            loc["input_ids"],
            loc["position_ids"],
            plan=plan,
            cp_rank=groups.cp_rank,
            group=groups.cp_group,
        )
        loss = token_mean_loss(logits, loc["labels"], n)
        loss.backward()  # every microbatch syncs: exact, since the sync is a sum
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum, group=groups.grad_sync_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        grads[name.removeprefix("module.")] = g
    return loss_sum, grads, local_counts


def _reference(dp, cp):
    torch.manual_seed(0)
    model = CausalLM()
    microbatches = global_batch(dp, cp, "uneven")
    ids, positions, labels = (torch.cat(ts) for ts in zip(*microbatches))
    logits = model(ids, positions)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "mode, sizes", [("fsdp", (1, 2, 2)), ("hsdp", (2, 1, 2)), ("ddp", (1, 2, 2))]
)
def test_dp2_cp2_step_equals_one_process(mode, sizes):
    results = run_distributed(_step, 4, mode, sizes, "uneven", timeout=120)
    ref_loss, ref_grads = _reference(2, 2)
    counts = [c for _, _, c in results]
    assert counts[2] == [0, 0]  # dp rank 1, cp rank 0 holds no valid label in the step
    mb_counts = [count_valid_labels(labels) for _, _, labels in global_batch(2, 2, "uneven")]
    assert mb_counts[0] != mb_counts[1]  # microbatches of different valid counts
    assert len({tuple(c) for c in counts}) == 4  # spread unevenly over the ranks
    for loss, grads, _ in results:
        assert rel_err(loss, ref_loss) <= 1e-10
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert rel_err(g, ref_grads[name]) <= 1e-10, name


def test_a_step_without_valid_labels_is_zero_not_nan_and_does_not_hang():
    results = run_distributed(_step, 4, "fsdp", (1, 2, 2), "empty", timeout=120)
    for loss, grads, counts in results:
        assert counts == [0, 0] and loss.item() == 0.0
        for g in grads.values():
            assert torch.equal(g, torch.zeros_like(g))
