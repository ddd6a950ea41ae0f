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


# ---- --wheels: the carried libraries, installed over the machine's torch ------------------------


def _wheel(folder: Path, name: str, version: str, requires=()) -> Path:
    """A minimal pure-python wheel of one module ``name`` (``VERSION = version``), made by hand:
    no build backend, no network."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{path},sha256={b64},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    folder.mkdir(exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def _check_with_wheels(tmp_path: Path, wheels: Path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable, TMPDIR=str(tmp_path))
    # pip as on a GPU machine: none of this machine's pip configuration (its constraints, its
    # links), only the wheels folder.
    env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu/check.sh"), "--wheels", str(wheels), "--out", str(out),
         "--skip", "train"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert list(tmp_path.glob("cpvlm-gpu-check.*")) == []  # the venv is gone
    return proc, json.loads(out.read_text())["environment"]


def test_check_sh_installs_the_carried_wheels_over_the_machines_torch_and_runs_on_them(tmp_path):
    import torch

    # The wheel needs torch, which only the running interpreter has (a venv here, as on a GPU
    # machine whose torch lives in one): resolved offline against the machine's packages.
    _wheel(tmp_path / "wheels", "cpvlm_probe_wheel", "1.2.3", requires=["torch>=2"])
    proc, env = _check_with_wheels(tmp_path, tmp_path / "wheels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert env["executable"].startswith(str(tmp_path / "cpvlm-gpu-check."))  # the venv's python
    assert env["torch"] == torch.__version__  # the machine's torch, kept
    assert env["wheels"] == {
        "dir": str(tmp_path / "wheels"), "wheels": 1, "installed": True, "other_version": {}
    }  # fmt: skip
    assert set(env["libraries"]) == {
        "transformers", "trl", "peft", "accelerate", "tokenizers", "huggingface_hub"
    }  # fmt: skip
    from importlib.metadata import version

    assert env["libraries"]["transformers"] == version("transformers")  # the machine's, not carried
    assert importlib.util.find_spec("cpvlm_probe_wheel") is None  # nothing went into this env
    assert "libraries: {" in proc.stdout


@pytest.mark.parametrize("case", ["missing-dependency", "not-a-wheel"])
def test_check_sh_says_when_the_wheels_cannot_go_in_as_they_are(tmp_path, case):
    wheels = tmp_path / "wheels"
    if case == "missing-dependency":  # installed with --no-deps, the JSON names what is missing
        _wheel(wheels, "cpvlm_probe_wheel", "1.2.3", requires=["cpvlm-no-such-dependency>=1"])
    else:  # nothing installs: the check runs on the machine's packages, exit status 1
        wheels.mkdir()
        (wheels / "cpvlm_probe_wheel-1.2.3-py3-none-any.whl").write_text("not a zip")
    proc, env = _check_with_wheels(tmp_path, wheels)
    info = env["wheels"]
    if case == "missing-dependency":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert info["installed"] and info["other_version"] == {}
        assert "cpvlm-no-such-dependency" in info["no_deps"]
    else:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert not info["installed"] and info["error"]
        assert info["other_version"] == {"cpvlm_probe_wheel": None}
        assert env["executable"] == sys.executable
        assert "were not installed" in proc.stdout


def test_the_carried_set_is_what_the_libraries_need_beyond_torch_and_its_numpy_stack():
    # CHECK_WHEELS against the dependency closure of the installed transformers, trl, peft and
    # accelerate (this environment: the pinned one), stopping at what the GPU machine has with
    # its torch; and every name of it is pinned by constraints.txt (--requirements).
    from importlib import metadata

    from packaging.requirements import Requirement

    check = _check_module()
    stop = {"torch", "numpy", "pandas", "pyarrow"}
    seen, todo = set(), ["transformers", "trl", "peft", "accelerate"]
    while todo:
        name = check._normalized(todo.pop())
        if name in seen or name in stop:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    assert {check._normalized(n) for n in check.CHECK_WHEELS} == seen
    pins = check.requirements()
    assert len(pins) == len(check.CHECK_WHEELS) and all("==" in p for p in pins)
    assert any(p.startswith("transformers==") for p in pins)
