"""One rank's real training step on fake tensors: per-rank memory at any size, ``cpvlm plan``."""

from cpvlm.simulate.batch import SequenceSpec, build_batch
from cpvlm.simulate.configs import PUBLISHED, load_config
from cpvlm.simulate.rank import RankMemory, Setup, simulate_step

__all__ = [
    "PUBLISHED",
    "RankMemory",
    "SequenceSpec",
    "Setup",
    "build_batch",
    "load_config",
    "simulate_step",
]
