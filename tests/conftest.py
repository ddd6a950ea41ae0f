import pytest
import torch

from cpvlm.testing import shutdown_pools


@pytest.fixture(autouse=True, scope="session")
def _stop_worker_pools():
    yield
    shutdown_pools()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (0 when both are all zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.abs().max().item()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / denom if denom > 0 else diff
