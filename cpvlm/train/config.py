"""Configuration of ``cpvlm train``: small frozen dataclasses, validated when built.

Every field declares its ``cpvlm train`` flag too (``cpvlm.config_cli``: the flag, its default,
choices and help). Every error names the config field, the command-line flag that sets it, and the
fix; the CP
options (``--cp``, ``--attn``, ``--vision``, ``--flow``, ``--layout``, ``--ulysses-size``) are
checked by ``cpvlm.options.CPOptions``, with the messages the library and ``cpvlm verify``
give. Checks that need the launch environment (the world size under torchrun) or the model (token
ids, merge size) live in ``resolve_world`` and ``cpvlm.train.data.check_data_fits``; all of them run before any
training process starts work.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cpvlm.config_cli import arg, like
from cpvlm.constants import (
    ATTN_IMPLS,
    DATA_PARALLEL,
    DECODE_MODES,
    DP_BALANCE,
    DTYPES,
    FLOWS,
    LAYOUTS,
    TRAIN_ON,
    VISION_MODES,
)
from cpvlm.options import CPOptions

TRAIN_DATA_PARALLEL = tuple(m for m in DATA_PARALLEL if m != "hsdp")  # a mesh without replicas
DEVICES = ("auto", "cpu", "cuda")
MIN_SEQ_LEN = 16


def _fail(field_name: str, flag: str, value: object, need: str) -> None:
    raise ValueError(f"{field_name} = {value!r} ({flag}): {need}")


def _positive_int(field_name: str, flag: str, value: object, *, zero_ok: bool = False) -> None:
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(
            field_name,
            flag,
            value,
            f"must be an integer >= {low}; pass {flag} {max(low, 1)} or more",
        )


def _finite(field_name: str, flag: str, value: object, *, positive: bool, example: str) -> None:
    """A finite number, > 0 (``positive``) or >= 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        _fail(field_name, flag, value, f"must be a finite number {need}, e.g. {flag} {example}")


def _choice(field_name: str, flag: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(field_name, flag, value, f"must be one of {', '.join(choices)}")


def _registry_default_model() -> str:
    from cpvlm.hf.registry import default_model

    return default_model()


def _model_help() -> str:
    from cpvlm.hf.registry import model_help

    return model_help()


@dataclass(frozen=True)
class LoRAConfig:
    """PEFT LoRA (``--lora-r``): the base model frozen, LoRA layers of rank ``r`` trained (see
    ``cpvlm.train.lora``)."""

    r: int = arg(
        8,
        help="train a PEFT LoRA adapter of rank R on the frozen model (only its matrices train; "
        "cpvlm export writes the adapter, or with --merge-lora the merged model)",
    )
    alpha: float | None = arg(None, help="LoRA alpha; the scale is alpha / R (default: 2 * R)")
    targets: tuple[str, ...] = arg(
        (),
        nargs="+",
        metavar="PATTERN",
        help="linear layers of the decoder layers to adapt: names, dotted suffixes or globs "
        "(default: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)",
    )  # (): lora.DEFAULT_TARGETS
    vision: bool = arg(
        False,
        help="also adapt every linear layer of the vision tower (default: the tower stays frozen)",
    )

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))  # a list, read from meta.json
        _positive_int("model.lora.r", "--lora-r", self.r)
        if self.alpha is not None:
            _finite("model.lora.alpha", "--lora-alpha", self.alpha, positive=True, example="16")
        if any(not isinstance(t, str) or not t.strip() for t in self.targets):
            _fail("model.lora.targets", "--lora-targets", self.targets, "name module patterns")

    @property
    def alpha_value(self) -> float:
        return 2 * self.r if self.alpha is None else self.alpha

    @classmethod
    def from_flags(cls, r, alpha, targets, vision) -> LoRAConfig | None:
        """The LoRA config of ``--lora-r/--lora-alpha/--lora-targets/--lora-vision``, or None."""
        if r is None:
            given = [
                flag
                for flag, value in (
                    ("--lora-alpha", alpha),
                    ("--lora-targets", targets),
                    ("--lora-vision", vision),
                )
                if value
            ]
            if given:
                _fail("model.lora", given[0], "unset", "LoRA needs its rank: add --lora-r R")
            return None
        return cls(r=r, alpha=alpha, targets=tuple(targets or ()), vision=bool(vision))


