"""``cpvlm train --tp``: tensor parallelism under CP equals the run without it, step by step.

Through the command users run (local gloo processes), float64, qwen3-vl-tiny (cpvlm's decoder
plan: q/k/v and gate/up colwise, o and down rowwise, the q/k norms replicated with their
gradients summed over TP). cp 2 x tp 2 against cp 1 (FSDP2, and data-parallel "none"), and dp 2 x
tp 2 against dp 2 (each TP pair reads its replica's rows); a tp 2 checkpoint resumed at tp 1. Tolerance 1e-10 relative: the runs add the same terms in another order
(the rowwise sums, the q/k norms' TP sum; observed <= 3e-16 per step over three AdamW steps).
And the sizes TP cannot split, refused before any rank starts.
"""

import json
import shutil

import pytest

from cpvlm.train.command import main as train_main

TOL = 1e-10
MODEL = "qwen3-vl-tiny"
FLAGS = ["--model", MODEL, "--dtype", "float64", "--steps", "3", "--no-shuffle", "--seq-len", "192"]


def _train(out, *flags):
    assert train_main(["--out", str(out), *FLAGS, *flags]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a, b, steps=(1, 2, 3)):
    assert [r["step"] for r in a] == list(steps) == [r["step"] for r in b]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # the same rows
    assert [r["valid_labels"] for r in a] == [r["valid_labels"] for r in b]  # not added over TP
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(ra[key] - rb[key]) <= TOL * abs(rb[key]), (ra["step"], key, ra, rb)


def test_tp_under_cp_equals_the_run_without_it(tmp_path):
    one = _train(tmp_path / "cp1", "--cp", "1")
    _same(_train(tmp_path / "cp2_tp2", "--cp", "2", "--tp", "2"), one)
    none = ["--data-parallel", "none"]  # sync_gradients on TP shards instead of FSDP2
    _same(_train(tmp_path / "cp2_tp2_none", "--cp", "2", "--tp", "2", *none), one)
    dp = _train(tmp_path / "dp2", "--dp", "2", "--cp", "1")
    _same(_train(tmp_path / "dp2_tp2", "--dp", "2", "--cp", "1", "--tp", "2"), dp)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "4"], "parallel.tp (--tp) = 4 must divide the model's num_key_value_heads=2"),
        (["--tp", "3"], "parallel.tp (--tp) = 3 must divide the model's num_attention_heads=4"),
        (["--tp", "2", "--data-parallel", "ddp"], "runs with --data-parallel fsdp or none"),
        (["--tp", "2", "--lora-r", "4"], "parallel.tp = 2 (--tp): does not combine with LoRA"),
    ],
)
def test_sizes_tp_cannot_split_are_refused_before_any_rank_starts(tmp_path, capsys, flags, message):
    assert train_main(["--out", str(tmp_path / "run"), *FLAGS, "--cp", "1", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tp2_checkpoint_resumes_at_tp1_exactly(tmp_path, capsys):
    full = tmp_path / "tp2"
    tp2 = _train(full, "--cp", "2", "--tp", "2", "--ckpt-every", "2")
    resumed = tmp_path / "tp1"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    capsys.readouterr()
    after = _train(resumed, "--cp", "2", "--resume")  # DCP gathers the TP shards
    assert "resharded: dp 1 x cp 2 x tp 2 -> dp 1 x cp 2 x tp 1" in capsys.readouterr().out
    _same(after[2:], tp2[2:], steps=(3,))
