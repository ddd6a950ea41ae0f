import pytest
import torch

from cpvlm.testing import shutdown_pools


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


def pytest_report_header(config):
    # The ATen kernel family this run computes with (ATEN_CPU_CAPABILITY picks one the CPU has; an
    # invalid value is ignored with a warning): float64 exactness must not depend on it.
    return f"ATen CPU capability: {torch.backends.cpu.get_cpu_capability()}"
