"""benchmarks/gpu/check.sh where it cannot do its work: no CUDA, and no ``python`` on PATH (GPU
images often have only ``python3``). It must still find an interpreter, exit 0 well inside a
minute and write the JSON with every section skipped and why, so that the first run on a GPU
machine cannot be lost to the shell."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["tests", "errors", "speed", "varlen", "nccl", "train"]


def _bin_without_python(tmp_path: Path, names: dict[str, str]) -> Path:
    """A folder of only the programs check.sh needs, under the names given: each a wrapper script
    that runs its target, not a link (a venv's interpreter linked elsewhere loses its venv)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, target in names.items():
        wrapper = folder / name
        wrapper.write_text(f'#!/bin/sh\nexec "{target}" "$@"\n')
        wrapper.chmod(0o755)
    return folder


@pytest.mark.parametrize("interpreter", ["python3", "PYTHON"])
def test_check_sh_without_cuda_or_python_on_path_skips_every_section(tmp_path, interpreter):
    bash, dirname = shutil.which("bash"), shutil.which("dirname")
    names = {"dirname": dirname}
    if interpreter == "python3":
        names["python3"] = sys.executable
    folder = _bin_without_python(tmp_path, names)
    env = {"PATH": str(folder), "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    if interpreter == "PYTHON":
        env["PYTHON"] = sys.executable  # no interpreter on PATH at all
    assert shutil.which("python", path=env["PATH"]) is None
    out = tmp_path / "results" / "gpu.json"
    t0 = time.monotonic()
    proc = subprocess.run(
        [bash, str(ROOT / "benchmarks/gpu/check.sh"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seconds < 60
    results = json.loads(out.read_text())
    assert list(results["sections"]) == SECTIONS
    for name, section in results["sections"].items():
        assert section["status"] == "skipped", name
        assert "no CUDA device" in section["reason"], name
    assert results["deadline_s"] == 500
    summary = proc.stdout[proc.stdout.index("summary") :]
    assert all(name in summary for name in SECTIONS)


def test_check_sh_says_why_when_there_is_no_interpreter(tmp_path):
    folder = _bin_without_python(tmp_path, {"dirname": shutil.which("dirname")})
    proc = subprocess.run(
        [shutil.which("bash"), str(ROOT / "benchmarks/gpu/check.sh")],
        env={"PATH": str(folder)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 127
    assert "no Python interpreter" in proc.stderr


def test_the_deadline_and_the_skips_reach_the_json(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu/check.sh"), "--out", str(out), "--deadline", "42",
         "--skip", "train"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert results["deadline_s"] == 42
    assert results["sections"]["train"]["reason"] == "--skip"
    assert not (tmp_path / "gpu.json.tmp").exists()


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu/check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_subprocess_section_is_killed_with_its_children_at_its_budget(tmp_path):
    check = _check_module()
    pid_file = tmp_path / "child.pid"
    # A parent that starts a grandchild (as train_compare.py starts `cpvlm train`), both asleep.
    script = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); "
        "time.sleep(60)"
    )
    t0 = time.monotonic()
    code, out, _ = check._run([sys.executable, "-c", script], budget=3)
    assert code is None and "started" in out  # timed out, with the output it had printed
    assert time.monotonic() - t0 < 20
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild is gone too (killed with the process group)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {child} outlived its section")


def test_an_in_process_section_stops_between_rows_at_its_budget():
    check = _check_module()
    made = []
    makers = [lambda i=i: made.append(i) or time.sleep(0.3) or {"row": i} for i in range(10)]
    rows, complete = check._rows(makers, time.monotonic() + 0.5)
    assert not complete and 1 <= len(rows) <= 3 and len(made) == len(rows)
    with pytest.raises(check.SectionTimeout), check._alarm(1):
        time.sleep(5)
