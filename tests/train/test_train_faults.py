"""What a cluster does to a run, each fault a test (the fault table of docs/training.md).

SIGTERM to the whole process group (Slurm's preemption, ``kill %job``, a terminal's Ctrl-C: the
DataLoader workers get it too), and to torchrun's; SIGINT; a second signal; a rank killed
(SIGKILL); a rank that stops (SIGSTOP) under ``--dist-timeout``; a rank that crashes under
``torchrun --max-restarts 1``; a disk that fills up during a save; asynchronous saves. Faults other
than signals are injected with ``CPVLM_FAULT`` (cpvlm/train/faults.py). The runs whose subject is
the processes (signals, killed and stopped ranks, torchrun's restarts) are subprocesses; the
full-disk and asynchronous-save runs, the reference and the resumes run on pooled ranks
(``cpvlm.testing.pooled_train``, which passes ``CPVLM_FAULT`` on to them). Every run is CP=2 on
the tiny default model and synthetic data, compared with one uninterrupted run: on CPU the losses
of an interrupted and resumed run equal it bit for bit.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cpvlm.train.checkpoint import newest_intact, problem
from cpvlm.train.command import main as train_main

# A test here runs cpvlm train two or three times (a torchrun restart among them), each a few
# processes importing transformers: minutes on 2 cores, beyond the suite's 300 s default. Every
# wait inside has its own, shorter bound.
pytestmark = pytest.mark.timeout(900)

FLAGS = ["--cp", "2", "--seq-len", "160", "--ckpt-every", "2"]
STEPS = 6
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups")


def _metrics(out):
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _same(resumed, reference):
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    for key in ("loss", "grad_norm", "tokens", "valid_labels"):
        assert [r[key] for r in resumed] == [r[key] for r in reference], key


def _resume(out, steps=STEPS):
    assert train_main(["--out", str(out), *FLAGS, "--steps", str(steps), "--resume"]) == 0
    return _metrics(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    assert train_main(["--out", str(out), *FLAGS, "--steps", str(STEPS)]) == 0
    return out, _metrics(out)


def _start(cmd, fault=None, **env):
    env = {**os.environ, **env}
    env.pop("CPVLM_FAULT", None)
    if fault:
        env["CPVLM_FAULT"] = fault
    return subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,  # its own process group, as a job's
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _train_cmd(out, *flags):
    return [sys.executable, "-m", "cpvlm.train", "--out", str(out), *FLAGS, *flags]


def _wait_for_steps(proc, out, steps, timeout=240):
    deadline = time.monotonic() + timeout
    while len(_metrics(out)) < steps:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}:\n{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"not {steps} steps within {timeout} s"
        time.sleep(0.05)


def _finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _session(sid):
    """``{pid: state}`` of the live (non-zombie) processes of session ``sid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    found[int(entry.name)] = fields[0]
    return found


def _signal_the_group_after(out, steps, sig, code):
    """Start a 1000-step run on ``out``, send ``sig`` to its process group after ``steps``
    steps, and check that it exits ``code`` with no traceback and the one line naming the step
    it checkpointed; that step."""
    proc = _start(_train_cmd(out, "--steps", "1000"))
    try:
        _wait_for_steps(proc, out, steps)
        os.killpg(proc.pid, sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, stderr[-3000:]
    stopped = len(_metrics(out))
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"cpvlm train: stopped by {sig.name} after step {stopped} of 1000: checkpoint "
        f"{out / 'checkpoints' / f'step_{stopped:08d}'} written; continue with --resume --out {out}"
    )
    return stopped


@linux_only
def test_sigterm_to_the_process_group_checkpoints_and_resumes_exactly(tmp_path, reference):
    """The DataLoader workers (2 per rank) and the fork server get SIGTERM too: they ignore it,
    the ranks finish the step and checkpoint it, and the run exits 143 with one line."""
    out = tmp_path / "run"
    stopped = _signal_the_group_after(out, 3, signal.SIGTERM, 143)
    assert 3 <= stopped < STEPS
    assert newest_intact(out)[0].name == f"step_{stopped:08d}"
    _same(_resume(out), reference[1])


def _ended_within(proc, seconds):
    """Wait until every process of ``proc``'s session (ranks, fork server, DataLoader workers)
    is gone; the seconds that took, at most ``seconds``."""
    start = time.monotonic()
    while _session(proc.pid) and time.monotonic() - start < seconds:
        time.sleep(0.1)
    assert _session(proc.pid) == {}, "a process of the run outlived it"
    return time.monotonic() - start


