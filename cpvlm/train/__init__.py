"""``cpvlm train``: the trainer, synthetic multimodal data, checkpoints and resume.

Read in this order: config.py (what can be set), data.py (the sample protocol and packing),
synthetic.py (the default data), loop.py (one rank's training loop), checkpoint.py, metrics.py,
launcher.py (torchrun or local processes), command.py (the flags).
"""

from cpvlm.train.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from cpvlm.train.launcher import ConfigError, TrainingFailed, launch

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "TrainingFailed",
    "launch",
]