@dataclass(frozen=True)
class ModelConfig:
    """Which model, in which dtypes, what is trained, and how memory is traded for compute."""

    # a tiny model (TINY_MODELS) or a local checkpoint dir; default: the registry's default model
    name: str = arg(default_factory=_registry_default_model, flag="--model", help=_model_help)
    dtype: Literal[DTYPES] = arg(
        "float32",
        help="compute dtype; bfloat16 computes on float32 parameters and optimizer state",
    )
    param_dtype: Literal[DTYPES] | None = arg(
        None,
        help="parameter and optimizer-state dtype (default: float32 for --dtype bfloat16, else "
        "--dtype); --param-dtype bfloat16 with --dtype bfloat16 is pure bf16",
    )
    freeze_vision: bool = arg(
        False, help="freeze the vision encoder (its projector, e.g. the mergers, still trains)"
    )
    activation_checkpointing: bool = arg(
        False,
        help="recompute the decoder layers and vision blocks in the backward (less memory)",
    )
    loss_chunk: int = arg(
        1024,
        help="rows of logits at a time in the loss (recomputed in the backward); 0: all at once",
    )
    # train a LoRA adapter on the frozen model: the --lora-* flags (LoRAConfig.from_flags)
    lora: LoRAConfig | None = arg(None, prefix="lora")

    def __post_init__(self):
        if isinstance(self.lora, dict):  # read from meta.json
            object.__setattr__(self, "lora", LoRAConfig(**self.lora))
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            _fail("model.lora", "--lora-r", self.lora, "must be a LoRAConfig or None")
        if self.lora is not None and self.freeze_vision:
            _fail(
                "model.freeze_vision",
                "--freeze-vision",
                True,
                "with --lora-r the whole model, vision tower included, is frozen already; leave "
                "--freeze-vision out (--lora-vision adapts the tower)",
            )
        if not isinstance(self.name, str) or not self.name:
            _fail("model.name", "--model", self.name, "name a tiny model or a checkpoint directory")
        _choice("model.dtype", "--dtype", self.dtype, DTYPES)
        if self.param_dtype is not None:
            _choice("model.param_dtype", "--param-dtype", self.param_dtype, DTYPES)
            if self.param_dtype != self.dtype and (self.dtype, self.param_dtype) != (
                "bfloat16",
                "float32",
            ):
                _fail(
                    "model.param_dtype",
                    "--param-dtype",
                    self.param_dtype,
                    f"with --dtype {self.dtype} the parameters are {self.dtype} too; a separate "
                    "parameter dtype is for --dtype bfloat16 (float32: mixed precision, the "
                    "default; bfloat16: pure bf16)",
                )
        _positive_int("model.loss_chunk", "--loss-chunk", self.loss_chunk, zero_ok=True)

    @property
    def master_dtype(self) -> str:
        """The dtype of the parameters and the optimizer state."""
        if self.param_dtype is not None:
            return self.param_dtype
        return "float32" if self.dtype == "bfloat16" else self.dtype

    @property
    def mixed_precision(self) -> bool:
        """Compute in ``dtype`` on ``master_dtype`` parameters (bf16 on float32)."""
        return self.master_dtype != self.dtype

    @property
    def torch_dtype(self):
        """The compute dtype."""
        import torch  # lazily: flags are validated without loading torch

        return getattr(torch, self.dtype)

    @property
    def torch_master_dtype(self):
        import torch

        return getattr(torch, self.master_dtype)


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks split the work: cp ranks per sequence, dp replicas of the batch, and the CP
    options (``cpvlm.options.CPOptions``: its defaults and its checks, as in the library)."""

    cp: int = arg(4, help="context-parallel ranks per sequence")
    dp: int | None = arg(
        None, help="data-parallel replicas (default: 1, or world / cp under torchrun)"
    )  # None: 1 when cpvlm launches the ranks, world // cp under torchrun
    attn: Literal[ATTN_IMPLS] = like(CPOptions, "attn")
    ulysses_size: int | None = like(CPOptions, "ulysses_size")
    layout: Literal[LAYOUTS] = like(CPOptions, "layout")
    vision: Literal[VISION_MODES] = like(CPOptions, "vision")
    flow: Literal[FLOWS] = like(CPOptions, "flow")
    data_parallel: Literal[TRAIN_DATA_PARALLEL] = arg(
        "fsdp", help="gradient sync over dp x cp (all sum)"
    )
    ep: int = arg(
        1,
        help="expert parallelism (MoE models): each MoE layer's experts sharded over EP groups "
        "of N ranks of dp x cp, tokens sent to their experts' ranks; N divides dp x cp and the "
        "number of experts",
    )
    tp: int = arg(
        1,
        help="tensor parallelism: N ranks per (dp, cp) coordinate split the decoder layers "
        "(attention heads, MLP columns; the rest replicated); N divides the heads, key-value "
        "heads and MLP width",
    )
    dynamic_cp: bool = arg(
        False,
        help="dynamic CP: each packed row over as few of its CP group's ranks as it needs (a "
        "divisor of --cp), a step's rows in rounds of rows side by side (docs/training.md)",
    )
    dynamic_cp_tokens: int | None = arg(
        None,
        help="--dynamic-cp: the most tokens of a row a rank holds (default: ceil(--seq-len / "
        "--cp), what a full row leaves each rank under static CP)",
    )

    def __post_init__(self):
        _ = self.options  # CPOptions checks the CP options (the same rules as the library)
        if self.dp is not None:
            _positive_int("parallel.dp", "--dp", self.dp)
        _choice(
            "parallel.data_parallel", "--data-parallel", self.data_parallel, TRAIN_DATA_PARALLEL
        )
        _positive_int("parallel.ep", "--ep", self.ep)
        if self.ep > 1 and self.data_parallel == "ddp":
            _fail(
                "parallel.ep",
                "--ep",
                self.ep,
                "expert parallelism runs with --data-parallel fsdp or none, not ddp",
            )
        if self.ep > 1 and self.dp is not None and (self.dp * self.cp) % self.ep:
            _fail(
                "parallel.ep",
                "--ep",
                self.ep,
                f"must divide the {self.dp * self.cp} ranks of --dp {self.dp} x --cp {self.cp} "
                "(an EP group is ep of them); use a divisor of dp x cp, or --ep 1",
            )
        _positive_int("parallel.tp", "--tp", self.tp)
        if self.tp > 1 and self.ep > 1:
            _fail("parallel.tp", "--tp", self.tp, "does not combine with --ep yet; use --ep 1")
        if self.tp > 1 and self.data_parallel == "ddp":
            _fail(
                "parallel.tp",
                "--tp",
                self.tp,
                "tensor parallelism runs with --data-parallel fsdp or none, not ddp",
            )
        if self.dynamic_cp_tokens is not None:
            _positive_int(
                "parallel.dynamic_cp_tokens", "--dynamic-cp-tokens", self.dynamic_cp_tokens
            )
        if self.dynamic_cp:
            self._check_dynamic_cp()

    def _check_dynamic_cp(self) -> None:
        """What dynamic CP cannot run: each row's collectives on its own block of CP ranks."""
        refused = {
            "tp": (self.tp > 1, "a block of CP ranks would split a TP group's rows; use --tp 1"),
            "ep": (
                self.ep > 1,
                "an EP group's ranks would run different rows with different token counts at "
                "once; use --ep 1",
            ),
            "attn": (
                self.attn == "hybrid",
                "--attn hybrid's Ulysses groups need not divide a row's CP size; use ring, "
                "allgather, ulysses or auto",
            ),
            "vision": (
                self.vision == "split",
                "--vision split decodes pieces of images per static CP rank; use route, "
                "allgather or replicate",
            ),
        }
        for name, (bad, why) in refused.items():
            if bad:
                _fail(
                    f"parallel.{name}",
                    f"--{name}",
                    getattr(self, name),
                    f"does not run with --dynamic-cp: {why}",
                )

    @property
    def options(self) -> CPOptions:
        """The CP options of ``ContextParallelVLM`` (``cp_size`` is ``cp``)."""
        return CPOptions(
            attn=self.attn,
            vision=self.vision,
            flow=self.flow,
            layout=self.layout,
            ulysses_size=self.ulysses_size,
            cp_size=self.cp,
        )

    @property
    def world_size(self) -> int:
        return self.cp * (self.dp or 1) * self.tp


