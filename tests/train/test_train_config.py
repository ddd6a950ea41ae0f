"""Bad flags and impossible combinations: a clear message and exit code 2, before any rank starts.

These call the command's ``main`` in this process; none of them may start a training process
(the launcher is replaced by a trap that fails the test if reached).
"""

import json

import pytest

from cpvlm.cli import main as cpvlm_main
from cpvlm.train import TrainConfig, launcher
from cpvlm.train.command import main as train_main

pytestmark = pytest.mark.usefixtures("no_training_process")


def _error(capsys, argv) -> str:
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpvlm train: error: ")
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cp", "0"], "cp_size=0 (--cp): must be an integer >= 1"),
        (["--dp", "-2"], "parallel.dp = -2 (--dp)"),
        (["--steps", "0"], "run.steps = 0 (--steps)"),
        (["--seq-len", "8"], "use --seq-len 16 or more"),
        (["--seq-len", "64"], "too short for the images: the data's longest sample"),
        (["--flow", "compat"], "vision='route' (--vision): flow='compat' builds the full input"),
        (["--lr", "0"], "optim.lr = 0.0 (--lr)"),
        (["--lr", "inf"], "optim.lr = inf (--lr): must be a finite number > 0"),
        (["--lr", "nan"], "optim.lr = nan (--lr)"),
        (["--weight-decay", "inf"], "optim.weight_decay = inf (--weight-decay)"),
        (["--weight-decay", "nan"], "optim.weight_decay = nan (--weight-decay)"),
        (["--max-grad-norm", "-1"], "optim.max_grad_norm = -1.0 (--max-grad-norm)"),
        (["--max-grad-norm", "nan"], "optim.max_grad_norm = nan (--max-grad-norm)"),
        (["--loss-chunk", "-1"], "model.loss_chunk = -1 (--loss-chunk)"),
        (["--skip-nonfinite", "-1"], "run.skip_nonfinite = -1 (--skip-nonfinite)"),
        (["--dtype", "bfloat16", "--param-dtype", "float64"], "a separate parameter dtype is"),
        (["--dtype", "float32", "--param-dtype", "bfloat16"], "model.param_dtype = 'bfloat16'"),
        (["--out", "x", "--resume", "--overwrite"], "pass one of them"),
        (["--model", "/no/such/dir"], "neither a tiny model"),
        (["--data", "no_such_module:samples"], "cannot import 'no_such_module'"),
        (["--data", "json:no_such_function"], "json has no function 'no_such_function'"),
        (["--data", "data.jsonl"], "data.jsonl' (--data): no such file or folder"),
        (["--resume"], "--resume continues the run in --out DIR"),
        (["--attn", "hybrid"], "ulysses_size=None (--ulysses-size): attn='hybrid' splits"),
        (["--attn", "hybrid", "--ulysses-size", "3"], "pass a divisor of the CP size 4"),
        (["--ulysses-size", "2"], "applies to attn='hybrid' only (attn='ring')"),
    ],
)
def test_bad_flags_get_a_clear_message(capsys, argv, message):
    assert message in _error(capsys, argv)


def test_malformed_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        train_main(["--cp", "two"])
    assert exc.value.code == 2
    assert "argument --cp: invalid int value: 'two'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--vision", "scatter"])
    assert "vision='scatter' (--vision): must be one of route," in capsys.readouterr().err


def test_cpvlm_command_dispatches_to_train(capsys):
    assert cpvlm_main(["train", "--cp", "0"]) == 2
    assert "(--cp)" in capsys.readouterr().err


