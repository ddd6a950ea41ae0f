"""`cpvlm export`: a trained run's checkpoint as a Hugging Face model directory.

    cpvlm export --run runs/a --out runs/a-hf               # the newest intact checkpoint
    cpvlm export --run runs/a --step 200 --out runs/a-200
    cpvlm export --run runs/lora --out runs/lora-adapter    # a --lora-r run: the PEFT adapter
    cpvlm export --run runs/lora --merge-lora --out runs/lora-merged

The checkpoint (DCP, sharded however the run's ranks held it) is read on one process into the
run's model, whose ``save_pretrained`` writes safetensors and config.json in the parameters'
dtype (float32 for a mixed-precision run). When the run trained a local model directory, its
other files (tokenizer, processor, chat template) are copied along, so that
``AutoModelForImageTextToText.from_pretrained`` and ``AutoProcessor.from_pretrained`` load the
result as they loaded the original.

A LoRA run (``cpvlm train --lora-r``) checkpoints only its LoRA matrices; the base model is
rebuilt as the run built it. Its export is the PEFT adapter directory (``adapter_config.json``,
``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, DIR)``), or with
``--merge-lora`` the model with the adapter merged into its weights (a ``from_pretrained``
directory, as for a full run).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cpvlm.config_cli import add_fields, arg, from_args

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

    from cpvlm.hf import build_model
    from cpvlm.train.checkpoint import read_meta
    from cpvlm.train.config import TrainConfig

    config = TrainConfig.from_dict(read_meta(checkpoint)["config"])
    model = build_model(
        config.model.name, dtype=config.model.torch_master_dtype, seed=config.run.seed
    )
    lora = config.model.lora
    hf_model = model
    if lora is not None:  # the PeftModel; its LoRA matrices are all the checkpoint holds
        from cpvlm.train.lora import peft_model

        model = peft_model(hf_model, lora, config.run.seed)
        hf_model = model.get_base_model()
    # The trainer saved ContextParallelVLM's state, whose ``model`` is this model.
    params = dict(hf_model.named_parameters())
    state = {
        "model": {
            f"model.{k}": v
            for k, v in hf_model.state_dict().items()
            if lora is None or (k in params and params[k].requires_grad)
        }
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint))
    loaded = {k[len("model.") :]: v for k, v in state["model"].items()}
    hf_model.load_state_dict(loaded, strict=lora is None)
    return model, config


def export(
    run: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    overwrite: bool = False,
    merge_lora: bool = False,
):
    """Write the checkpoint of ``run`` (step ``step``, default the newest intact) to ``out``:
    the model, or for a LoRA run its adapter (``merge_lora``: the merged model)."""
    run, out = Path(run), Path(out)
    checkpoint = _checkpoint(run, step)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} is not empty; choose another --out or pass --overwrite")
    model, config = load_trained_model(checkpoint)
    if merge_lora and config.model.lora is None:
        raise ExportError(f"--merge-lora: {run} is not a LoRA run (cpvlm train --lora-r)")
    if merge_lora:
        model = model.merge_and_unload()
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


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """The flags of ``cpvlm export`` (``cpvlm.config_cli``)."""

    run: str = arg(help="the run's directory (cpvlm train --out)")
    step: int | None = arg(None, help="the checkpoint's step (default: newest intact)")
    out: str = arg(help="the directory to write")
    overwrite: bool = arg(False, help="write into a non-empty --out")
    merge_lora: bool = arg(
        False,
        help="a LoRA run: write the model with the adapter merged in (default: the PEFT adapter)",
    )


def build_parser() -> argparse.ArgumentParser:
    from cpvlm.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="cpvlm export",
        description="Write a cpvlm train checkpoint as a Hugging Face model directory "
        "(save_pretrained: safetensors, config, and the processor files of the trained model "
        "directory), loadable with AutoModelForImageTextToText.from_pretrained.",
        formatter_class=HelpFormatter,
    )
    add_fields(parser, ExportConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = from_args(ExportConfig, build_parser().parse_args(argv))
    try:
        checkpoint, copied = export(
            args.run,
            args.out,
            step=args.step,
            overwrite=args.overwrite,
            merge_lora=args.merge_lora,
        )
    except ExportError as err:
        print(f"cpvlm export: error: {err}", file=sys.stderr)
        return 2
    extra = f"; copied {', '.join(copied)}" if copied else ""
    print(f"cpvlm export: {checkpoint} -> {args.out} (save_pretrained{extra})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
