"""``cpvlm plan --dynamic-cp``: the long-tailed mixes, the job times of a real config (counted on
the meta device), and static against dynamic CP at cp 8 / 16 / 64."""

import json

import pytest

from cpvlm.data.dynamic_cp import plan_rounds, row_size
from cpvlm.simulate.dynamic_cp import MIXES, compare, job_times, text_mix, video_mix


@pytest.fixture(scope="module")
def tiny():
    from cpvlm.hf import TINY_MODELS

    return TINY_MODELS["qwen3-vl-tiny"]()


def test_mixes_are_long_tailed_and_fixed():
    text = text_mix(131072, 64)
    lengths = sorted(m.tokens for m in text)
    assert len(text) == 64 and lengths[-1] == 131072
    assert lengths[32] < 131072 // 16  # the median row is a small share of the longest
    assert text == text_mix(131072, 64)  # quantiles, not draws
    video = video_mix(131072, 64)
    assert sum(bool(m.video_grids) for m in video) == 4
    assert all(m.tokens <= 131072 for m in video)
    long = next(m for m in video if m.video_grids)
    t, h, w = long.video_grids[0]
    assert long.tokens == t * h * w // 4 + 256 > 131072 - 1024
    assert all(len(m.image_grids) == 1 for m in video if not m.video_grids)


def test_job_times_of_a_config_come_from_its_cost_model_and_shape(tiny):
    from cpvlm.attention.cost import CUDA_NCCL
    from cpvlm.hf.data.row_cost import row_cost

    times = job_times(tiny, world=8)
    text = tiny.text_config
    assert times.token == row_cost(tiny).token and times.pair == row_cost(tiny).pair
    assert times.message_s == CUDA_NCCL.message_s and times.call_s == CUDA_NCCL.call_s
    assert times.kv_bytes == 2 * text.num_key_value_heads * text.head_dim * 2
    assert times.gather_s > 0 and job_times(tiny, world=1).gather_s == 0


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("cp", [8, 16, 64])
def test_dynamic_cp_models_no_slower_than_static_and_keeps_the_memory_rule(tiny, mix, cp):
    seq_len = 512 * cp
    metas = MIXES[mix](seq_len, 64)
    result = compare(tiny, metas, seq_len, cp)
    assert result.dynamic_s <= result.static_s
    assert sum(result.sizes.values()) == 64 and result.rounds <= 64
    # every row at least its memory size: the long rows keep all cp ranks
    longest = max(m.tokens for m in metas)
    assert row_size(longest, cp, -(-seq_len // cp)) == cp and result.sizes.get(cp, 0) >= 1
    assert 0 < result.balance <= 1 and result.ideal_s <= result.dynamic_s
    static = plan_rounds([1] * 64, [cp] * 64, cp)
    assert len(static.rounds) == 64  # static CP: a round a row


def test_plan_cli_dynamic_cp_table_and_json(tiny, capsys):
    from cpvlm.simulate.command import main

    argv = ["--model", "qwen3-vl-tiny", "--seq-len", "4096", "--gpus", "16", "--gpu-mem", "80"]
    argv += ["--cp", "8", "16", "--dynamic-cp", "--rows", "16", "--mix", "text"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "static CP's by construction" in out
    lines = [line.split() for line in out.splitlines() if line.split()[:1] in (["8"], ["16"])]
    assert [row[:2] for row in lines] == [["8", "2"], ["16", "1"]]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["cp"] for r in data["results"]] == [8, 16] and data["mix"] == "text"
    for r in data["results"]:
        assert r["dynamic_s"] <= r["static_s"] and sum(r["sizes"].values()) == 16


def test_plan_cli_refuses_no_rows(capsys):
    from cpvlm.simulate.command import main

    argv = ["--model", "qwen3-vl-tiny", "--seq-len", "4096", "--gpus", "8", "--gpu-mem", "80"]
    assert main(argv + ["--dynamic-cp", "--rows", "0"]) == 2
    assert "--rows must be >= 1" in capsys.readouterr().err
