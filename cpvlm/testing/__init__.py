"""Test utilities: real gloo processes with timeouts and rank tracebacks; exactness checks."""

from cpvlm.testing.compare import rel_err
from cpvlm.testing.multiprocess import DistributedTestError, run_distributed, shutdown_pools

__all__ = ["DistributedTestError", "rel_err", "run_distributed", "shutdown_pools"]
