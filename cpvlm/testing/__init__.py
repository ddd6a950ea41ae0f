"""Test and benchmark utilities: every CP rank's attention in one process, a CPU stand-in for the
fused CUDA kernels, toy towers and vision cases. Nothing in ``cpvlm`` imports this package.

The multi-process runner and the comparison are ``cpvlm verify``'s engine (``cpvlm.verify``);
they are re-exported here for the tests' convenience.
"""

from cpvlm.testing.cp_simulation import simulate_cp_attention
from cpvlm.testing.emulated_kernels import EmulatedKernel
from cpvlm.verify.compare import rel_err
from cpvlm.verify.runner import DistributedTestError, run_distributed, shutdown_pools

__all__ = [
    "DistributedTestError",
    "EmulatedKernel",
    "rel_err",
    "run_distributed",
    "shutdown_pools",
    "simulate_cp_attention",
]