@linux_only
def test_sigint_a_second_signal_and_a_killed_rank(tmp_path):
    """Three short runs on one --out, each resuming the one before, each signal to the whole
    process group (DataLoader workers and fork server included):
    1. SIGINT (a terminal's Ctrl-C) after 2 steps: the step finishes and is checkpointed, exit
       130 with one line.
    2. A run whose rank 1 hangs (SIGSTOP, CPVLM_FAULT=stop) at the start of its second step,
       so that it cannot finish: SIGTERM, then SIGTERM again: the second one kills the ranks;
       exit 143 with one line, every process gone within seconds, the checkpoint before kept.
    3. Rank 1 killed (SIGKILL, CPVLM_FAULT=kill) at the start of the second resumed step: every
       process ends within seconds, the launcher names rank 1 and the signal, exit 1."""
    out = tmp_path / "run"
    stopped = _signal_the_group_after(out, 2, signal.SIGINT, 130)
    assert newest_intact(out) == (out / "checkpoints" / f"step_{stopped:08d}", [])

    cmd = _train_cmd(out, "--steps", "1000", "--resume")
    proc = _start(cmd, fault=f"stop@{stopped + 2}:1")
    try:
        _wait_for_stopped_rank(proc)
        os.killpg(proc.pid, signal.SIGTERM)  # the ranks cannot finish their step
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        elapsed = _ended_within(proc, 20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "cpvlm train: killed by a second SIGTERM: the ranks did not finish their step; the "
        f"newest intact checkpoint in {out} is kept"
    ), stderr[-3000:]
    assert len(_metrics(out)) == stopped + 1
    resumed = stopped + 1 if (stopped + 1) % 2 == 0 else stopped  # --ckpt-every 2
    assert newest_intact(out) == (out / "checkpoints" / f"step_{resumed:08d}", [])
    assert elapsed < 20, elapsed

    # What the resumed run's metrics.jsonl will keep, so that the wait below sees its steps.
    kept = [r for r in _metrics(out) if r["step"] <= resumed]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    proc = _start(_train_cmd(out, "--steps", "1000", "--resume"), fault=f"kill@{resumed + 2}:1")
    try:
        _wait_for_steps(proc, out, resumed + 1)  # rank 1 dies at the start of the next step
        start = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start + _ended_within(proc, 20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "cpvlm train: rank 1 of 2 died: process 1 terminated with signal SIGKILL"
    ), stderr[-3000:]
    assert len(_metrics(out)) == resumed + 1
    last = resumed + 1 if (resumed + 1) % 2 == 0 else resumed
    assert newest_intact(out) == (out / "checkpoints" / f"step_{last:08d}", [])
    assert elapsed < 20, elapsed  # the launcher's 1 s grace, its SIGKILL, the workers' 5 s poll