def test_under_torchrun_cp_must_divide_the_world(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert "must divide the launcher's world size 6" in _error(capsys, ["--cp", "4"])
    assert "--dp 2 x --cp 2 = 4 ranks, but the launcher started 6" in _error(
        capsys, ["--cp", "2", "--dp", "2"]
    )


def _fake_checkpoint(out, step, config):
    path = out / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"0123456789")
    (path / "manifest.json").write_text(json.dumps({"files": {"__0_0.distcp": 10}}))
    meta = {"step": step, "config": config.to_dict(), "data": {"window": 0, "row": 0}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_output_directory_rules(tmp_path, capsys):
    out = tmp_path / "run"
    assert "no intact checkpoint in" in _error(capsys, ["--out", str(out), "--resume"])
    config = TrainConfig().replace(
        parallel={"dp": 1}, data={"grad_accum": 1}, run={"out": str(out)}
    )
    _fake_checkpoint(out, 4, config)
    assert "already holds a run (checkpoints); pass --resume to continue it, --overwrite" in _error(
        capsys, ["--out", str(out)]
    )
    err = _error(capsys, ["--out", str(out), "--resume", "--seq-len", "600", "--lr", "0.5"])
    assert "data.seq_len: 512 -> 600" in err and "optim.lr: 0.01 -> 0.5" in err
    assert "already at step 4; pass a larger --steps" in _error(
        capsys, ["--out", str(out), "--resume", "--steps", "4"]
    )
    # Another dp keeps the global batch (1 row per step): 2 DP ranks cannot split one row.
    assert "the run trains 1 row(s) per step" in _error(
        capsys, ["--out", str(out), "--resume", "--steps", "9", "--dp", "2", "--cp", "2"]
    )


def test_a_run_without_a_checkpoint_is_refused_and_overwrite_replaces_it(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    assert "already holds a run (metrics.jsonl)" in _error(capsys, ["--out", str(out)])
    config = TrainConfig().replace(run={"out": str(out), "overwrite": True})
    prepared, resume_from, _ = launcher.prepare(config)
    assert resume_from is None and prepared.data.grad_accum == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # only the run's files go


def test_resume_skips_a_truncated_or_broken_newest_checkpoint(tmp_path):
    out = tmp_path / "run"
    config = TrainConfig().replace(
        parallel={"dp": 1}, data={"grad_accum": 1}, run={"out": str(out)}
    )
    _fake_checkpoint(out, 2, config)
    truncated = _fake_checkpoint(out, 4, config)
    (truncated / "__0_0.distcp").write_bytes(b"01234")
    broken = _fake_checkpoint(out, 6, config)
    (broken / "meta.json").write_text("{not json")
    resumed = config.replace(run={"resume": True, "steps": 10})
    prepared, resume_from, lines = launcher.prepare(resumed)
    assert resume_from.endswith("step_00000002")
    assert lines[0].startswith("skipping checkpoint step_00000006: meta.json is unreadable")
    assert lines[1] == (
        "skipping checkpoint step_00000004: __0_0.distcp has 5 bytes, the manifest says 10 "
        "(truncated?)"
    )
    assert lines[2] == "resuming from checkpoint step_00000002 (step 2)"


def test_model_directories_without_weights_or_with_a_broken_config(tmp_path, capsys):
    from cpvlm.hf import TINY_MODELS

    no_weights = tmp_path / "no_weights"
    TINY_MODELS["qwen3-vl-tiny"]().save_pretrained(no_weights)
    assert "has a config.json but no weights" in _error(capsys, ["--model", str(no_weights)])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3_vl",')
    assert "its config.json cannot be read" in _error(capsys, ["--model", str(broken)])


def test_config_round_trips_and_lists_its_differences():
    config = TrainConfig().replace(parallel={"cp": 2}, run={"steps": 9})
    assert TrainConfig.from_dict(config.to_dict()) == config
    config = config.replace(data={"seq_len": 256})
    # run.steps and parallel.cp may change on resume
    assert config.differences(TrainConfig()) == ["data.seq_len: 256 -> 512"]


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "qwen2.5-vl-tiny"])
def test_freeze_vision_keeps_the_mergers_trainable(name):
    from cpvlm.hf import build_model
    from cpvlm.train.loop import freeze_vision_encoder

    model = build_model(name)
    freeze_vision_encoder(model)
    for pname, p in model.named_parameters():
        in_encoder = pname.startswith("model.visual.") and ".merger" not in pname
        in_encoder &= "deepstack_merger_list" not in pname
        assert p.requires_grad != in_encoder, pname
    assert any(not p.requires_grad for p in model.parameters())
