"""``cpvlm plan``: the configurations of a model that fit G GPUs of M GiB at a sequence length.

    cpvlm plan --model qwen3-vl-8b --seq-len 131072 --gpus 8 --gpu-mem 80
    cpvlm plan --model DIR --seq-len 1048576 --videos 7200x448x448 --gpus 16 --gpu-mem 80 --json

Every candidate (cp dividing the GPUs, dp the rest; attention; activation checkpointing on or off;
loss chunk) is one rank of the real step simulated on fake tensors (``cpvlm.simulate``), least
memory first; one that needs no less memory than a candidate that did not fit (smaller cp, no
checkpointing, a larger chunk) is listed as not simulated.
"""

from __future__ import annotations

import argparse
import json
import sys

from cpvlm.cli import HelpFormatter


def _size(text: str, n: int) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.lower().split("x"))
    if len(parts) != n or min(parts) < 1:
        shape = "HxW" if n == 2 else "FRAMESxHxW"
        raise argparse.ArgumentTypeError(f"{text!r}: expected {shape} in pixels, e.g. 448x448")
    return parts


def _parser() -> argparse.ArgumentParser:
    from cpvlm.hf.registry import published_configs

    p = argparse.ArgumentParser(
        prog="cpvlm plan", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"a published config name ({', '.join(published_configs())}), a tiny model, or a "
        "directory with a config.json",
    )
    p.add_argument("--seq-len", type=int, required=True, help="tokens of one training row")
    p.add_argument(
        "--images",
        nargs="*",
        default=[],
        type=lambda t: _size(t, 2),
        help="images in the row, HxW pixels each",
    )
    p.add_argument(
        "--videos",
        nargs="*",
        default=[],
        type=lambda t: _size(t, 3),
        help="videos in the row, FRAMESxHxW each",
    )
    p.add_argument("--docs", type=int, default=1, help="packed documents in the row")
    p.add_argument("--gpus", type=int, required=True, help="GPUs (dp x cp ranks)")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU, GiB")
    p.add_argument(
        "--cp", type=int, nargs="*", help="CP sizes to try (default: every divisor of --gpus)"
    )
    p.add_argument("--attn", nargs="*", default=["ring"], help="CP attentions to try")
    p.add_argument(
        "--checkpointing",
        choices=["both", "on", "off"],
        default="both",
        help="activation checkpointing",
    )
    p.add_argument(
        "--loss-chunk",
        type=int,
        nargs="*",
        default=[1024],
        help="loss chunks to try (0: whole logits, never less memory than a chunk)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from tqdm import tqdm

    from cpvlm.simulate.batch import SequenceSpec
    from cpvlm.simulate.configs import load_config
    from cpvlm.simulate.plan import candidates, evaluate

    try:
        if args.gpus < 1 or args.gpu_mem <= 0:
            raise ValueError("--gpus must be >= 1 and --gpu-mem > 0")
        config = load_config(args.model)
        spec = SequenceSpec(args.seq_len, tuple(args.images), tuple(args.videos), args.docs)
        from cpvlm.hf import adapter_for

        adapter_for(config)  # an unsupported family fails here, with the supported list
    except (ValueError, OSError) as err:
        print(f"cpvlm plan: {err}", file=sys.stderr)
        return 2
    cps = args.cp or [c for c in range(1, args.gpus + 1) if args.gpus % c == 0]
    bad = [c for c in cps if c < 1 or args.gpus % c]
    if bad:
        print(f"cpvlm plan: --cp {bad} must divide --gpus {args.gpus}", file=sys.stderr)
        return 2
    ac = {"both": [False, True], "on": [True], "off": [False]}[args.checkpointing]
    chunks = [c or None for c in args.loss_chunk]
    setups = candidates(args.gpus, cps, args.attn, ac, chunks)
    with tqdm(total=len(setups), desc="simulating", file=sys.stderr, dynamic_ncols=True) as bar:
        results = evaluate(config, spec, setups, args.gpu_mem, progress=bar)
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
    head = f"{'cp':>3} {'dp':>3} {'attn':<9} {'ckpt':>4} {'chunk':>5} {'params':>7} {'grads':>6} {'optim':>6} {'saved':>7} {'loss':>6} {'acts':>7} {'peak':>7} {'fits':>4} {'step s':>7} {'longest':>9}"
    print(head)
    for r in results:
        s = r.setup
        lead = f"{s.cp:>3} {s.dp:>3} {s.attn:<9} {'on' if s.activation_checkpointing else 'off':>4} {s.loss_chunk or '-':>5}"
        if r.memory is None:
            print(f"{lead}  error: {r.error}")
            continue
        m = r.memory
        print(
            f"{lead} {m.params / g:7.2f} {m.grads / g:6.2f} {m.optimizer / g:6.2f} {m.saved / g:7.2f} "
            f"{m.loss_saved / g:6.2f} {m.activations / g:7.2f} {m.steady_peak / g:7.2f} "
            f"{'yes' if r.fits(budget) else 'no':>4} {r.step_s:7.2f} {r.longest:>9}"
        )
    print(
        "saved: activations saved for backward; loss: their logits/loss part; acts: the step's "
        "peak beyond params+grads+optimizer; longest: sequence that fits (activations linear in S)"
    )
