"""benchmarks/gpu/check.sh where it cannot do its work: no CUDA, and no ``python`` on PATH (GPU
images often have only ``python3``). It must still find an interpreter, exit 0 well inside a
minute and write the JSON with every section skipped and why, so that the first run on a GPU
machine cannot be lost to the shell."""

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
    """A folder of only the programs check.sh needs, under the names given."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, target in names.items():
        (folder / name).symlink_to(target)
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
