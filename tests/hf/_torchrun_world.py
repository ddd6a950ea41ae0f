"""Run several example scripts one after another in one torchrun world (tests/conftest.py's
``torchrun_world``: the Trainer/TRL runs of tests/hf/test_trainer.py, the library step of
tests/test_examples.py).

    torchrun --nproc-per-node N tests/hf/_torchrun_world.py RUNS.json

RUNS.json is a list of ``{"script": path, "argv": [...], "copy": [[src, dst], ...], "stdout":
prefix}`` (``copy`` and ``stdout`` optional). Each run is the script itself, executed as
``torchrun script argv`` would (``runpy`` as ``__main__``), so the lines a user copies are the
lines tested; what the world shares is the processes (each imports transformers, TRL, PEFT and
accelerate once, which is most of a launch's time) and the process group. The group is made
once, by the first run that asks, and destroyed once, after the last run: a script's
``init_process_group()`` once the group exists, its ``destroy_process_group()`` and its
``end_training()`` are deferred, since a default group made again in the same processes would
read the addresses of the group before from torchrun's store under the same keys (the race
``cpvlm.train.launcher.torchrun_store`` describes). Between runs, accelerate's per-``Accelerator``
state is cleared, as in a new process, and the default dtype is checked to be a new process's.
``copy`` copies directories before the run (rank 0, then a barrier); ``stdout`` sends what the
run prints to ``prefix.RANK``, one file per rank. Rank 0 appends the index of every finished run
to ``RUNS.json.done``.
"""

import contextlib
import json
import os
import runpy
import shutil
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType


@contextlib.contextmanager
def _stdout_to(prefix):
    if prefix is None:
        yield
        return
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with open(f"{prefix}.{os.environ['RANK']}", "w") as f, contextlib.redirect_stdout(f):
        yield


def main() -> None:
    spec = sys.argv[1]
    with open(spec) as f:
        runs = json.load(f)
    lead = lambda: not dist.is_initialized() or dist.get_rank() == 0  # noqa: E731
    deferred = (Accelerator.end_training, dist.init_process_group, dist.destroy_process_group)
    end_training, init, destroy = deferred
    Accelerator.end_training = lambda self: None  # deferred: see the module docstring
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else init(*a, **k)
    dist.destroy_process_group = lambda group=None: None if group is None else destroy(group)
    group_state = None  # accelerate's record of the process group, made by its first run
    try:
        for index, run in enumerate(runs):
            assert torch.get_default_dtype() == torch.float32, (index, torch.get_default_dtype())
            if group_state is not None:  # as in a new process, but for the process group
                AcceleratorState._reset_state(reset_partial_state=False)
                GradientState._reset_state()
                PartialState._shared_state.clear()
                PartialState._shared_state.update(group_state)  # undoes an FSDP run's type
            for src, dst in run.get("copy", []):
                if lead():
                    shutil.copytree(src, dst)
                if dist.is_initialized():
                    dist.barrier()
            sys.argv = [run["script"], *run["argv"]]
            with _stdout_to(run.get("stdout")):
                runpy.run_path(run["script"], run_name="__main__")
            if group_state is None and PartialState._shared_state:
                group_state = dict(PartialState._shared_state)
                assert group_state["distributed_type"] != DistributedType.FSDP, (
                    "an FSDP run first: put it after another, whose state is a new process's"
                )
            if lead():
                with open(spec + ".done", "a") as f:
                    f.write(f"{index}\n")
    finally:
        Accelerator.end_training = end_training
        dist.init_process_group, dist.destroy_process_group = init, destroy
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
