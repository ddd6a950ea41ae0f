"""Checkpoints and ``--resume``: on CPU the resumed losses equal an uninterrupted run's, bit for bit.

Four ways a run stops: at the end of ``--steps K`` (then resumed to N); SIGTERM mid-run (how
SLURM and Kubernetes preempt: every rank finishes its step and checkpoints, exit 143); killed
with SIGKILL mid-run (the launcher alone: its ranks must notice and exit), after which a
half-written checkpoint is planted to check that only complete ones count; and a truncated newest
checkpoint, skipped for the one before it. DP=2 x CP=2, so the global data position and the
sharded FSDP2 model and optimizer states are all exercised.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpvlm.train.command import main as train_main

FLAGS = ["--cp", "2", "--dp", "2", "--seq-len", "160", "--ckpt-every", "2"]
HERE = Path(__file__).parent


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(out, *flags):
    assert train_main(["--out", str(out), *FLAGS, *flags]) == 0
    return _metrics(out)


def _same(resumed, reference):
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    for key in ("loss", "grad_norm", "tokens", "valid_labels"):
        assert [r[key] for r in resumed] == [r[key] for r in reference], key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    records = _train(tmp_path_factory.mktemp("reference") / "run", "--steps", "8")
    assert records[-1]["loss"] < records[0]["loss"]
    return records


def test_stop_at_a_checkpoint_then_resume_equals_the_uninterrupted_run(tmp_path, reference):
    out = tmp_path / "run"
    _train(out, "--steps", "3")
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step_00000002", "step_00000003"]  # every 2 steps, and the last one
    _same(_train(out, "--steps", "8", "--resume"), reference)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step_00000006", "step_00000008"]  # the newest two


def _session_alive(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killed_run_resumes_exactly_from_its_last_complete_checkpoint(tmp_path, reference):
    out = tmp_path / "run"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, "-m", "cpvlm.train", "--out", str(out), *FLAGS, "--steps", "1000"]
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        first = out / "checkpoints" / "step_00000002" / "meta.json"
        deadline = time.monotonic() + 180
        while not first.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.02)
        proc.kill()  # the launcher only, mid-run: its ranks must exit by themselves
        proc.wait()
        deadline = time.monotonic() + 15
        while _session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session_alive(proc.pid) == [], "ranks outlived their killed launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    written = _metrics(out)
    assert 2 <= len(written) < 1000
    # What a kill during a save leaves behind: a partial temporary directory, and (as if a
    # rename had failed) a step directory without meta.json. Neither may be read.
    (out / "checkpoints" / ".tmp-step_00000098").mkdir()
    (out / "checkpoints" / ".tmp-step_00000098" / "__0_0.distcp").write_bytes(b"partial")
    (out / "checkpoints" / "step_00000099").mkdir()
    _same(_train(out, "--steps", "8", "--resume"), reference)


def _start(out, *flags):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, "-m", "cpvlm.train", "--out", str(out), *FLAGS, *flags]
    return subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_checkpoints_the_step_and_resumes_exactly(tmp_path, reference, capsys):
    out = tmp_path / "run"
    proc = _start(out, "--steps", "1000")
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() or len(_metrics(out)) < 3:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "not 3 steps within 180 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher only, as Kubernetes does
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert stdout.decode().startswith(f"cpvlm train: output in {out}"), stdout.decode()
    assert proc.returncode == 128 + signal.SIGTERM, stderr.decode()
    stopped = len(_metrics(out))
    line = stderr.decode().strip().splitlines()[-1]
    assert line == (
        f"cpvlm train: stopped by SIGTERM after step {stopped} of 1000: checkpoint "
        f"{out / 'checkpoints' / f'step_{stopped:08d}'} written; continue with --resume --out {out}"
    )
    assert 3 <= stopped < 8
    truncated = tmp_path / "truncated"
    shutil.copytree(out, truncated)
    _same(_train(out, "--steps", "8", "--resume"), reference)

    # The newest checkpoint loses bytes: resume takes the one before it, and says so.
    newest = truncated / "checkpoints" / f"step_{stopped:08d}"
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    _same(_train(truncated, "--steps", "8", "--resume"), reference)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(
        f"cpvlm train: skipping checkpoint {newest.name}: __1_0.distcp has 100 bytes, the "
        "manifest says"
    ), lines
    assert lines[2].startswith("cpvlm train: resuming from checkpoint step_0000000"), lines
