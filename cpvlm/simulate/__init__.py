"""One rank's real training step on fake tensors: per-rank memory at any size, ``cpvlm plan``."""

from cpvlm.simulate.batch import SequenceSpec, build_batch
from cpvlm.simulate.configs import load_config
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


def __getattr__(name: str):
    if name == "PUBLISHED":  # the family kits' published configs, from the registry on first use
        from cpvlm.simulate.configs import published

        return published()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
