"""``cpvlm plan``: the configurations of a model that fit G GPUs of M GiB at a sequence length.

    cpvlm plan --model qwen3-vl-8b --seq-len 131072 --gpus 8 --gpu-mem 80
    cpvlm plan --model DIR --seq-len 1048576 --videos 7200x448x448 --gpus 16 --gpu-mem 80 --json

Every candidate (cp dividing the GPUs, dp the rest; attention; activation checkpointing on or off;
loss chunk) is one rank of the real step simulated on fake tensors (``cpvlm.simulate``), least
memory first; one that needs no less memory than a candidate that did not fit (smaller cp, no
checkpointing, a larger chunk) is listed as not simulated. ``--ep`` / ``--tp`` sizes are modelled
on the simulated ep = tp = 1 rank of gpus / tp ranks (``cpvlm.simulate.parallel_cost``; shown as
"modelled"), not simulated.

    cpvlm plan --model qwen3-vl-8b --seq-len 131072 --gpus 8 --gpu-mem 80 --cp 8 --dynamic-cp

``--dynamic-cp`` models a long-tailed step instead (``--rows`` rows per DP replica from
``--mix``, the longest ``--seq-len``) at each ``--cp``: step time under static CP against dynamic
CP (``cpvlm.simulate.dynamic_cp``), rows per CP size, rounds, modelled balance. Nothing is
simulated: dynamic CP never gives a rank more of a row than static CP does, so its peak memory
is the static candidate's (run without ``--dynamic-cp`` for it).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Literal

from cpvlm.cli import HelpFormatter
from cpvlm.config_cli import add_fields, arg, from_args


def _size(text: str, n: int) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.lower().split("x"))
    if len(parts) != n or min(parts) < 1:
        shape = "HxW" if n == 2 else "FRAMESxHxW"
        raise argparse.ArgumentTypeError(f"{text!r}: expected {shape} in pixels, e.g. 448x448")
    return parts


def _image(text: str) -> tuple[int, ...]:
    return _size(text, 2)


def _video(text: str) -> tuple[int, ...]:
    return _size(text, 3)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds of audio > 0, e.g. 30")
    return seconds


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """The flags of ``cpvlm plan`` (``cpvlm.config_cli``): the row, the GPUs, and what to try."""

    model: str = arg(help=lambda: _model_help())
    seq_len: int = arg(help="tokens of one training row")
    images: tuple[tuple[int, int], ...] = arg(
        (), type=_image, help="images in the row, HxW pixels each"
    )
    videos: tuple[tuple[int, int, int], ...] = arg(
        (), type=_video, help="videos in the row, FRAMESxHxW each"
    )
    audios: tuple[float, ...] = arg(
        (), type=_seconds, help="audio clips in the row, seconds each (models with audio)"
    )
    docs: int = arg(1, help="packed documents in the row")
    gpus: int = arg(help="GPUs (dp x cp x tp ranks)")
    gpu_mem: float = arg(help="memory per GPU, GiB")
    cp: tuple[int, ...] | None = arg(
        None, help="CP sizes to try (default: every divisor of --gpus)"
    )
    ep: tuple[int, ...] = arg(
        (1,), help="EP sizes to try (MoE models; modelled on the simulated ep 1 rank)"
    )
    tp: tuple[int, ...] = arg(
        (1,), help="TP sizes to try (modelled on the simulated tp 1 rank of gpus / tp ranks)"
    )
    attn: tuple[str, ...] = arg(("ring",), help="CP attentions to try")
    checkpointing: Literal["both", "on", "off"] = arg("both", help="activation checkpointing")
    loss_chunk: tuple[int, ...] = arg(
        (1024,), help="loss chunks to try (0: whole logits, never less memory than a chunk)"
    )
    json: bool = arg(False, help="print JSON instead of a table")
    dynamic_cp: bool = arg(
        False, help="model static against dynamic CP on a long-tailed step (no memory simulated)"
    )
    rows: int = arg(64, help="--dynamic-cp: rows per DP replica per step")
    mix: Literal["text", "video"] = arg(
        "video",
        help="--dynamic-cp: the step's rows: text (log-normal lengths), or video (one row in 16 "
        "a long video, the rest short image conversations)",
    )

    def __post_init__(self):
        if self.gpus < 1 or self.gpu_mem <= 0:
            raise ValueError("--gpus must be >= 1 and --gpu-mem > 0")
        bad = [c for c in self.cp or () if c < 1 or self.gpus % c]
        if bad:
            raise ValueError(f"--cp {bad} must divide --gpus {self.gpus}")
        bad = [t for t in self.tp if t < 1 or self.gpus % t]
        if bad:
            raise ValueError(f"--tp {bad} must divide --gpus {self.gpus}")
        if self.rows < 1:
            raise ValueError(f"--rows must be >= 1, got {self.rows}")
        if not self.ep or min(self.ep) < 1:
            raise ValueError(f"--ep {list(self.ep)}: sizes must be >= 1, e.g. --ep 1 8")

    def cps(self, tp: int = 1) -> list[int]:
        """The CP sizes to try beside ``tp``: ``cp``, or every divisor of ``gpus / tp``."""
        ranks = self.gpus // tp
        return [c for c in self.cp or range(1, ranks + 1) if ranks % c == 0]


def _model_help() -> str:
    from cpvlm.hf.registry import published_configs

    return (
        f"a published config name ({', '.join(published_configs())}), a tiny model, or a "
        "directory with a config.json"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpvlm plan", description=__doc__, formatter_class=HelpFormatter
    )
    add_fields(p, PlanConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    parsed = _parser().parse_args(argv)
    from tqdm import tqdm

    from cpvlm.simulate.batch import SequenceSpec
    from cpvlm.simulate.configs import load_config
    from cpvlm.simulate.plan import candidates, evaluate, with_ep_tp

    try:
        args = from_args(PlanConfig, parsed)
        config = load_config(args.model)
        spec = SequenceSpec(args.seq_len, args.images, args.videos, args.docs, args.audios)
        from cpvlm.hf import adapter_for

        adapter_for(config)  # an unsupported family fails here, with the supported list
    except (ValueError, OSError) as err:
        print(f"cpvlm plan: {err}", file=sys.stderr)
        return 2
    if args.dynamic_cp:
        return _dynamic_cp(config, args)
    ac = {"both": [False, True], "on": [True], "off": [False]}[args.checkpointing]
    chunks = [c or None for c in args.loss_chunk]
    by_tp = {
        tp: candidates(args.gpus // tp, args.cps(tp), list(args.attn), ac, chunks) for tp in args.tp
    }
    total = sum(map(len, by_tp.values()))
    results = []
    with tqdm(total=total, desc="simulating", file=sys.stderr, dynamic_ncols=True) as bar:
        for tp, setups in by_tp.items():
            simulated = evaluate(config, spec, setups, args.gpu_mem, progress=bar)
            results += with_ep_tp(config, spec, simulated, args.ep, tp, args.gpu_mem)
    budget = args.gpu_mem * 2**30
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "sequence": spec.describe(),
                    "gpus": args.gpus,
                    "gpu_mem_gib": args.gpu_mem,
                    "candidates": [dict(r.as_dict(), fits=r.fits(budget)) for r in results],
                },
                indent=1,
            )
        )
        return 0
    _print_table(results, budget, args, spec)
    return 0 if any(r.fits(budget) for r in results) else 1


def _print_table(results, budget, args, spec) -> None:
    g = 2**30
    print(f"{args.model}: {spec.describe()} on {args.gpus} x {args.gpu_mem:g} GiB (per-rank GiB)")
    head = f"{'cp':>3} {'dp':>3} {'ep':>3} {'tp':>2} {'attn':<9} {'ckpt':>4} {'chunk':>5} {'params':>7} {'grads':>6} {'optim':>6} {'saved':>7} {'loss':>6} {'acts':>7} {'peak':>7} {'fits':>4} {'step s':>7} {'longest':>9}"
    print(head)
    for r in results:
        s = r.setup
        lead = f"{s.cp:>3} {s.dp:>3} {r.ep:>3} {r.tp:>2} {s.attn:<9} {'on' if s.activation_checkpointing else 'off':>4} {s.loss_chunk or '-':>5}"
        if r.memory is None or r.error is not None:
            print(f"{lead}  error: {r.error}")
            continue
        m = r.memory
        if r.modelled is not None:  # ep or tp > 1: the simulated rank's bytes moved, not simulated
            md = r.modelled
            print(
                f"{lead} {'modelled: weights':>30} {md['weights'] / g:6.2f} {'':>22} "
                f"{md['peak'] / g:7.2f} {'yes' if r.fits(budget) else 'no':>4} {r.step_s:7.2f} "
                f"{r.longest:>9}"
            )
            continue
        print(
            f"{lead} {m.params / g:7.2f} {m.grads / g:6.2f} {m.optimizer / g:6.2f} {m.saved / g:7.2f} "
            f"{m.loss_saved / g:6.2f} {m.activations / g:7.2f} {m.steady_peak / g:7.2f} "
            f"{'yes' if r.fits(budget) else 'no':>4} {r.step_s:7.2f} {r.longest:>9}"
        )
    print(
        "saved: activations saved for backward; loss: their logits/loss part; acts: the step's "
        "peak beyond params+grads+optimizer; longest: sequence that fits (activations linear in S)"
    )
    if any(r.modelled is not None for r in results):
        print(
            "modelled (ep or tp > 1): the simulated ep = tp = 1 rank with the experts' and the "
            "TP-split layers' bytes moved (cpvlm/simulate/parallel_cost.py), not simulated"
        )


def _dynamic_cp(config, args) -> int:
    from cpvlm.simulate.dynamic_cp import MIXES, compare

    metas = MIXES[args.mix](args.seq_len, args.rows)
    results = [compare(config, metas, args.seq_len, cp, args.gpus // cp) for cp in args.cps()]
    if args.json:
        rows = [r.as_dict() for r in results]
        print(json.dumps({"model": args.model, "mix": args.mix, "results": rows}, indent=1))
        return 0
    print(
        f"{args.model}: dynamic CP, {args.rows} rows per DP replica of the {args.mix} mix, "
        f"the longest {args.seq_len} tokens, on {args.gpus} GPUs (modelled, H100 figures)"
    )
    print(
        f"{'cp':>3} {'dp':>3} {'static s':>9} {'dynamic s':>9} {'speedup':>7} {'ideal s':>8} "
        f"{'rounds':>9} {'balance':>7} {'plan ms':>7}  rows per c"
    )
    for r in results:
        sizes = " ".join(f"{c}:{n}" for c, n in sorted(r.sizes.items()))
        print(
            f"{r.cp:>3} {args.gpus // r.cp:>3} {r.static_s:9.3f} {r.dynamic_s:9.3f} "
            f"{r.speedup:7.2f} {r.ideal_s:8.3f} {f'{r.rows}->{r.rounds}':>9} {r.balance:7.3f} "
            f"{r.plan_ms:7.2f}  {sizes}"
        )
    print(
        "rounds: static CP runs one a row, dynamic CP packs rows into fewer; ideal: every row's "
        "compute spread evenly, nothing else; balance: busy rank-time over the group's. Peak "
        "memory is static CP's by construction (no rank holds more of a row): run without "
        "--dynamic-cp for it"
    )
    return 0
