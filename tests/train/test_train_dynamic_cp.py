"""``cpvlm train --dynamic-cp``: each row on a block of its CP group, the losses of ``--cp 1``.

The data is a long-tailed mix (``_train_sources.LONG_TAILED``: one row per sample under
``--pack-window 1``, 16 to ~590 tokens, images and videos), 4 rows a step. At world 4 (cp 4, and
dp 2 x cp 2) dynamic CP must give the losses of the one-process run on the same rows step for
step, float64, relative 1e-10 (the runs sum the same terms in another order, ~1e-16 per
operation), for a vision-language model with deepstack (qwen3-vl-tiny) and one with linear
attention (qwen3.5-tiny, its state passed over a block's ranks). Every step at cp 4 has rows of
sizes 1, 2 and 4 (metrics.jsonl). The loop runs on pooled gloo ranks (``run_distributed``, as
tests/hf/test_train_families.py), the flags through the command's parser. The plan is made
anew each step from the rows and the topology, so a run saved at cp 4 resumes at dp 2 x cp 2 with
the one-process losses.
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


def _rank(rank, world_size, config, resume_from=None):
    from cpvlm.train.loop import train_rank

    try:
        train_rank(config, torch.device("cpu"), resume_from)
    except ValueError as err:
        return str(err)
    return None


def _run(out, world: int, *flags, lines: list[str] | None = None) -> list[dict]:
    """The run's metrics records; ``lines``, if given, receives what the launcher would show
    (resuming, resharding)."""
    config = config_from_args(build_parser().parse_args([*FLAGS, "--out", str(out), *flags]))
    config, resume_from, shown = launcher.prepare(config, world_size=world)
    if lines is not None:
        lines.extend(shown)
    errors = run_distributed(_rank, world, config, resume_from, timeout=TIMEOUT)
    assert errors == [None] * world
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cp1(tmp_path_factory):
    """``cp1(model)``: the one-process run's records, run once per model for the module."""
    runs = {}

    def run(model: str) -> list[dict]:
        if model not in runs:
            out = tmp_path_factory.mktemp("cp1")
            runs[model] = _run(out, 1, "--model", model, "--cp", "1", "--grad-accum", "4")
        return runs[model]

    return run


def _assert_losses(reference: list[dict], run: list[dict]) -> None:
    assert [r["step"] for r in run] == [r["step"] for r in reference]
    assert [r["tokens"] for r in run] == [r["tokens"] for r in reference]  # the same rows
    for a, b in zip(reference, run, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"]), (a, b)


@pytest.mark.parametrize("model", ["qwen3-vl-tiny", "qwen3.5-tiny"])
def test_dynamic_cp_gives_the_losses_of_cp1(tmp_path, cp1, model):
    flags = ["--model", model]
    one = cp1(model)
    cp4 = _run(tmp_path / "cp4", 4, *flags, "--cp", "4", "--grad-accum", "4", "--dynamic-cp")
    dp2 = _run(
        tmp_path / "dp2", 4, *flags, "--cp", "2", "--dp", "2", "--grad-accum", "2", "--dynamic-cp"
    )
    assert "dynamic_cp" not in one[0]
    for run in (cp4, dp2):
        _assert_losses(one, run)
    # cp 4 (a rank's budget ceil(600 / 4) = 150 tokens): every step runs rows of 1, 2 and 4 ranks
    assert all(r["dynamic_cp"]["sizes"] == {"1": 2, "2": 1, "4": 1} for r in cp4), cp4
    assert all(r["dynamic_cp"]["rounds"] >= 2 for r in cp4)
    # dp 2 x cp 2 (budget 300): rows of 1 and of 2 ranks, 4 rows a step over both replicas
    assert all(sum(r["dynamic_cp"]["sizes"].values()) == 4 for r in dp2)
    assert sum(r["dynamic_cp"]["sizes"]["1"] for r in dp2) > 0
    assert sum(r["dynamic_cp"]["sizes"]["2"] for r in dp2) > 0
    assert all(r["dynamic_cp"]["modelled_balance"] >= 1.0 for r in cp4 + dp2)
    assert one[-1]["loss"] < one[0]["loss"]


def test_dynamic_cp_saved_at_cp4_resumes_at_dp2_cp2_with_the_losses_of_cp1(tmp_path, cp1):
    """Steps 1-2 at cp 4 (checkpoint at step 2), step 3 resumed at dp 2 x cp 2: the data position
    and the weights carry over, the plan is made for the new topology (rows of 1 and 2 ranks,
    none of 4), and every step's loss is the one-process run's."""
    one, out, flags = cp1("qwen3-vl-tiny"), tmp_path / "run", ["--model", "qwen3-vl-tiny"]
    saved = _run(out, 4, *flags, "--cp", "4", "--grad-accum", "4", "--dynamic-cp", "--steps", "2",
                 "--ckpt-every", "2")  # fmt: skip
    assert (out / "checkpoints" / "step_00000002").is_dir()
    _assert_losses(one[:2], saved)
    assert all(r["dynamic_cp"]["sizes"].get("4", 0) == 1 for r in saved)
    lines = []
    resumed = _run(out, 4, *flags, "--dp", "2", "--cp", "2", "--dynamic-cp", "--resume",
                   lines=lines)  # fmt: skip
    resharded = (
        "resharded: dp 1 x cp 4 -> dp 2 x cp 2; grad-accum 4 -> 2 keeps the global batch of 4 "
        "rows per step"
    )
    assert lines == ["resuming from checkpoint step_00000002 (step 2)", resharded], lines
    _assert_losses(one, resumed)
    step3 = resumed[2]["dynamic_cp"]
    assert set(step3["sizes"]) <= {"1", "2"} and sum(step3["sizes"].values()) == 4, step3


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