def _optional_pixels(field_name: str, flag: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        _fail(field_name, flag, value, "must be a pixel count >= 1 (or left out: the processor's)")


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from, how they become tokens and pixels, and how they are packed.

    A step trains on ``rows_per_step = batch_size * grad_accum * dp`` packed rows (the global
    batch), the next ones of one global stream of rows (see ``cpvlm.data.rows`` and
    ``cpvlm.data.loader``). A resumed run keeps the global batch: with another dp,
    ``grad_accum`` left unset becomes ``rows_per_step / (dp * batch_size)``.
    """

    # "synthetic"; a .jsonl file, a datasets save_to_disk folder, .parquet files; or
    # "package.module:function" (see cpvlm.data.sources)
    source: str = arg(
        "synthetic",
        flag="--data",
        help="'synthetic', a .jsonl file of conversations, a datasets save_to_disk folder, "
        ".parquet files, a cpvlm prepare folder, or pkg.module:function (see "
        "cpvlm/data/sources.py)",
    )
    data_args: tuple[str, ...] = arg(
        (),
        flag="--data-arg",
        action="append",
        metavar="KEY=VALUE",
        help="keyword argument of a pkg.module:function data source (repeatable)",
    )
    seq_len: int = arg(512, help="tokens per packed row")  # one row per CP forward
    batch_size: int = arg(1, help="packed rows per DP rank per microbatch")
    grad_accum: int | None = arg(
        None,
        help="microbatches per step (default: 1; on --resume with another dp: what keeps the "
        "run's rows per step)",
    )
    train_on: Literal[TRAIN_ON] = arg(
        "assistant", help="conversations: labels on the assistant turns only, or on all text"
    )
    min_pixels: int | None = arg(
        None, help="images: fewest pixels after resizing (default: the processor's)"
    )
    max_pixels: int | None = arg(
        None, help="images: most pixels after resizing (default: the processor's)"
    )
    video_min_pixels: int | None = arg(
        None, help="videos: fewest pixels (default: the processor's)"
    )
    video_max_pixels: int | None = arg(None, help="videos: most pixels (default: the processor's)")
    shuffle: bool = arg(
        True,
        help="read the samples in a seeded permutation (--seed), a new one every epoch; "
        "--no-shuffle: in order",
    )
    pack_window: int = arg(64, help="samples packed together, longest first")  # first-fit decr.
    num_workers: int = arg(
        2, help="DataLoader workers per rank decoding images and frames (0: in the rank)"
    )
    prefetch: int = arg(2, help="rows each worker prepares ahead")
    decode: Literal[DECODE_MODES] = arg(
        "local",
        help="local: each rank decodes only the images/frames it encodes; all: every rank all",
    )
    dp_balance: Literal[DP_BALANCE] = arg(
        "cost",
        help="deal a step's rows to DP ranks by modelled cost (decoder, attention, vision) or "
        "by tokens",
    )
    strict: bool = arg(
        False, help="stop at the first bad sample (default: skip it, logged in data_errors.jsonl)"
    )

    def __post_init__(self):
        from pathlib import Path as _Path

        if not isinstance(self.source, str) or not self.source:
            _fail("data.source", "--data", self.source, "name a data file, folder or function")
        is_function = self.source.count(":") == 1 and not _Path(self.source).exists()
        if self.source != "synthetic" and not is_function and not _Path(self.source).exists():
            _fail(
                "data.source",
                "--data",
                self.source,
                "no such file or folder; use 'synthetic', a .jsonl file, a datasets folder, "
                ".parquet files, or 'package.module:function'",
            )
        if not isinstance(self.data_args, tuple) or any("=" not in a for a in self.data_args):
            _fail("data.data_args", "--data-arg", self.data_args, "each must be key=value")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int):
            _fail("data.seq_len", "--seq-len", self.seq_len, "must be an integer")
        if self.seq_len < MIN_SEQ_LEN:
            _fail("data.seq_len", "--seq-len", self.seq_len, f"use --seq-len {MIN_SEQ_LEN} or more")
        _positive_int("data.batch_size", "--batch-size", self.batch_size)
        if self.grad_accum is not None:
            _positive_int("data.grad_accum", "--grad-accum", self.grad_accum)
        _choice("data.train_on", "--train-on", self.train_on, TRAIN_ON)
        for name in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels"):
            _optional_pixels(f"data.{name}", "--" + name.replace("_", "-"), getattr(self, name))
        _positive_int("data.pack_window", "--pack-window", self.pack_window)
        _positive_int("data.num_workers", "--num-workers", self.num_workers, zero_ok=True)
        _positive_int("data.prefetch", "--prefetch", self.prefetch)
        _choice("data.decode", "--decode", self.decode, DECODE_MODES)
        _choice("data.dp_balance", "--dp-balance", self.dp_balance, DP_BALANCE)

    def rows_per_rank(self) -> int:
        """Packed rows per DP rank per step (``grad_accum`` must be resolved)."""
        return self.batch_size * self.grad_accum


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup to a constant learning rate, and gradient-norm clipping.

    The schedule does not depend on the number of steps, so a run stopped at step K and resumed
    to step N follows the same learning rates as a run of N steps.
    """

    lr: float = arg(1e-2, help="peak learning rate")
    weight_decay: float = arg(0.0, help="AdamW weight decay")
    warmup_steps: int = arg(3, help="linear warmup to --lr")
    # 0 disables clipping (the norm is still logged)
    max_grad_norm: float = arg(1.0, help="clip the global gradient norm (0: off)")

    def __post_init__(self):
        _finite("optim.lr", "--lr", self.lr, positive=True, example="3e-3")
        _finite(
            "optim.weight_decay", "--weight-decay", self.weight_decay, positive=False, example="0.1"
        )
        _positive_int("optim.warmup_steps", "--warmup-steps", self.warmup_steps, zero_ok=True)
        _finite(
            "optim.max_grad_norm",
            "--max-grad-norm",
            self.max_grad_norm,
            positive=False,
            example="1.0",
        )

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        return self.lr


ON_SAVE_ERROR = ("continue", "stop")


@dataclass(frozen=True)
class RunConfig:
    """How long, where the outputs go, checkpoints, guards, and the device."""

    steps: int = arg(30, help="optimizer steps (in total, when resuming)")
    seed: int = arg(0, help="model init and data")
    # "" -> runs/train-<date>-<time> (see TrainConfig.with_default_out)
    out: str = arg("", help="output directory (default: runs/train-<date>-<time>)")
    ckpt_every: int = arg(
        50,
        help="checkpoint every N steps (0: only at the end, on SIGTERM/SIGINT and the last step)",
    )
    # True: the newest intact checkpoint; "auto": that, or start anew
    resume: bool | str = arg(
        False,
        nargs="?",
        const=True,
        choices=(True, "auto"),
        metavar="auto",
        help="continue the run in --out from its newest intact checkpoint (dp and cp may "
        "change); --resume auto: that, or start anew when there is none (requeued jobs)",
    )
    overwrite: bool = arg(False, help="replace the run already in --out, if any")
    skip_nonfinite: int = arg(
        0, help="skip up to N steps whose loss or gradient norm is not finite (else stop there)"
    )
    device: Literal[DEVICES] = arg("auto", help="auto: cuda under torchrun if available, else cpu")
    dist_timeout: int = arg(
        600,
        metavar="SECONDS",
        help="how long a collective waits for a rank; a rank that makes no progress for that "
        "long is named (its step and phase) and the run stops",
    )
    async_save: bool = arg(
        False,
        help="stage checkpoints to host memory and write them in the background (one at a time)",
    )
    on_save_error: Literal[ON_SAVE_ERROR] = arg(
        "continue",
        help="a checkpoint that cannot be written (full disk): warn and retry at the next "
        "interval, or stop; the previous checkpoint is kept either way",
    )

    def __post_init__(self):
        _positive_int("run.steps", "--steps", self.steps)
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**31
        ):
            _fail("run.seed", "--seed", self.seed, "must be an integer in [0, 2**31)")
        _positive_int("run.ckpt_every", "--ckpt-every", self.ckpt_every, zero_ok=True)
        _positive_int("run.skip_nonfinite", "--skip-nonfinite", self.skip_nonfinite, zero_ok=True)
        _choice("run.device", "--device", self.device, DEVICES)
        _positive_int("run.dist_timeout", "--dist-timeout", self.dist_timeout)
        _choice("run.on_save_error", "--on-save-error", self.on_save_error, ON_SAVE_ERROR)
        if self.resume not in (False, True, "auto"):
            _fail("run.resume", "--resume", self.resume, "pass --resume, or --resume auto")
        if self.resume and not self.out:
            _fail("run.out", "--out", self.out, "--resume continues the run in --out DIR; pass it")
        if self.resume and self.overwrite:
            _fail(
                "run.overwrite",
                "--overwrite",
                self.overwrite,
                "--resume continues the run in --out, --overwrite replaces it; pass one of them",
            )


