"""Data planning split over DP, and the deal of a step's rows by modelled cost.

The reference is one process playing every rank with every sample planned on each (no exchange):
the split paths (metas from the source; planning split over real gloo ranks) must hand every rank
exactly those rows, while each sample is planned once per CP slice.
"""

import json
import pickle
import random

import pytest
import torch

from cpvlm.data import LoaderConfig, RankLoader, RowStream, TokenIds, plan_tokenized
from cpvlm.data.balance import RowCost, deal_bound, dp_deal, max_over_mean, plan_split
from cpvlm.data.exchange import DPExchange, pack_plans, unpack_plans
from cpvlm.data.meta import SampleMeta
from cpvlm.data.packing import dp_split
from cpvlm.data.sources import JsonlSource, ObjectSource
from cpvlm.hf import TINY_MODELS, row_cost
from cpvlm.testing import run_distributed
from cpvlm.train.synthetic import SyntheticVLMData

CONFIG = TINY_MODELS["qwen3-vl-tiny"]()
IDS = TokenIds.from_config(CONFIG)
SEQ_LEN, WINDOW, SAMPLES = 256, 16, 60
COST = row_cost(CONFIG)


class MetaSource(ObjectSource):
    """Tokenized samples that know their sizes (what a prepared cache offers)."""

    def meta(self, index):
        raw = self.items[index]
        grids = {k: tuple(tuple(g) for g in raw[k].tolist()) for k in raw if k.endswith("grid_thw")}
        return SampleMeta(
            raw["input_ids"].numel(),
            grids.get("image_grid_thw", ()),
            grids.get("video_grid_thw", ()),
        )


class CostedSource(ObjectSource):
    """Tokenized samples with an estimated planning cost that differs tenfold between them."""

    def plan_cost(self, index):
        raw = self.items[index]
        return raw["input_ids"].numel() + 2000 * sum(k.endswith("grid_thw") for k in raw)


def _samples():
    data = SyntheticVLMData(CONFIG, seed=2)
    return [data[i] for i in range(SAMPLES)]


def _plan(record):
    return plan_tokenized(record.data, IDS, record.index, record.where)


def _loader(source, dp, d, *, exchange=None, state=None, balance="cost", rows=4):
    stream = RowStream(source, _plan, seq_len=SEQ_LEN, window=WINDOW, seed=7)
    config = LoaderConfig(rows_per_step=rows, dp_rank=d, dp_size=dp, balance=balance)
    return RankLoader(
        stream, lambda item, t: None, IDS, config, state=state, row_cost=COST, exchange=exchange
    )


def _rows(loader, n):
    out = []
    for _ in range(n):
        out.append(
            [(r.input_ids.tolist(), r.doc_lens, [e.line() for e in r.errors])
             for r in loader.next_step()]
        )  # fmt: skip
    return out


