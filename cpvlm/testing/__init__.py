"""Test utilities: real gloo processes with timeouts and rank tracebacks; exactness checks; every
CP rank's attention in one process; a CPU stand-in for the fused CUDA kernels."""

from cpvlm.testing.compare import rel_err
from cpvlm.testing.cp_simulation import simulate_cp_attention
from cpvlm.testing.emulated_kernels import EmulatedKernel
from cpvlm.testing.multiprocess import DistributedTestError, run_distributed, shutdown_pools

__all__ = [
    "DistributedTestError",
    "EmulatedKernel",
    "rel_err",
    "run_distributed",
    "shutdown_pools",
    "simulate_cp_attention",
]