def _wait_for_stopped_rank(proc, timeout=360):  # start-up and a step, on a loaded machine
    deadline = time.monotonic() + timeout
    while "T" not in _session(proc.pid).values():  # a rank has stopped
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}:\n{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "no rank stopped"
        time.sleep(0.05)


@linux_only
def test_a_stopped_rank_is_named_and_every_rank_ends(tmp_path):
    """Rank 1 stops itself (SIGSTOP) at the start of step 3; rank 0 waits in a collective until
    --dist-timeout, names rank 1 with its step and phase, and the launcher ends every rank."""
    out = tmp_path / "run"
    cmd = _train_cmd(out, "--steps", "4", "--dist-timeout", "20")
    proc = _start(cmd, fault="stop@3:1")
    try:
        _wait_for_steps(proc, out, 2)
        deadline = time.monotonic() + 120
        while "T" not in _session(proc.pid).values():  # rank 1 has stopped
            assert proc.poll() is None and time.monotonic() < deadline, "rank 1 did not stop"
            time.sleep(0.05)
        start = time.monotonic()
        while _session(proc.pid) and time.monotonic() - start < 90:
            time.sleep(0.1)
        elapsed = time.monotonic() - start
        assert _session(proc.pid) == {}, "a rank outlived the run"
        _, stderr = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr[-3000:]
    named = "rank 1 of 2 made no progress for 20 s: in step 3, forward (last step done: 2)"
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith(f"cpvlm train: {named}"), stderr[-3000:]
    assert f"newest intact checkpoint in {out} is kept" in lines[-1]
    assert any(line.startswith(f"cpvlm train: rank 0: {named}") for line in lines), stderr
    assert elapsed < 60, elapsed  # 20 s timeout, 2 s to agree, 1 s grace, then SIGKILL
    assert newest_intact(out)[0].name == "step_00000002"


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(out, *flags, restarts=0):
    # A port of its own, not torchrun's fixed default (29500) that another job on the machine
    # may hold.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    cmd += ["--max-restarts", str(restarts), "-m", "cpvlm.train", "--out", str(out), *FLAGS]
    return [*cmd, *flags]


@linux_only
def test_a_crash_under_torchrun_restarts_exactly_and_sigterm_to_torchruns_group(
    tmp_path, reference
):
    """Rank 1 raises at step 5; torchrun (--max-restarts 1) restarts both ranks, which resume
    from the checkpoint of step 4 and finish with the losses of the uninterrupted run. Then the
    run goes on under torchrun and its whole process group gets SIGTERM (torchrun passes it on
    to the ranks once more): every rank finishes its step, one checkpoint is written, the ranks
    exit 143 with rank 0's one line, before torchrun's 30 s would have killed them."""
    out = tmp_path / "run"
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))  # as the local launcher gives
    cmd = _torchrun(out, "--steps", str(STEPS), restarts=1)
    proc = _start(cmd, fault="crash@5:1", OMP_NUM_THREADS=threads)
    stdout, stderr = _finish(proc, timeout=600)
    # No rerun on "Gloo connectFullMesh failed": that was a restarted rank reading its peer's
    # address of the attempt before (cpvlm.train.launcher.torchrun_store).
    assert proc.returncode == 0, stderr[-3000:]
    assert "CPVLM_FAULT: injected crash at step 5 on rank 1" in stderr  # with its traceback
    assert "resuming from checkpoint step_00000004 (step 4)" in stdout, stdout
    assert [r["step"] for r in _metrics(out)] == list(range(1, STEPS + 1))
    _same(_metrics(out), reference[1])

    proc = _start(_torchrun(out, "--steps", "1000", "--resume"), OMP_NUM_THREADS=threads)
    try:
        _wait_for_steps(proc, out, STEPS + 1)
        os.killpg(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        elapsed = time.monotonic() - sent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = len(_metrics(out))
    assert STEPS < stopped < 1000, stderr[-3000:]
    line = (
        f"cpvlm train: stopped by SIGTERM after step {stopped} of 1000: checkpoint "
        f"{out / 'checkpoints' / f'step_{stopped:08d}'} written; continue with --resume --out {out}"
    )
    assert line in stderr.splitlines(), stderr[-3000:]
    assert newest_intact(out) == (out / "checkpoints" / f"step_{stopped:08d}", [])
    # torchrun itself ends with its own SignalException (exit 1); the ranks ended by
    # themselves, before torchrun's SIGKILL (30 s after its SIGTERM).
    assert proc.returncode == 1 and "SignalException" in stderr, stderr[-3000:]
    assert "forcefully exiting via SIGKILL" not in stderr, stderr[-3000:]
    assert elapsed < 30, elapsed


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    """Rank 1's files of the step-4 checkpoint come out short with ENOSPC: with --on-save-error
    stop the run ends there with one line, step 2 stays the newest checkpoint and loads. (On
    pooled ranks: the fault is the save's, not the launch's; ``CPVLM_FAULT`` reaches them.)"""
    out = tmp_path / "run"
    monkeypatch.setenv("CPVLM_FAULT", "enospc@4:1")
    flags = ["--out", str(out), *FLAGS, "--steps", "6", "--on-save-error", "stop"]
    assert train_main(flags) == 1
    stderr = capsys.readouterr().err
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(
        "cpvlm train: stopped after step 4: checkpoint step_00000004 was not written: rank 1: "
        "OSError: [Errno 28] No space left on device"
    ), stderr[-3000:]
    assert f"the last checkpoint {out / 'checkpoints' / 'step_00000002'} is intact" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    assert newest_intact(out) == (out / "checkpoints" / "step_00000002", [])
    dcp_to_torch_save(out / "checkpoints" / "step_00000002", tmp_path / "saved.pt")
    assert torch.load(tmp_path / "saved.pt", weights_only=False)["model"]


def _saved(path, file):
    dcp_to_torch_save(path, file)
    return torch.load(file, weights_only=False)


def _same_bits(a, b, key="checkpoint"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape), key
        as_bytes = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*as_bytes), key
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), key
        for k in a:
            _same_bits(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b)):
            _same_bits(x, y, f"{key}[{i}]")
    else:
        assert a == b, key


