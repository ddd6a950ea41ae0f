"""``cpvlm train``: flags -> TrainConfig -> launch. Flag defaults are the dataclass defaults.

Exit codes: 0 done; 1 a rank failed, stalled (``--dist-timeout``) or a step was not finite, or a
checkpoint could not be written (``--on-save-error stop``, or the last one); 2 a bad
configuration (nothing started); 128 + N stopped by signal N (SIGTERM: 143, SIGINT: 130) after
checkpointing, or killed by a second one.
"""

from __future__ import annotations

import argparse
import os
import sys

from cpvlm import options
from cpvlm.cli import HelpFormatter
from cpvlm.constants import DECODE_MODES, DP_BALANCE, DTYPES, TRAIN_ON
from cpvlm.train.config import (
    DEVICES,
    ON_SAVE_ERROR,
    TRAIN_DATA_PARALLEL,
    DataConfig,
    LoRAConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

DESCRIPTION = """\
Train a transformers VLM of a supported family with context parallelism (CP): every packed
sequence is split over --cp ranks, with gradients equal to the one-device run. Without a
launcher this starts dp * cp local CPU processes (gloo); under torchrun it uses torchrun's ranks
(NCCL on GPUs):
    torchrun --nproc-per-node 8 -m cpvlm.train --cp 4          (dp = 8 / 4 = 2)
The default is a tiny model on synthetic image/video/text data, CP=4, about a minute on CPU.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag, in one argument group per config section."""
    _model_flags(p.add_argument_group("model"), ModelConfig())
    _parallel_flags(p.add_argument_group("parallelism"), ParallelConfig())
    _data_flags(p.add_argument_group("data"), DataConfig())
    _optim_flags(
        p.add_argument_group("optimizer (AdamW, linear warmup then constant)"), OptimConfig()
    )
    _run_flags(p.add_argument_group("run"), RunConfig())


def _model_flags(g, m: ModelConfig) -> None:
    from cpvlm.hf.registry import model_help

    g.add_argument("--model", default=m.name, help=model_help())
    g.add_argument(
        "--dtype",
        default=m.dtype,
        choices=DTYPES,
        help="compute dtype; bfloat16 computes on float32 parameters and optimizer state",
    )
    g.add_argument(
        "--param-dtype",
        default=m.param_dtype,
        choices=DTYPES,
        help="parameter and optimizer-state dtype (default: float32 for --dtype bfloat16, else "
        "--dtype); --param-dtype bfloat16 with --dtype bfloat16 is pure bf16",
    )
    g.add_argument(
        "--freeze-vision",
        action="store_true",
        help="freeze the vision encoder (its projector, e.g. the mergers, still trains)",
    )
    g.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute the decoder layers and vision blocks in the backward (less memory)",
    )
    g.add_argument(
        "--loss-chunk",
        type=int,
        default=m.loss_chunk,
        help="rows of logits at a time in the loss (recomputed in the backward); 0: all at once",
    )
    _lora_flags(g)


def _lora_flags(g) -> None:
    g.add_argument(
        "--lora-r",
        type=int,
        default=None,
        help="train a PEFT LoRA adapter of rank R on the frozen model (only its matrices train; "
        "cpvlm export writes the adapter, or with --merge-lora the merged model)",
    )
    g.add_argument(
        "--lora-alpha",
        type=float,
        default=None,
        help="LoRA alpha; the scale is alpha / R (default: 2 * R)",
    )
    g.add_argument(
        "--lora-targets",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="linear layers of the decoder layers to adapt: names, dotted suffixes or globs (default: "
        "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)",
    )
    g.add_argument(
        "--lora-vision",
        action="store_true",
        help="also adapt every linear layer of the vision tower (default: the tower stays frozen)",
    )


def _parallel_flags(g, par: ParallelConfig) -> None:
    g.add_argument("--cp", type=int, default=par.cp, help="context-parallel ranks per sequence")
    g.add_argument(
        "--dp",
        type=int,
        default=par.dp,
        help="data-parallel replicas (default: 1, or world / cp under torchrun)",
    )
    options.add_arguments(g)  # --attn, --vision, --flow, --layout, --ulysses-size
    g.add_argument(
        "--data-parallel",
        default=par.data_parallel,
        choices=TRAIN_DATA_PARALLEL,
        help="gradient sync over dp x cp (all sum)",
    )


def _data_flags(g, d: DataConfig) -> None:
    g.add_argument(
        "--data",
        default=d.source,
        help="'synthetic', a .jsonl file of conversations, a datasets save_to_disk folder, "
        ".parquet files, a cpvlm prepare folder, or pkg.module:function (see "
        "cpvlm/data/sources.py)",
    )
    g.add_argument(
        "--data-arg",
        action="append",
        default=list(d.data_args),
        metavar="KEY=VALUE",
        help="keyword argument of a pkg.module:function data source (repeatable)",
    )
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per packed row")
    g.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="packed rows per DP rank per microbatch",
    )
    g.add_argument(
        "--grad-accum",
        type=int,
        default=d.grad_accum,
        help="microbatches per step (default: 1; on --resume with another dp: what keeps the "
        "run's rows per step)",
    )
    g.add_argument(
        "--train-on",
        default=d.train_on,
        choices=TRAIN_ON,
        help="conversations: labels on the assistant turns only, or on all text",
    )
    for name, what in (
        ("min-pixels", "images: fewest pixels after resizing"),
        ("max-pixels", "images: most pixels after resizing"),
        ("video-min-pixels", "videos: fewest pixels"),
        ("video-max-pixels", "videos: most pixels"),
    ):
        g.add_argument(
            f"--{name}", type=int, default=None, help=f"{what} (default: the processor's)"
        )
    g.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="read samples in order (default: a seeded permutation every epoch)",
    )
    g.add_argument(
        "--pack-window",
        type=int,
        default=d.pack_window,
        help="samples packed together, longest first",
    )
    g.add_argument(
        "--num-workers",
        type=int,
        default=d.num_workers,
        help="DataLoader workers per rank decoding images and frames (0: in the rank)",
    )
    g.add_argument(
        "--prefetch", type=int, default=d.prefetch, help="rows each worker prepares ahead"
    )
    g.add_argument(
        "--decode",
        default=d.decode,
        choices=DECODE_MODES,
        help="local: each rank decodes only the images/frames it encodes; all: every rank all",
    )
    g.add_argument(
        "--dp-balance",
        default=d.dp_balance,
        choices=DP_BALANCE,
        help="deal a step's rows to DP ranks by modelled cost (decoder, attention, vision) or "
        "by tokens",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first bad sample (default: skip it, logged in data_errors.jsonl)",
    )


