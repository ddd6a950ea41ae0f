"""The cpvlm command's flags: defaults shown in --help, bad values refused with exit 2 and a
message naming the flag, before anything runs."""

import pytest

from cpvlm.cli import main as cpvlm_main


def _refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        cpvlm_main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--flow", "compat", "--vision", "route"], "flow='compat' builds the full input"),
        (["--tol", "-1"], "--tol must be a finite number > 0, got -1.0"),
        (["--tol", "nan"], "--tol must be a finite number > 0, got nan"),
        (["--cp", "0"], "cp_size=0 (--cp): must be an integer >= 1"),
        (["--attn", "ring", "--ulysses-size", "2"], "applies to attn='hybrid' only"),
        (["--attn", "auto"], "attn='auto' (--attn): not checked here"),
        (["--model", "/no/such/dir"], "neither a tiny model"),
    ],
)
def test_verify_refuses_bad_flags(capsys, argv, message):
    assert message in _refused(capsys, ["verify", *argv])


def test_verify_refuses_a_model_directory_without_weights(tmp_path, capsys):
    from cpvlm.hf import TINY_MODELS

    TINY_MODELS["qwen3-vl-tiny"]().save_pretrained(tmp_path)
    assert "has a config.json but no weights" in _refused(
        capsys, ["verify", "--model", str(tmp_path)]
    )


@pytest.mark.parametrize(
    "command, shown",
    [
        (
            "verify",
            [
                "--cp CP ",
                "(default: 2,4)",
                "(default: ring,allgather,ulysses,hybrid)",
                "(default: float64)",
            ],
        ),
        (
            "train",
            ["(default: 50)", "(default: 1024)", "(default: qwen3-vl-tiny)", "(default: 0.01)"],
        ),
        ("export", ["--run RUN", "(default: newest intact)"]),
    ],
)
def test_help_shows_every_default(capsys, command, shown):
    with pytest.raises(SystemExit) as exc:
        cpvlm_main([command, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for fragment in shown:
        assert " ".join(fragment.split()) in text, fragment
    assert "(default: None)" not in text and "(default: False)" not in text


def test_export_refuses_what_it_cannot_export(tmp_path, capsys):
    assert cpvlm_main(["export", "--run", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert "no checkpoints directory" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()
    assert cpvlm_main(["export", "--run", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert "no intact checkpoint to export" in capsys.readouterr().err
    argv = ["export", "--run", str(tmp_path), "--step", "3", "--out", str(tmp_path / "hf")]
    assert cpvlm_main(argv) == 2
    assert "has no checkpoint of step 3" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "verify"])
def test_model_flag_lists_the_registry_and_defaults_to_its_default_model(capsys, command):
    from cpvlm.hf.registry import default_model, tiny_adapters

    with pytest.raises(SystemExit):
        cpvlm_main([command, "--help"])
    out = capsys.readouterr().out
    text = " ".join(out.split())
    compact = "".join(out.split())  # argparse wraps the list at hyphens too ("internvl- tiny")
    assert all(name in compact for name in tiny_adapters())
    assert f"(default: {default_model()})" in text
    # Declared by exactly one family's kit, not inherited by the kits that subclass it.
    declaring = [
        a.family for a in set(tiny_adapters().values()) if vars(a.kit).get("default_model")
    ]
    assert declaring == [tiny_adapters()[default_model()].family]


def test_python_dash_m_cpvlm_is_the_cpvlm_command():
    """``python -m cpvlm`` runs the same command line as the ``cpvlm`` script."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "cpvlm", "plan", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: cpvlm plan")
