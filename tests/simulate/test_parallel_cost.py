"""The EP/TP model (``cpvlm.simulate.parallel_cost``): its byte counts by hand, its TP count
against the tiny model's plan, its memory moves, and ``cpvlm plan --ep/--tp``'s checks."""

import dataclasses

import pytest

from cpvlm.simulate.parallel_cost import (
    ModelFacts,
    ep_bytes,
    model_facts,
    modelled_memory,
    tp_bytes,
)
from cpvlm.simulate.rank import RankMemory

FACTS = ModelFacts(
    hidden=8,
    layers=2,
    moe_layers=2,
    experts=4,
    top_k=2,
    heads=4,
    kv_heads=2,
    params=1000,
    expert_params=800,
    tp_params=100,
    colwise=6,
    rowwise=2,
    tp_blocks=2,
    tp_error=None,
)


def test_ep_bytes_are_the_off_rank_pairs():
    # 10 tokens x top 2, ep 2: half the 20 pairs leave, 8 bf16 values each, 2 layers, 4 passes
    e = ep_bytes(FACTS, 10, 2, checkpointing=False)
    assert e["bound"] == 2 * 4 * 10 * 8 * 2
    assert e["sent"] - e["bound"] == e["counts"] == 2 * 2 * 0.5 * 4 * 8  # int64 counts
    assert ep_bytes(FACTS, 10, 2, checkpointing=True)["bound"] == 2 * 6 * 10 * 8 * 2
    assert ep_bytes(FACTS, 10, 1, checkpointing=True)["sent"] == 0


def test_tp_bytes_per_projection_against_one_per_block():
    ring = 2 * 1 / 2 * 10 * 8 * 2  # tp 2: a ring all-reduce sends (tp-1)/tp twice
    t = tp_bytes(FACTS, 10, 2, checkpointing=False)
    assert t["all_reduces"] == 2 + 6 and t["sent"] == 8 * ring and t["bound"] == 2 * 2 * ring


def test_tiny_dense_plan_counts_five_colwise_two_rowwise_per_layer():
    from cpvlm.hf import TINY_MODELS

    config = TINY_MODELS["qwen2.5-vl-tiny"]()
    facts = model_facts(config)
    layers = config.get_text_config().num_hidden_layers
    assert (facts.colwise, facts.rowwise, facts.tp_blocks) == (5 * layers, 2 * layers, 2 * layers)
    assert facts.experts == 0 and facts.active_params == facts.params


def _memory(**kw) -> RankMemory:
    base = dict(params=400, grads=400, optimizer=800, saved=100, loss_saved=0, saved_gathered=0)
    return RankMemory(**base, peak=0, peak_fwd_bwd=1000, gathered=0, **kw)


def test_modelled_memory_moves_the_expert_bytes():
    m = _memory()
    fixed = m.params + m.grads + m.optimizer
    # ep = world: the experts' master bytes as FSDP2 shards them; only the buffers are added
    same = modelled_memory(m, FACTS, world=4, ep=4, tp=1, tokens=10)
    assert same["weights"] == fixed
    assert same["peak"] == m.steady_peak + 4 * 10 * 2 * 8 * 2
    # ep 2 of 4 ranks: half of the experts, FSDP2-sharded over their 2 replicas: 1/4 as at ep 1
    half = modelled_memory(m, FACTS, world=4, ep=2, tp=1, tokens=10)
    assert half["weights"] == fixed and half["peak"] == same["peak"]
    tp = modelled_memory(m, FACTS, world=4, ep=1, tp=2, tokens=10)
    assert tp["tp_weights_delta"] == -16 * 100 / 4 / 2 and tp["dispatch_buffers"] == 0


def test_plan_config_checks_tp_and_ep():
    from cpvlm.simulate.command import PlanConfig

    ok = dict(model="qwen3-vl-tiny", seq_len=1024, gpus=8, gpu_mem=80.0)
    assert PlanConfig(**ok, tp=(2,), cp=(2, 4, 8)).cps(2) == [2, 4]
    with pytest.raises(ValueError, match="--tp"):
        PlanConfig(**ok, tp=(3,))
    with pytest.raises(ValueError, match="--ep"):
        PlanConfig(**ok, ep=(0,))


def test_with_ep_tp_refuses_sizes_that_do_not_divide():
    from cpvlm.hf import TINY_MODELS
    from cpvlm.simulate import SequenceSpec, Setup
    from cpvlm.simulate.plan import Candidate, with_ep_tp

    config = TINY_MODELS["qwen3-vl-moe-tiny"]()  # 4 experts, 4 query / 2 key-value heads
    base = Candidate(Setup(dp=1, cp=2), dataclasses.replace(_memory(), local_len=512))
    out = with_ep_tp(config, SequenceSpec(1024), [base], [1, 2, 4], 1, 80)
    assert out[0] is base and out[1].error is None and out[1].modelled is not None
    assert "dp x cp" in out[2].error  # ep 4 of 2 ranks


def test_fsdp_traffic_shards_the_experts_over_their_replicas_under_ep():
    from cpvlm.simulate.parallel_cost import IB_BYTES_PER_S, NVLINK_BYTES_PER_S, fsdp_seconds

    # 4 ranks in a node: 2 bf16 gathers + a float32 reduce-scatter of 3/4 of what FSDP2 shards
    assert fsdp_seconds(FACTS, 4, 1, 1) == pytest.approx(8 * 1000 * 3 / 4 / NVLINK_BYTES_PER_S)
    # ep 4 of 4: one replica of each EP shard, the experts not gathered
    assert fsdp_seconds(FACTS, 4, 4, 1) == pytest.approx(8 * 200 * 3 / 4 / NVLINK_BYTES_PER_S)
    # ep 2 of 4: this rank's 400 expert parameters over their 2 replicas (2 GPUs apart), too
    experts = 8 * 800 / 2 * 1 / 2
    assert fsdp_seconds(FACTS, 4, 2, 1) == pytest.approx(
        (8 * 200 * 3 / 4 + experts) / NVLINK_BYTES_PER_S
    )
    # 32 ranks, ep 2: 16 replicas 2 GPUs apart, 4 of them in a node, 12 of 15 peers across
    dense = 8 * 200 * 31 / 32
    held = 8 * 800 / 2 * 15 / 16
    expected = max(dense * 7 / 31 / NVLINK_BYTES_PER_S, dense * 24 / 31 / IB_BYTES_PER_S)
    expected += max(held * 3 / 15 / NVLINK_BYTES_PER_S, held * 12 / 15 / IB_BYTES_PER_S)
    assert fsdp_seconds(FACTS, 32, 2, 1) == pytest.approx(expected)