def _optim_flags(g, o: OptimConfig) -> None:
    g.add_argument("--lr", type=float, default=o.lr, help="peak learning rate")
    g.add_argument("--weight-decay", type=float, default=o.weight_decay, help="AdamW weight decay")
    g.add_argument("--warmup-steps", type=int, default=o.warmup_steps, help="linear warmup to --lr")
    g.add_argument(
        "--max-grad-norm",
        type=float,
        default=o.max_grad_norm,
        help="clip the global gradient norm (0: off)",
    )


def _run_flags(g, r: RunConfig) -> None:
    g.add_argument(
        "--steps", type=int, default=r.steps, help="optimizer steps (in total, when resuming)"
    )
    g.add_argument("--seed", type=int, default=r.seed, help="model init and data")
    g.add_argument(
        "--out", default=r.out or None, help="output directory (default: runs/train-<date>-<time>)"
    )
    g.add_argument(
        "--ckpt-every",
        type=int,
        default=r.ckpt_every,
        help="checkpoint every N steps (0: only at the end, on SIGTERM/SIGINT and the last step)",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=r.resume,
        choices=(True, "auto"),
        metavar="auto",
        help="continue the run in --out from its newest intact checkpoint (dp and cp may "
        "change); --resume auto: that, or start anew when there is none (requeued jobs)",
    )
    g.add_argument(
        "--overwrite", action="store_true", help="replace the run already in --out, if any"
    )
    g.add_argument(
        "--skip-nonfinite",
        type=int,
        default=r.skip_nonfinite,
        help="skip up to N steps whose loss or gradient norm is not finite (else stop there)",
    )
    g.add_argument(
        "--device",
        default=r.device,
        choices=DEVICES,
        help="auto: cuda under torchrun if available, else cpu",
    )
    g.add_argument(
        "--dist-timeout",
        type=int,
        default=r.dist_timeout,
        metavar="SECONDS",
        help="how long a collective waits for a rank; a rank that makes no progress for that "
        "long is named (its step and phase) and the run stops",
    )
    g.add_argument(
        "--async-save",
        action="store_true",
        help="stage checkpoints to host memory and write them in the background (one at a time)",
    )
    g.add_argument(
        "--on-save-error",
        default=r.on_save_error,
        choices=ON_SAVE_ERROR,
        help="a checkpoint that cannot be written (full disk): warn and retry at the next "
        "interval, or stop; the previous checkpoint is kept either way",
    )


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(
            name=a.model,
            dtype=a.dtype,
            param_dtype=a.param_dtype,
            freeze_vision=a.freeze_vision,
            activation_checkpointing=a.activation_checkpointing,
            loss_chunk=a.loss_chunk,
            lora=LoRAConfig.from_flags(a.lora_r, a.lora_alpha, a.lora_targets, a.lora_vision),
        ),
        parallel=ParallelConfig(
            cp=a.cp,
            dp=a.dp,
            attn=a.attn,
            ulysses_size=a.ulysses_size,
            layout=a.layout,
            vision=a.vision,
            flow=a.flow,
            data_parallel=a.data_parallel,
        ),
        data=DataConfig(
            source=a.data,
            data_args=tuple(a.data_arg),
            seq_len=a.seq_len,
            batch_size=a.batch_size,
            grad_accum=a.grad_accum,
            train_on=a.train_on,
            min_pixels=a.min_pixels,
            max_pixels=a.max_pixels,
            video_min_pixels=a.video_min_pixels,
            video_max_pixels=a.video_max_pixels,
            shuffle=a.shuffle,
            pack_window=a.pack_window,
            num_workers=a.num_workers,
            prefetch=a.prefetch,
            decode=a.decode,
            dp_balance=a.dp_balance,
            strict=a.strict,
        ),
        optim=OptimConfig(
            lr=a.lr,
            weight_decay=a.weight_decay,
            warmup_steps=a.warmup_steps,
            max_grad_norm=a.max_grad_norm,
        ),
        run=RunConfig(
            steps=a.steps,
            seed=a.seed,
            out=a.out or "",
            ckpt_every=a.ckpt_every,
            resume=a.resume,
            overwrite=a.overwrite,
            skip_nonfinite=a.skip_nonfinite,
            device=a.device,
            dist_timeout=a.dist_timeout,
            async_save=a.async_save,
            on_save_error=a.on_save_error,
        ),
    )


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
