"""Test utilities: run functions on real gloo processes with timeouts and rank tracebacks."""

from cpvlm.testing.multiprocess import DistributedTestError, run_distributed, shutdown_pools

__all__ = ["DistributedTestError", "run_distributed", "shutdown_pools"]
