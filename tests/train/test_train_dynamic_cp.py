"""``cpvlm train --dynamic-cp``: each row on a block of its CP group, the losses of ``--cp 1``.

The data is a long-tailed mix (``_train_sources.LONG_TAILED``: one row per sample under
``--pack-window 1``, 16 to ~590 tokens, images and videos), 4 rows a step. At world 4 (cp 4, and
dp 2 x cp 2) dynamic CP must give the losses of the one-process run on the same rows step for
step, float64, relative 1e-10 (the runs sum the same terms in another order, ~1e-16 per
operation), for a vision-language model with deepstack (qwen3-vl-tiny) and one with linear
attention (qwen3.5-tiny, its state passed over a block's ranks). Every step at cp 4 has rows of
sizes 1, 2 and 4 (metrics.jsonl). The loop runs on pooled gloo ranks (``run_distributed``, as
tests/hf/test_train_families.py), the flags through the command's parser.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")

from cpvlm.testing import run_distributed  # noqa: E402
from cpvlm.train import TrainConfig, launcher  # noqa: E402
from cpvlm.train.command import build_parser, config_from_args  # noqa: E402

TIMEOUT = 600  # s; seconds on an idle 2-core machine, minutes when it is shared
FLAGS = ["--data", "_train_sources:long_tailed", "--pack-window", "1", "--seq-len", "600"]
FLAGS += ["--no-shuffle", "--dtype", "float64", "--steps", "3", "--num-workers", "0"]


def _rank(rank, world_size, config):
    from cpvlm.train.loop import train_rank

    try:
        train_rank(config, torch.device("cpu"))
    except ValueError as err:
        return str(err)
    return None


def _run(out, world: int, *flags) -> list[dict]:
    config = config_from_args(build_parser().parse_args([*FLAGS, "--out", str(out), *flags]))
    config, _, _ = launcher.prepare(config, world_size=world)
    assert run_distributed(_rank, world, config, timeout=TIMEOUT) == [None] * world
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model", ["qwen3-vl-tiny", "qwen3.5-tiny"])
def test_dynamic_cp_gives_the_losses_of_cp1(tmp_path, model):
    flags = ["--model", model]
    one = _run(tmp_path / "cp1", 1, *flags, "--cp", "1", "--grad-accum", "4")
    cp4 = _run(tmp_path / "cp4", 4, *flags, "--cp", "4", "--grad-accum", "4", "--dynamic-cp")
    dp2 = _run(
        tmp_path / "dp2", 4, *flags, "--cp", "2", "--dp", "2", "--grad-accum", "2", "--dynamic-cp"
    )
    assert "dynamic_cp" not in one[0]
    for run in (cp4, dp2):
        assert [r["tokens"] for r in run] == [r["tokens"] for r in one]  # the same rows
        for a, b in zip(one, run, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"]), (a, b)
    # cp 4 (a rank's budget ceil(600 / 4) = 150 tokens): every step runs rows of 1, 2 and 4 ranks
    assert all(r["dynamic_cp"]["sizes"] == {"1": 2, "2": 1, "4": 1} for r in cp4), cp4
    assert all(r["dynamic_cp"]["rounds"] >= 2 for r in cp4)
    # dp 2 x cp 2 (budget 300): rows of 1 and of 2 ranks, 4 rows a step over both replicas
    assert all(sum(r["dynamic_cp"]["sizes"].values()) == 4 for r in dp2)
    assert sum(r["dynamic_cp"]["sizes"]["1"] for r in dp2) > 0
    assert sum(r["dynamic_cp"]["sizes"]["2"] for r in dp2) > 0
    assert all(r["dynamic_cp"]["modelled_balance"] >= 1.0 for r in cp4 + dp2)
    assert one[-1]["loss"] < one[0]["loss"]


def test_a_row_that_differs_on_one_rank_is_the_same_error_on_every_rank(tmp_path):
    """Global rank 3 gets another third sample (other ids, same length): every rank raises the
    same ValueError before any row runs, none hangs."""
    config = config_from_args(
        build_parser().parse_args(
            [*FLAGS, "--data", "_train_sources:long_tailed_other_on_rank3", "--cp", "4"]
            + ["--grad-accum", "4", "--dynamic-cp", "--out", str(tmp_path)]
        )
    )
    config, _, _ = launcher.prepare(config, world_size=4)
    errors = run_distributed(_rank, 4, config, timeout=TIMEOUT)
    assert errors[0] is not None and "row 2 of DP replica 0 differs" in errors[0], errors
    assert errors == [errors[0]] * 4


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--tp", "2"], "parallel.tp"),
        (["--ep", "2"], "parallel.ep"),
        (["--attn", "hybrid", "--ulysses-size", "2"], "parallel.attn"),
        (["--vision", "split"], "parallel.vision"),
    ],
)
def test_what_dynamic_cp_refuses(flags, field):
    with pytest.raises(ValueError, match=rf"{field} = .* does not run with --dynamic-cp: "):
        config_from_args(build_parser().parse_args(["--dynamic-cp", "--cp", "4", *flags]))
    config_from_args(build_parser().parse_args(["--cp", "4", *flags]))  # fine without it


def test_dynamic_cp_flags():
    parse = build_parser().parse_args
    config = config_from_args(parse(["--dynamic-cp", "--dynamic-cp-tokens", "100"]))
    assert config.parallel.dynamic_cp and config.parallel.dynamic_cp_tokens == 100
    assert not TrainConfig().parallel.dynamic_cp
    with pytest.raises(ValueError, match=r"parallel.dynamic_cp_tokens = 0 \(--dynamic-cp-tokens"):
        config_from_args(parse(["--dynamic-cp", "--dynamic-cp-tokens", "0"]))
