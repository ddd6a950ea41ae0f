"""``cpvlm train``: flags -> TrainConfig -> launch. Every flag is a ``TrainConfig`` field's.

Exit codes: 0 done; 1 a rank failed, stalled (``--dist-timeout``) or a step was not finite, or a
checkpoint could not be written (``--on-save-error stop``, or the last one); 2 a bad
configuration (nothing started); 128 + N stopped by signal N (SIGTERM: 143, SIGINT: 130) after
checkpointing, or killed by a second one.
"""

from __future__ import annotations

import argparse
import os
import sys

from cpvlm.cli import HelpFormatter
from cpvlm.config_cli import add_fields, from_args
from cpvlm.train.config import TrainConfig

DESCRIPTION = """\
Train a transformers VLM of a supported family with context parallelism (CP): every packed
sequence is split over --cp ranks, with gradients equal to the one-device run. Without a
launcher this starts dp * cp local CPU processes (gloo); under torchrun it uses torchrun's ranks
(NCCL on GPUs):
    torchrun --nproc-per-node 8 -m cpvlm.train --cp 4          (dp = 8 / 4 = 2)
The default is a tiny model on synthetic image/video/text data, CP=4, about a minute on CPU.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag: one per ``TrainConfig`` field (``cpvlm.config_cli``), in one argument group
    per section."""
    add_fields(p, TrainConfig)


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of the parsed flags, field by field (validated by its sections)."""
    return from_args(TrainConfig, a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpvlm train", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``cpvlm train``: the exit code (see the module docstring).

    Under torchrun only rank 0 prints a configuration error or the reason a run stopped (every
    rank finds the same); an error while training propagates with its traceback, and torchrun
    reports it.
    """
    args = build_parser().parse_args(argv)
    from cpvlm.train.launcher import ConfigError, TrainingFailed, launch
    from cpvlm.train.loop import RunStopped

    try:
        try:
            config = config_from_args(args)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        launch(config)
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"cpvlm train: error: {err}", file=sys.stderr)
        return 2
    except TrainingFailed as err:
        print(f"cpvlm train: {err}", file=sys.stderr)
        return 1
    except RunStopped as stop:
        if os.environ.get("RANK", "0") == "0":
            print(f"cpvlm train: {stop}", file=sys.stderr)
        return stop.exit_code
    return 0