def test_async_saves_equal_sync_saves_bit_for_bit_and_resume_exactly(
    tmp_path, reference, monkeypatch, capfd
):
    """--async-save with a full disk at step 4 (--on-save-error continue: a warning, the next
    interval saves): the same losses and the same checkpoint as the synchronous reference, and
    a resume from the checkpoint before the failed one (step 2, written asynchronously) equals
    the uninterrupted run. (On pooled ranks, as the full-disk test above.)"""
    ref_out, ref_records = reference
    out = tmp_path / "run"
    with monkeypatch.context() as env:
        env.setenv("CPVLM_FAULT", "enospc@4:0")
        flags = ["--out", str(out), *FLAGS, "--steps", str(STEPS), "--async-save"]
        assert train_main(flags) == 0
    stderr = capfd.readouterr().err  # rank 0's line, on the ranks' file descriptor 2
    assert (
        "cpvlm train: warning: checkpoint step_00000004 was not written: rank 0: OSError: "
        "[Errno 28] No space left on device"
    ) in stderr, stderr[-3000:]
    _same(_metrics(out), ref_records)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000002",
        f"step_{STEPS:08d}",
    ]
    for step in (STEPS,):
        mine, theirs = (o / "checkpoints" / f"step_{step:08d}" for o in (out, ref_out))
        assert problem(mine) is None
        names = sorted(p.name for p in mine.iterdir())
        assert names == sorted(p.name for p in theirs.iterdir())
        # The .distcp files are archives with their own headers, .metadata holds the directory
        # and a random save id: compare what they hold, every tensor byte for byte.
        saved = [_saved(d, tmp_path / f"{i}.pt") for i, d in enumerate((mine, theirs))]
        _same_bits(*saved)
        meta, ref_meta = (json.loads((d / "meta.json").read_text()) for d in (mine, theirs))
        assert meta["config"]["run"].pop("async_save") is True
        ref_meta["config"]["run"].pop("async_save")
        meta["config"]["run"].pop("out"), ref_meta["config"]["run"].pop("out")
        assert meta == ref_meta
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    _same(_resume(out), ref_records)
    # The resumed run's last checkpoint is the uninterrupted run's too, RNG states included.
    mine, theirs = (o / "checkpoints" / f"step_{STEPS:08d}" for o in (out, ref_out))
    _same_bits(*(_saved(d, tmp_path / f"resumed{i}.pt") for i, d in enumerate((mine, theirs))))


def test_resume_auto_resumes_or_starts_anew(tmp_path, reference):
    """--resume auto (a requeued job's flags): the newest intact checkpoint if there is one, else
    a new run, replacing what a run killed before its first checkpoint left."""
    from cpvlm.train import launcher
    from cpvlm.train.command import build_parser, config_from_args
    from cpvlm.train.config import RunConfig

    def prepare(out):
        flags = ["--out", str(out), *FLAGS, "--steps", "10", "--resume", "auto"]
        return launcher.prepare(config_from_args(build_parser().parse_args(flags)))

    _, resume_from, lines = prepare(reference[0])
    assert resume_from == str(reference[0] / "checkpoints" / f"step_{STEPS:08d}"), lines
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "metrics.jsonl").write_text('{"step": 1}\n')
    config, resume_from, lines = prepare(partial)
    assert resume_from is None and not config.run.resume
    assert lines == ["--resume auto: no intact checkpoint yet, starting anew"]
    assert not (partial / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match=r"run.dist_timeout = 0 \(--dist-timeout\)"):
        RunConfig(dist_timeout=0)
    with pytest.raises(ValueError, match=r"--on-save-error\): must be one of continue, stop"):
        RunConfig(on_save_error="retry")


def test_a_restarted_torchrun_job_does_not_see_the_keys_of_the_attempt_before(monkeypatch):
    """torchrun's static rendezvous keeps one store (its agent's) for the whole job: the ranks
    of attempt 1 must not read what attempt 0 wrote (gloo's addresses of dead processes: "Gloo
    connectFullMesh failed ... Connection refused" when a restarted rank read them first)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from cpvlm.train.launcher import torchrun_store

    port = _free_port()
    agent = TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=30))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    for key, value in {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    stores = []
    for attempt in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        store, rank, world = torchrun_store(timedelta(seconds=30))
        assert (rank, world) == (0, 1)
        assert not store.check(["0"]), f"attempt {attempt} sees a key of the attempt before"
        store.set("0", f"address of attempt {attempt}")
        stores.append(store)
    assert [s.get("0") for s in stores] == [b"address of attempt 0", b"address of attempt 1"]
    assert agent.num_keys() >= 2
