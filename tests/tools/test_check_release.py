"""tools/check_release.py's pure logic: ``--package``, the widening of pyproject's and
constraints.txt's text, the newest end's skip, and the pooled verify's per-model verdicts (a
failing model fails the run). No venv, no network; the real files are only read."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_release", ROOT / "tools" / "check_release.py")
cr = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_release", cr)
_spec.loader.exec_module(cr)

PYPROJECT = """\
[project]
dependencies = ["torch>=2.11", "tqdm>=4.60"]

[project.optional-dependencies]
hf = ["transformers>=5.23,<5.26", "pillow>=9"]
trainer = [
    "transformers>=5.23,<5.26",
    "peft>=0.21,<0.22",
]
test = [
    "transformers>=5.23,<5.26",
    "peft>=0.21,<0.22",
    "pytest>=8",
]
"""
CONSTRAINTS = "# pins\naccelerate==1.16.0\npeft==0.21.2\ntorch==2.14.1\ntorchvision==0.29.1\n"


# ---- --package and the plan ------------------------------------------------------------------


def test_package_is_repeatable_and_keeps_the_other_modes():
    args = cr.parse_args(["--package", "peft==0.22.0", "--package", "torch==2.14.1"])
    assert args.package == ["peft==0.22.0", "torch==2.14.1"]
    assert cr.parse_args(["--window", "oldest"]).window == "oldest"
    assert cr.parse_args(["--latest"]).latest
    assert cr.parse_args(["transformers==5.26.0"]).requirements == ["transformers==5.26.0"]


def test_package_must_be_a_requirement_and_something_must_be_named(capsys):
    with pytest.raises(SystemExit):
        cr.parse_args(["--package", "peft=="])
    assert "not a requirement" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cr.parse_args([])


def test_install_args_and_the_files_each_package_adds():
    reqs = cr.install_args(["transformers==5.26.0"], ["peft==0.22.0", "trl"])
    assert reqs == ["transformers==5.26.0", "peft==0.22.0", "--upgrade", "trl"]
    names = [n for n in map(cr.requirement_name, reqs) if n]
    assert names == ["transformers", "peft", "trl"]
    files = cr.files_for(names)
    assert files[: len(cr.FAMILY_FILES)] == list(cr.FAMILY_FILES)
    assert files[len(cr.FAMILY_FILES) :] == [
        "tests/hf/test_trainer.py",  # once, though peft and trl both name it
        "tests/train/test_train_lora.py",
    ]
    assert cr.files_for(["torch"])[-1] == "tests/test_compat.py"
    assert cr.files_for(["torchvision"]) == list(cr.FAMILY_FILES)


def test_every_mapped_test_file_exists():
    for files in [cr.FAMILY_FILES, *cr.PACKAGE_FILES.values()]:
        for f in files:
            assert (ROOT / f).is_file(), f


# ---- widening ---------------------------------------------------------------------------------


def test_peft_widens_in_every_extra_and_is_pinned(tmp_path):
    py, pins, changes = cr.widen_text(PYPROJECT, CONSTRAINTS, {"peft": "0.22.0"})
    assert py.count('"peft>=0.21,<0.23"') == 2 and "<0.22" not in py
    assert py.replace("<0.23", "<0.22") == PYPROJECT  # nothing else moved
    assert pins == CONSTRAINTS.replace("peft==0.21.2", "peft==0.22.0")
    assert changes == ["peft>=0.21,<0.22 -> peft>=0.21,<0.23", "constraints.txt: peft==0.22.0"]
    # the same on a copy of the real files: one release past the upper bound, in every extra
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    real = (tmp_path / "pyproject.toml").read_text()
    (old,) = cr.declared_in(real, "peft")
    lower, upper = cr.bounds(old)
    major, minor = cr._minor(upper)
    py, _, _ = cr.widen_text(real, CONSTRAINTS, {"peft": f"{major}.{minor}.0"})
    (new,) = cr.declared_in(py, "peft")
    assert new == f"peft>={lower},<{major}.{minor + 1}"
    assert py.count(f'"{new}"') == real.count(f'"{old}"') >= 2  # [trainer] and [test]


def test_a_version_inside_the_window_changes_nothing():
    versions = {"peft": "0.21.2", "transformers": "5.25.0"}
    assert cr.widen_text(PYPROJECT, CONSTRAINTS, versions) == (PYPROJECT, CONSTRAINTS, [])


def test_an_older_release_moves_the_floor_and_pins_nothing():
    py, pins, changes = cr.widen_text(PYPROJECT, CONSTRAINTS, {"transformers": "5.22.2"})
    assert py.count('"transformers>=5.22,<5.26"') == 3
    assert pins == CONSTRAINTS
    assert changes == ["transformers>=5.23,<5.26 -> transformers>=5.22,<5.26"]


def test_torch_without_an_upper_bound_gets_one():
    py, pins, changes = cr.widen_text(PYPROJECT, CONSTRAINTS, {"torch": "2.14.1"})
    assert 'dependencies = ["torch>=2.11,<2.15", "tqdm>=4.60"]' in py
    assert pins == CONSTRAINTS  # already pinned there
    assert changes == ["torch>=2.11 -> torch>=2.11,<2.15"]
    # an older torch checked: the bound still holds the pin, the newest CI passed
    py, pins, _ = cr.widen_text(PYPROJECT, CONSTRAINTS, {"torch": "2.12.0"})
    assert '"torch>=2.11,<2.15"' in py and pins == CONSTRAINTS


def test_torch_with_an_upper_bound_widens_it_and_its_own_pin_line():
    text = PYPROJECT.replace('"torch>=2.11"', '"torch>=2.11,<2.15"')
    py, pins, changes = cr.widen_text(text, CONSTRAINTS, {"torch": "2.15.0"})
    assert '"torch>=2.11,<2.16"' in py
    assert pins.splitlines() == [
        "# pins",
        "accelerate==1.16.0",
        "peft==0.21.2",
        "torch==2.15.0",
        "torchvision==0.29.1",  # the next line, left alone
    ]
    assert changes == ["torch>=2.11,<2.15 -> torch>=2.11,<2.16", "constraints.txt: torch==2.15.0"]
    assert cr.widen_text(text, CONSTRAINTS, {"torch": "2.14.1"})[2] == []


def test_pin_replaces_one_line_or_appends_one():
    assert cr.pin("a==1\nTorch==2.13.0\nb==2\n", "torch", "2.14.1") == "a==1\ntorch==2.14.1\nb==2\n"
    assert cr.pin("a==1", "peft", "0.22.0") == "a==1\npeft==0.22.0\n"
    assert cr.pin("huggingface_hub==2.4.0\n", "huggingface-hub", "2.5.0") == (
        "huggingface-hub==2.5.0\n"
    )
    assert cr.pinned(CONSTRAINTS, "torch") == "2.14.1"
    assert cr.pinned(CONSTRAINTS, "torchvision") == "0.29.1"
    assert cr.pinned(CONSTRAINTS, "trl") is None


def test_widen_writes_the_files_only_when_the_pinned_env_resolves(tmp_path, monkeypatch, capsys):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "constraints.txt").write_text(CONSTRAINTS)
    monkeypatch.setattr(cr, "PYPROJECT", tmp_path / "pyproject.toml")
    monkeypatch.setattr(cr, "CONSTRAINTS", tmp_path / "constraints.txt")
    monkeypatch.setattr(cr, "pinned_env_resolves", lambda: (False, "ResolutionImpossible: x"))
    assert cr.widen({"peft": "0.22.0"}) == 1
    assert "not widened" in capsys.readouterr().out
    assert (tmp_path / "pyproject.toml").read_text() == PYPROJECT
    assert (tmp_path / "constraints.txt").read_text() == CONSTRAINTS
    monkeypatch.setattr(cr, "pinned_env_resolves", lambda: (True, ""))
    assert cr.widen({"peft": "0.22.0"}) == 0
    assert '"peft>=0.21,<0.23"' in (tmp_path / "pyproject.toml").read_text()
    assert "peft==0.22.0\n" in (tmp_path / "constraints.txt").read_text()


# ---- the newest end's skip --------------------------------------------------------------------


def test_newest_is_skipped_only_when_every_resolved_version_is_installed():
    resolved = {"transformers": "5.25.0", "trl": "1.16.0", "peft": "0.21.2"}
    installed = {**resolved, "torch": "2.14.1"}
    line = cr.newest_skip(resolved, installed)
    assert line == (
        "newest end equals the installed pins (transformers 5.25.0, trl 1.16.0, peft 0.21.2): "
        "already tested by the main run, skipped"
    )
    assert cr.newest_skip({**resolved, "transformers": "5.25.1"}, installed) is None
    assert cr.newest_skip(resolved, {"transformers": "5.25.0", "trl": "1.16.0"}) is None
    assert cr.newest_skip({}, installed) is None


def test_window_newest_exits_0_without_a_venv_when_it_equals_the_pins(monkeypatch, capsys):
    pins = {"transformers": "5.25.0", "trl": "1.16.0"}
    seen = []
    monkeypatch.setattr(cr, "resolve_newest", lambda reqs: seen.extend(reqs) or dict(pins))
    monkeypatch.setattr(cr, "installed_versions", lambda python=None: dict(pins))
    monkeypatch.setattr(cr, "make_venv", lambda folder: pytest.fail("made a venv"))
    assert cr.main(["--window", "newest"]) == 0
    assert "already tested by the main run, skipped" in capsys.readouterr().out
    text = (ROOT / "pyproject.toml").read_text()
    assert seen == [r for n in cr.WATCHED for r in cr.declared_in(text, n)]


# ---- the pooled verify ------------------------------------------------------------------------


def test_pooled_verify_reports_each_model_and_a_failing_one_fails(tmp_path, capsys):
    calls = []

    def fake_main(argv):
        calls.append(argv)
        model = argv[1]
        if model == "bad":
            return 1
        if model == "raises":
            raise AssertionError("rank 1 raised")
        if model == "argparse":
            raise SystemExit(2)
        return 0

    out = tmp_path / "verify.json"
    models = ["good", "bad", "raises", "argparse", "good2"]
    assert cr.pooled_verify(str(out), models=models, main=fake_main) == 1
    assert calls == [["--model", m, "--cp", "2"] for m in models]  # all of them, in one process
    results = json.loads(out.read_text())["verify"]
    outcomes = cr.verify_outcomes(models, results)
    assert outcomes == {
        "good": "ok",
        "bad": "rc 1",
        "raises": "raised",
        "argparse": "rc 2",
        "good2": "ok",
    }
    assert cr.verify_failures(outcomes, 1) == [
        "verify bad: rc 1",
        "verify raises: raised",
        "verify argparse: rc 2",
    ]
    assert "rank 1 raised" in capsys.readouterr().err  # the traceback goes to the log


def test_pooled_verify_passes_only_when_every_model_passed(tmp_path):
    out = tmp_path / "verify.json"
    assert cr.pooled_verify(str(out), models=["a", "b"], main=lambda argv: 0) == 0
    outcomes = cr.verify_outcomes(["a", "b"], json.loads(out.read_text())["verify"])
    assert outcomes == {"a": "ok", "b": "ok"} and cr.verify_failures(outcomes, 0) == []


def test_a_model_that_never_ran_or_a_crashed_process_fails():
    outcomes = cr.verify_outcomes(["a", "b"], {"a": {"rc": 0, "s": 1.0}})
    assert outcomes == {"a": "ok", "b": "not run"}
    assert cr.verify_failures(outcomes, -9) == ["verify b: not run"]
    assert cr.verify_failures({"a": "ok"}, -9) == ["the verify process exited -9"]
    assert cr.verify_outcomes(["a"], {"a": {"rc": True}}) == {"a": "True"}  # not an exit code


def test_window_newest_with_a_package_is_not_skipped(monkeypatch):
    pins = {"transformers": "5.25.0"}
    monkeypatch.setattr(cr, "resolve_newest", lambda reqs: dict(pins))
    monkeypatch.setattr(cr, "installed_versions", lambda python=None: dict(pins))

    class Ran(Exception):
        pass

    def make_venv(folder):
        raise Ran

    monkeypatch.setattr(cr, "make_venv", make_venv)
    with pytest.raises(Ran):
        cr.main(["--window", "newest", "--package", "peft==0.22.0"])