def _split_ranks(rank, world, samples, dp, steps):
    """On gloo rank ``rank``: dp x (world / dp) ranks, cp innermost; planning split over DP."""
    import torch.distributed as dist

    cp = world // dp
    slices = [dist.new_group(list(range(c, world, cp)), backend="gloo") for c in range(cp)]
    exchange = DPExchange(slices[rank % cp])
    loader = _loader(CostedSource(samples, "x"), dp, rank // cp, exchange=exchange, rows=8 // dp)
    return _rows(loader, steps), loader.stream.plan_calls, loader.state_dict()


def _with_bad_samples():
    samples = _samples()
    samples[3] = {"input_ids": torch.tensor([20, IDS.image, 21])}  # no grid: vision_token_mismatch
    samples[40] = {"input_ids": torch.tensor([20, 21]), "pixels": 0}  # unknown key: bad_record
    return samples


def test_split_planning_over_gloo_ranks_gives_every_rank_the_reference_rows():
    """dp 4 and dp 2 x cp 2 on four gloo ranks: each rank gets the rows (and bad-sample
    reports) of the reference that plans everything, the DP ranks' rows together are the step's,
    and each window read was planned once per CP slice, each rank planning the share that the
    deal by estimated cost gives it."""
    samples, steps = _with_bad_samples(), 5
    source = CostedSource(samples, "x")
    whole = _rows(_loader(source, 1, 0, rows=2 * 4), steps)
    for dp in (4, 2):
        got = run_distributed(_split_ranks, 4, samples, dp, steps, timeout=300)
        cp = 4 // dp
        for rank, (rows, _, state) in enumerate(got):
            ref = _loader(source, dp, rank // cp, rows=8 // dp)
            assert rows == _rows(ref, steps), f"rank {rank} at dp {dp}"
            assert state == ref.state_dict()
        for k in range(steps):  # complementary deals: the step's rows, each once
            rows = [r[:2] for rank in range(0, 4, cp) for r in got[rank][0][k]]
            assert sorted(rows) == sorted(r[:2] for r in whole[k]), (dp, k)
        state = got[0][2]
        windows = state["window"] + (state["row"] > 0)
        for c in range(cp):
            assert sum(got[rank][1] for rank in range(c, 4, cp)) == windows * WINDOW, (dp, c)
        stream = _loader(source, dp, 0).stream
        for rank, (_, calls, _) in enumerate(got):
            shares = [
                plan_split(stream.plan_costs(list(range(w * WINDOW, (w + 1) * WINDOW))), dp)
                for w in range(windows)
            ]
            assert calls == sum(len(s[rank // cp]) for s in shares), (dp, rank)
        assert len({got[rank][1] for rank in range(0, 4, cp)}) > 1  # not stripes: by cost
    assert any(r[2] for step in whole for r in step)  # the bad samples were reported


def test_metas_from_the_source_plan_each_sample_once_and_keep_the_rows():
    """With ``source.meta`` nothing is planned to size a window: a rank plans only its own rows'
    samples (per-rank plan calls fall as 1/dp), and the rows are the reference's."""
    samples = _samples()
    plain, metas = ObjectSource(samples, "x"), MetaSource(samples, "x")
    steps, totals = 4, {}
    for dp in (1, 2, 4):
        ranks = [_loader(metas, dp, d, rows=8 // dp) for d in range(dp)]
        for d in range(dp):
            rows = _rows(ranks[d], steps)
            assert rows == _rows(_loader(plain, dp, d, rows=8 // dp), steps), (dp, d)
            docs = sum(len(r[1]) for step in rows for r in step)
            assert ranks[d].stream.plan_calls == docs, (dp, d)  # its own rows' samples only
        totals[dp] = sum(r.stream.plan_calls for r in ranks)
    assert totals[1] == totals[2] == totals[4]  # the same samples, each planned once


def test_deal_is_the_same_on_every_rank_and_resume_at_another_dp_keeps_the_samples():
    """The rows of a step are the next R * dp of the stream whatever dp is: resuming a dp 1 run
    at dp 2 and dp 4 trains the same samples, step for step, as the dp 1 run."""
    samples = _samples()
    source = MetaSource(samples, "x")
    straight = _loader(source, 1, 0, rows=4)
    seen = [sorted(map(tuple, (r[0] for r in step))) for step in _rows(straight, 5)]
    first = _loader(source, 1, 0, rows=4)
    _rows(first, 2)
    state = first.state_dict()
    for dp in (2, 4):
        ranks = [_loader(source, dp, d, state=state, rows=4 // dp) for d in range(dp)]
        for k in range(2, 5):
            got = [r for loader in ranks for r in _rows(loader, 1)[0]]
            assert sorted(tuple(r[0]) for r in got) == seen[k], (dp, k)


def test_plan_split_deals_a_window_by_estimated_cost():
    """Equal costs: the stripes d, d + dp, ...; tenfold differences: every sample once, the
    costliest rank within one sample of the mean (longest first), and better than the stripes."""
    assert plan_split([1] * 10, 4) == [list(range(d, 10, 4)) for d in range(4)]
    rng = random.Random(3)
    for dp in (2, 4, 8, 16):
        costs = [rng.choice([12, 40, 60, 110]) + rng.randint(0, 9) for _ in range(64)]
        shares = plan_split(costs, dp)
        assert sorted(i for s in shares for i in s) == list(range(64))
        assert shares == plan_split(list(costs), dp)
        loads = [sum(costs[i] for i in s) for s in shares]
        assert max(loads) <= sum(costs) / dp + max(costs), (dp, loads)
        stripes = [sum(costs[d::dp]) for d in range(dp)]
        assert max(loads) <= max(stripes), (dp, loads, stripes)


def test_jsonl_plan_cost_ranks_videos_over_images_over_text(tmp_path):
    msg = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    img = [{"role": "user", "content": [{"type": "image", "image": "a.jpg"}]}]
    vid = [{"role": "user", "content": [{"type": "video", "video": "v"}]}]
    two = [{"role": "user", "content": [{"type": "image", "image": "a.jpg"}] * 2}]
    records = [{"messages": m} for m in (msg, vid, img, two)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    source = JsonlSource(path)
    costs = [source.plan_cost(i) for i in range(4)]
    assert costs[0] < costs[2] < costs[3] < costs[1], costs


def test_packed_plans_unpack_to_the_same_plans():
    plans = {p: _plan(ObjectSource(_samples(), "x")[p]) for p in (0, 5)}
    got = unpack_plans(pickle.loads(pickle.dumps(pack_plans(plans))))
    for p, plan in plans.items():
        assert torch.equal(got[p].input_ids, plan.input_ids)
        assert torch.equal(got[p].labels, plan.labels)
        assert got[p].input_ids.dtype == plan.input_ids.dtype
        assert [it.grid for it in got[p].images] == [it.grid for it in plan.images]


def _long_tailed_costs(rng, rows):
    """Row costs of a long-tailed mix: full rows of short chats, a few rows holding a video."""
    chat = [COST.sample(SampleMeta(rng.randint(200, 400), ((1, 8, 8),))) for _ in range(rows * 8)]
    out = [sum(chat[8 * r : 8 * r + 8]) for r in range(rows)]
    for r in rng.sample(range(rows), 3):
        out[r] = COST.sample(SampleMeta(2500, (), ((8, 16, 16),))) + chat[8 * r]
    return out


def test_cost_deal_reaches_the_bound_and_beats_the_token_deal():
    rng = random.Random(0)
    for dp, per_rank in ((8, 8), (4, 8), (2, 16), (8, 4)):
        costs = _long_tailed_costs(rng, dp * per_rank)
        tokens = [1] * len(costs)  # full rows: the token deal sees no difference
        shares = dp_deal(costs, dp)
        assert sorted(i for s in shares for i in s) == list(range(len(costs)))
        assert all(len(s) == per_rank for s in shares)
        assert shares == dp_deal(list(costs), dp)  # a pure function of the costs
        bound, ratio = deal_bound(costs, dp), max_over_mean(costs, shares)
        assert bound <= ratio <= bound + 0.01, (dp, per_rank, ratio, bound)
        if bound <= 1.03:
            assert ratio <= 1.05, (dp, per_rank, ratio, bound)
        assert ratio < max_over_mean(costs, dp_split(tokens, dp))


def test_deal_bound_is_below_the_best_deal_and_the_deal_near_it():
    """Exhaustive over small steps: bound <= the best deal <= dp_deal, dp_deal within 10%."""
    from itertools import combinations

    def best(costs, dp, per_rank, left=None):
        left = sorted(range(len(costs))) if left is None else left
        if not left:
            return 0
        first, rest = left[0], left[1:]  # the rank holding the first row left, then the others
        return min(
            max(sum(costs[i] for i in (first, *mine)), best(costs, dp, per_rank, [
                i for i in rest if i not in mine]))
            for mine in combinations(rest, per_rank - 1)
        )  # fmt: skip

    rng = random.Random(1)
    for _ in range(30):
        dp, per_rank = rng.choice([(2, 2), (2, 3), (3, 2), (3, 3), (4, 2)])
        costs = [
            rng.choice([rng.randint(1, 30), rng.randint(50, 100)]) for _ in range(dp * per_rank)
        ]
        mean = sum(costs) / dp
        optimum = best(costs, dp, per_rank) / mean
        got = max_over_mean(costs, dp_deal(costs, dp))
        assert deal_bound(costs, dp) <= optimum + 1e-12 <= got + 2e-12, (costs, dp)
        assert got <= 1.1 * optimum, (costs, dp, got, optimum)
        if per_rank == 2:  # two rows a rank: the deal is the optimum
            assert abs(got - optimum) <= 1e-12, (costs, dp, got, optimum)


def test_two_rows_a_rank_are_paired_costliest_with_cheapest():
    """At R = 2 the lowest top load pairs the k-th costliest row with the k-th cheapest (the
    exchange argument); the deal must reach it on long-tailed steps at dp 8 and 16."""
    rng = random.Random(2)
    for _ in range(40):
        dp = rng.choice([8, 16])
        costs = _long_tailed_costs(rng, 2 * dp)
        top = sorted(costs, reverse=True)
        optimum = max(top[k] + top[2 * dp - 1 - k] for k in range(dp))
        shares = dp_deal(costs, dp)
        assert max(sum(costs[i] for i in s) for s in shares) == optimum, (dp, costs)


def test_row_cost_counts_decoder_attention_and_vision():
    text = SampleMeta(100)
    image = SampleMeta(100, ((1, 8, 8),))
    assert COST.sample(text) == COST.token * 100 + COST.pair * 5050
    assert COST.sample(image) - COST.sample(text) == COST.vision.unit_cost((1, 8, 8))
    assert COST.sample(text, 50) == COST.token * 50 + COST.pair * 1275  # cut to seq_len
    with pytest.raises(ValueError, match="RowCost.token"):
        RowCost(token=-1, pair=1)
    with pytest.raises(ValueError, match="balance must be one of"):
        _loader(ObjectSource(_samples(), "x"), 1, 0, balance="patches")