# Fields a resumed run may change; everything else must match the checkpoint for exactness.
# dp and cp may change (the checkpoint is resharded, the data order is global), and with them
# grad_accum, as long as the global batch stays the same (checked in cpvlm.train.launcher).
RESUMABLE_CHANGES = (
    "run.steps",
    "run.ckpt_every",
    "run.resume",
    "run.overwrite",
    "run.skip_nonfinite",
    "run.out",
    "run.device",
    "run.dist_timeout",
    "run.async_save",
    "run.on_save_error",
    "parallel.cp",
    "parallel.dp",
    "parallel.ep",  # where the experts live, not what they are (DCP reshards them)
    "parallel.tp",  # how the layers are split, not what they are (DCP reshards them)
    "parallel.attn",
    "parallel.vision",
    "parallel.flow",
    "parallel.dynamic_cp",  # which ranks run a row, not which rows a step has
    "parallel.dynamic_cp_tokens",
    "data.grad_accum",
    "model.activation_checkpointing",
    "model.loss_chunk",
    "data.num_workers",  # where pixels are made, not which
    "data.prefetch",
    "data.decode",
    "data.dp_balance",  # which DP rank trains a row, not which rows a step has
)


@dataclass(frozen=True)
class TrainConfig:
    # each section's flags in an argument group of ``cpvlm train --help``
    model: ModelConfig = arg(default_factory=ModelConfig, group="model")
    parallel: ParallelConfig = arg(default_factory=ParallelConfig, group="parallelism")
    data: DataConfig = arg(default_factory=DataConfig, group="data")
    optim: OptimConfig = arg(
        default_factory=OptimConfig, group="optimizer (AdamW, linear warmup then constant)"
    )
    run: RunConfig = arg(default_factory=RunConfig, group="run")

    def __post_init__(self):
        for name, kind in (
            ("model", ModelConfig),
            ("parallel", ParallelConfig),
            ("data", DataConfig),
            ("optim", OptimConfig),
            ("run", RunConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"TrainConfig.{name} must be a {kind.__name__}")
        if self.parallel.tp > 1 and self.model.lora is not None:  # PEFT wraps the planned layers
            _fail(
                "parallel.tp",
                "--tp",
                self.parallel.tp,
                "does not combine with LoRA yet; use --tp 1",
            )

    def replace(self, **sections) -> TrainConfig:
        """A copy with ``section={field: value}`` updates, e.g. ``replace(run={"steps": 5})``."""
        updates = {k: dataclasses.replace(getattr(self, k), **v) for k, v in sections.items()}
        return dataclasses.replace(self, **updates)

    def with_default_out(self) -> TrainConfig:
        if self.run.out:
            return self
        return self.replace(run={"out": str(Path("runs") / time.strftime("train-%Y%m%d-%H%M%S"))})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The config of ``to_dict``; fields missing from an older run take their defaults."""
        return cls(
            model=ModelConfig(**d["model"]),
            parallel=ParallelConfig(**d["parallel"]),
            data=DataConfig(**{**d["data"], "data_args": tuple(d["data"].get("data_args", ()))}),
            optim=OptimConfig(**d["optim"]),
            run=RunConfig(**d["run"]),
        )

    @property
    def rows_per_step(self) -> int:
        """The global batch: packed rows per optimizer step over all DP ranks."""
        return self.data.rows_per_rank() * self.parallel.dp

    def differences(self, other: TrainConfig, *, ignore=RESUMABLE_CHANGES) -> list[str]:
        """``"section.field: mine -> other"`` for every field that differs, except ``ignore``."""
        out = []
        a, b = self.to_dict(), other.to_dict()
        for section, fields in a.items():
            for name, value in fields.items():
                key = f"{section}.{name}"
                if key not in ignore and b[section][name] != value:
                    out.append(f"{key}: {value!r} -> {b[section][name]!r}")
        return out


def resolve_world(config: TrainConfig, world_size: int | None) -> TrainConfig:
    """Fill ``parallel.dp`` and check it against the launcher's world size.

    ``world_size=None``: cpvlm launches the ranks itself (dp defaults to 1). Otherwise the world
    comes from torchrun and must be dp * cp * tp.
    """
    cp, dp, tp = config.parallel.cp, config.parallel.dp, config.parallel.tp
    if world_size is None:
        return config.replace(parallel={"dp": dp or 1})
    with_tp = f" x --tp {tp}" if tp > 1 else ""
    if world_size % (cp * tp):
        _fail(
            "parallel.cp",
            "--cp",
            cp,
            f"--cp {cp}{with_tp} must divide the launcher's world size {world_size} (torchrun "
            f"--nproc-per-node x --nnodes); use a --cp{with_tp and ' x --tp'} that divides "
            f"{world_size}",
        )
    if dp is not None and dp * cp * tp != world_size:
        _fail(
            "parallel.dp",
            "--dp",
            dp,
            f"--dp {dp} x --cp {cp}{with_tp} = {dp * cp * tp} ranks, but the launcher started "
            f"{world_size}; use --dp {world_size // (cp * tp)} or leave --dp out",
        )
    # ParallelConfig checks ep again
    return config.replace(parallel={"dp": world_size // (cp * tp)})


def resolve_batch(config: TrainConfig, saved: TrainConfig | None) -> TrainConfig:
    """Fill ``data.grad_accum``: 1 for a new run; on resume, what keeps the saved global batch.

    ``saved`` is the config of the checkpoint a resumed run continues (``None`` for a new run);
    ``config.parallel.dp`` must be resolved. An explicit ``--grad-accum`` must keep the global
    batch too: a run's steps are defined by their rows.
    """
    data, dp = config.data, config.parallel.dp
    if saved is None:
        return config if data.grad_accum is not None else config.replace(data={"grad_accum": 1})
    rows = saved.rows_per_step
    if data.grad_accum is None:
        if rows % (dp * data.batch_size):
            _fail(
                "parallel.dp",
                "--dp",
                dp,
                f"the run trains {rows} row(s) per step (its global batch), which {dp} DP ranks of "
                f"--batch-size {data.batch_size} cannot split evenly; resume with a dp that "
                f"divides {rows // data.batch_size}",
            )
        return config.replace(data={"grad_accum": rows // (dp * data.batch_size)})
    if data.rows_per_rank() * dp != rows:
        _fail(
            "data.grad_accum",
            "--grad-accum",
            data.grad_accum,
            f"the run trains {rows} row(s) per step; --dp {dp} x --batch-size {data.batch_size} x "
            f"--grad-accum {data.grad_accum} = {data.rows_per_rank() * dp}; leave --grad-accum "
            "out to keep the run's global batch",
        )
    return config
