"""Bad flags and impossible combinations: a clear message and exit code 2, before any rank starts.

These call the command's ``main`` in this process; none of them may start a training process
(the launcher is replaced by a trap that fails the test if reached).
"""

import json

import pytest

from cpvlm.cli import main as cpvlm_main
from cpvlm.train import TrainConfig, launcher
from cpvlm.train.command import main as train_main


@pytest.fixture(autouse=True)
def _no_process_may_start(monkeypatch):
    def trap(config):
        raise AssertionError(f"a training process was started for {config}")

    monkeypatch.setattr(launcher, "launch_local", trap)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _error(capsys, argv) -> str:
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpvlm train: error: ")
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cp", "0"], "parallel.cp = 0 (--cp): must be an integer >= 1"),
        (["--dp", "-2"], "parallel.dp = -2 (--dp)"),
        (["--steps", "0"], "run.steps = 0 (--steps)"),
        (["--seq-len", "8"], "use --seq-len 16 or more"),
        (["--seq-len", "64"], "too short for the images: the data's longest sample"),
        (["--flow", "compat"], "--flow compat builds the full input embeddings"),
        (["--lr", "0"], "optim.lr = 0.0 (--lr)"),
        (["--max-grad-norm", "-1"], "optim.max_grad_norm = -1.0 (--max-grad-norm)"),
        (["--model", "/no/such/dir"], "neither a tiny model"),
        (["--data", "no_such_module:samples"], "cannot import 'no_such_module'"),
        (["--data", "json:no_such_function"], "json has no function 'no_such_function'"),
        (["--data", "data.jsonl"], "data.jsonl' (--data): no such file or folder"),
        (["--resume"], "--resume continues the run in --out DIR"),
        (["--attn", "hybrid"], "parallel.ulysses_size = None (--ulysses-size): --attn hybrid"),
        (["--attn", "hybrid", "--ulysses-size", "3"], "pass a divisor of --cp"),
        (["--ulysses-size", "2"], "it applies to --attn hybrid only"),
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
    assert "invalid choice: 'scatter'" in capsys.readouterr().err


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
    (path / "meta.json").write_text(json.dumps({"step": step, "config": config.to_dict()}))


def test_output_directory_rules(tmp_path, capsys):
    out = tmp_path / "run"
    assert "no complete checkpoint in" in _error(capsys, ["--out", str(out), "--resume"])
    config = TrainConfig().replace(parallel={"dp": 1}, run={"out": str(out)})
    _fake_checkpoint(out, 4, config)
    assert "already holds a run (checkpoint step_00000004); pass --resume" in _error(
        capsys, ["--out", str(out)]
    )
    err = _error(capsys, ["--out", str(out), "--resume", "--cp", "2", "--lr", "0.5"])
    assert "parallel.cp: 4 -> 2" in err and "optim.lr: 0.01 -> 0.5" in err
    assert "already at step 4; pass a larger --steps" in _error(
        capsys, ["--out", str(out), "--resume", "--steps", "4"]
    )


def test_config_round_trips_and_lists_its_differences():
    config = TrainConfig().replace(parallel={"cp": 2}, run={"steps": 9})
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.differences(TrainConfig()) == ["parallel.cp: 2 -> 4"]  # run.steps may change


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "qwen2.5-vl-tiny"])
def test_freeze_vision_keeps_the_mergers_trainable(name):
    from cpvlm.integrations.hf import build_model
    from cpvlm.train.loop import freeze_vision_encoder

    model = build_model(name)
    freeze_vision_encoder(model)
    for pname, p in model.named_parameters():
        in_encoder = pname.startswith("model.visual.") and ".merger" not in pname
        in_encoder &= "deepstack_merger_list" not in pname
        assert p.requires_grad != in_encoder, pname
    assert any(not p.requires_grad for p in model.parameters())
