import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpvlm.testing import shutdown_pools

WORLD_RUNNER = Path(__file__).resolve().parent / "hf" / "_torchrun_world.py"


@pytest.fixture(autouse=True, scope="session")
def _stop_worker_pools():
    yield
    shutdown_pools()


@pytest.fixture
def no_training_process(monkeypatch):
    """``cpvlm train`` parses and validates, but a launch of training processes fails the test (and
    no launcher's rank variables leak in from the environment)."""
    from cpvlm.train import launcher

    def trap(config):
        raise AssertionError(f"a training process was started for {config}")

    monkeypatch.setattr(launcher, "launch_local", trap)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _pooled_training(request, monkeypatch):
    """``cpvlm train`` in a test runs its ranks on the pooled gloo workers
    (``cpvlm.testing.pooled_train``), not on dp * cp new processes: a test launches processes
    only where the launch is what it tests, marked ``launch``."""
    if request.node.get_closest_marker("launch"):
        return
    from cpvlm.testing.pooled_train import launch_pooled
    from cpvlm.train import launcher

    monkeypatch.setattr(launcher, "launch_local", launch_pooled)


# The fast lane, `python -m pytest -m "not slow"` (docs/testing.md): these launch training
# processes (`cpvlm train`, torchrun, subprocesses that import transformers) or run for tens of
# seconds each; the rest of the suite checks every CP feature in-process or on pooled gloo ranks.
SLOW_MODULES = {
    "tests/test_examples.py",
    "tests/hf/test_trainer.py",
    "tests/hf/test_train_families.py",
    *(
        f"tests/train/test_train_{name}.py"
        for name in (
            "dynamic_cp", "exact", "expert_parallel", "failure", "families_realdata", "faults",
            "guards", "lora", "memory", "memory_options", "prepared", "realdata", "reshard",
            "resume", "tensor_parallel", "torchrun",
        )
    ),
}  # fmt: skip
SLOW_TESTS = {
    "tests/test_harness.py::test_results_from_8_ranks_and_the_pooled_ranks_stay",
    "tests/test_harness.py::test_failing_rank_reports_its_traceback_and_pool_recovers",
    "tests/test_harness.py::test_hanging_rank_times_out_and_is_named",
    "tests/test_harness.py::test_the_product_imports_no_test_harness_and_registers_nothing_at_exit",
    "tests/test_docs.py::test_a_runnable_block_runs",
    "tests/gpu/test_gpu_check.py::test_a_subprocess_section_is_killed_with_its_children_at_its_budget",
    "tests/attention/test_attn_compile.py::test_the_ring_schedule_on_the_cuda_call_sites_compiles_exactly",
    "tests/vision/test_vision_split_decode.py::test_the_loader_decodes_only_the_pieces_rows",
    "tests/hf/test_verify.py::test_verify_command_exit_codes",
    "tests/parallelize/test_tensor_parallel.py::test_verify_tp_exits_0_with_every_group_within_1e10",
    "tests/simulate/test_simulate.py::test_reduced_depth_and_optimizer_against_full_depth_and_hand_count",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module, _, name = item.nodeid.partition("::")
        if module in SLOW_MODULES or f"{module}::{name.split('[')[0]}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def pytest_report_header(config):
    # The ATen kernel family this run computes with (ATEN_CPU_CAPABILITY picks one the CPU has; an
    # invalid value is ignored with a warning): float64 exactness must not depend on it.
    return f"ATen CPU capability: {torch.backends.cpu.get_cpu_capability()}"


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TorchrunWorlds:
    """The example runs that the session's test modules declare, those of one world size in one
    torchrun launch (tests/hf/_torchrun_world.py), launched when a test first needs one of them:
    each launch's processes import transformers, most of its time.

    A module declares ``torchrun_runs(run_dir)`` -> ``{name: (processes, run)}``, ``run`` as
    tests/hf/_torchrun_world.py reads it, with ``run_dir(name)`` the directory of a run (its
    output, or its ``stdout`` files). A world runs the runs in the session's module order, each
    module's in its order.
    """

    def __init__(self, modules, root: Path):
        self.root = root
        self.runs: dict[str, tuple[int, dict]] = {}
        for module in modules:
            for name, entry in module.torchrun_runs(self.run_dir).items():
                assert name not in self.runs, f"two modules declare the torchrun run {name!r}"
                self.runs[name] = entry
        self._stderr: dict[int, str] = {}  # processes -> the stderr of that world's launch

    def run_dir(self, name: str) -> Path:
        return self.root / name.replace(" ", "_").replace(".", "")

    def __call__(self, name: str) -> Path:
        """The directory of run ``name``, once its world has run every one of its runs."""
        self.stderr(name)
        return self.run_dir(name)

    def stderr(self, name: str) -> str:
        """What the launch of run ``name``'s world wrote to stderr (every rank's)."""
        nproc = self.runs[name][0]
        if nproc not in self._stderr:
            self._stderr[nproc] = self._launch(nproc)
        return self._stderr[nproc]

    def _launch(self, nproc: int) -> str:
        names = [name for name, (n, _) in self.runs.items() if n == nproc]
        spec = self.root / f"world{nproc}.json"
        spec.write_text(json.dumps([self.runs[name][1] for name in names], indent=1))
        done = Path(f"{spec}.done")

        def launch():
            # A port of its own, not torchrun's fixed default (29500) that another job may hold.
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
            cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
            cmd += [str(WORLD_RUNNER), str(spec)]
            return cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=1200)

        cmd, proc = launch()
        if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
            # Known, not yet fixed: once in CI a rank aborted at interpreter exit, after its runs
            # had finished and saved (gloo's threads at shutdown). Launch once more, afresh; a
            # second failure fails the test.
            for name in names:
                shutil.rmtree(self.run_dir(name), ignore_errors=True)
            done.unlink(missing_ok=True)
            cmd, proc = launch()
        finished = [names[int(i)] for i in done.read_text().split()] if done.exists() else []
        assert proc.returncode == 0, (
            f"{' '.join(cmd)}\nfinished: {finished}\n{spec.read_text()}\n{proc.stderr[-4000:]}"
        )
        assert finished == names, finished
        return proc.stderr


@pytest.fixture(scope="session")
def torchrun_world(request, tmp_path_factory):
    """``torchrun_world(name)`` -> the directory of that run of a module's ``torchrun_runs``,
    its world launched once for the session (``TorchrunWorlds``)."""
    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "torchrun_runs") and module not in modules:
            modules.append(module)
    return TorchrunWorlds(modules, tmp_path_factory.mktemp("torchrun"))
