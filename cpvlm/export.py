"""`cpvlm export`: a trained run's checkpoint as a Hugging Face model directory.

    cpvlm export --run runs/a --out runs/a-hf               # the newest intact checkpoint
    cpvlm export --run runs/a --step 200 --out runs/a-200

The checkpoint (DCP, sharded however the run's ranks held it) is read on one process into the
run's model, whose ``save_pretrained`` writes safetensors and config.json in the parameters'
dtype (float32 for a mixed-precision run). When the run trained a local model directory, its
other files (tokenizer, processor, chat template) are copied along, so that
``AutoModelForImageTextToText.from_pretrained`` and ``AutoProcessor.from_pretrained`` load the
result as they loaded the original.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

# Files of a model directory that save_pretrained writes itself (or that hold the old weights).
_WRITTEN = ("config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class ExportError(ValueError):
    """The run or the output directory cannot be exported to; the message says why."""


def _checkpoint(run: Path, step: int | None) -> Path:
    from cpvlm.train.checkpoint import newest_intact, problem, step_dir

    if not (run / "checkpoints").is_dir():
        raise ExportError(f"--run {run}: no checkpoints directory; is it a cpvlm train --out?")
    if step is None:
        path, skipped = newest_intact(run)
        for line in skipped:
            print(f"cpvlm export: {line}", file=sys.stderr)
        if path is None:
            raise ExportError(f"--run {run}: no intact checkpoint to export")
        return path
    path = step_dir(run, step)
    if not path.is_dir():
        raise ExportError(f"--step {step}: {run} has no checkpoint of step {step}")
    why = problem(path)
    if why is not None:
        raise ExportError(f"--step {step}: the checkpoint is not intact: {why}")
    return path


def load_trained_model(checkpoint: str | Path):
    """The run's model with the weights of ``checkpoint`` (one process, no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from cpvlm.integrations.hf import build_model
    from cpvlm.train.checkpoint import read_meta
    from cpvlm.train.config import TrainConfig

    config = TrainConfig.from_dict(read_meta(checkpoint)["config"])
    model = build_model(
        config.model.name, dtype=config.model.torch_master_dtype, seed=config.run.seed
    )
    # The trainer saved ContextParallelVLM's state, whose ``model`` is this model.
    state = {"model": {f"model.{k}": v for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint))
    model.load_state_dict({k[len("model.") :]: v for k, v in state["model"].items()})
    return model, config


def export(run: str | Path, out: str | Path, *, step: int | None = None, overwrite: bool = False):
    """Write the checkpoint of ``run`` (step ``step``, default the newest intact) to ``out``."""
    run, out = Path(run), Path(out)
    checkpoint = _checkpoint(run, step)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} is not empty; choose another --out or pass --overwrite")
    model, config = load_trained_model(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    copied = []
    source = Path(config.model.name)
    if source.is_dir():
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name not in _WRITTEN and not f.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(f, out / f.name)
                copied.append(f.name)
    return checkpoint, copied


def main(argv: Sequence[str] | None = None) -> int:
    from cpvlm.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="cpvlm export",
        description="Write a cpvlm train checkpoint as a Hugging Face model directory "
        "(save_pretrained: safetensors, config, and the processor files of the trained model "
        "directory), loadable with AutoModelForImageTextToText.from_pretrained.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--run", required=True, help="the run's directory (cpvlm train --out)")
    parser.add_argument(
        "--step", type=int, default=None, help="the checkpoint's step (default: newest intact)"
    )
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)
    try:
        checkpoint, copied = export(args.run, args.out, step=args.step, overwrite=args.overwrite)
    except ExportError as err:
        print(f"cpvlm export: error: {err}", file=sys.stderr)
        return 2
    extra = f"; copied {', '.join(copied)}" if copied else ""
    print(f"cpvlm export: {checkpoint} -> {args.out} (save_pretrained{extra})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
