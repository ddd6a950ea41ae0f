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
