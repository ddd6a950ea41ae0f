"""Start-up of ``cpvlm train`` on N conversations, from the JSONL file and from a ``cpvlm prepare``
folder of it.

    python benchmarks/host_startup.py --samples 100000 --sizes-max 5000  # the committed run
    python benchmarks/host_startup.py --samples 10000 20000 --no-train  # prepare's growth
    python benchmarks/host_startup.py --quick --out-dir DIR  # N = 500, one repeat: a trial run

Planning is per sample (~2 to 3 CPU ms a conversation of this data), so ``prepare`` and every
sample's size from the JSONL file grow as N; the N = 10k, 30k and 100k rows show that scaling
measured, not extrapolated (``--sizes-max`` below N would scale the JSONL figure, and says so).

Data: the conversations of ``cpvlm.hf.tiny_checkpoint.example_records`` (text, one
or two PNG images, 3-5 frame videos; one or two turns), cycled to N lines of one JSONL file, and
the tiny Qwen3-VL checkpoint directory with its processor. ``cpvlm train`` plans lazily, a
packing window at a time (planning split over DP), so its start-up does not tokenize the dataset;
what a start costs in data, per source:

- ``open_s``: opening the source (indexing the JSONL lines; reading the prepared manifest);
- ``first_rows_s``: building the processor (both need it: to plan, or to decode pixels and check
  the folder's key) and planning the first packing window (``--pack-window`` samples) into rows,
  what a rank does before its first step;
- ``all_sizes_s``: every sample's length and grids, what planning a whole epoch (or a
  length-aware plan of the dataset) costs one process: ``encoder.plan`` of every JSONL sample,
  ``meta(i)`` of every prepared one, wall seconds and CPU seconds (``all_sizes_cpu_s``); the
  JSONL figure is measured on the first ``all_sizes_measured`` samples (``--sizes-max``, default
  all) and scaled to N only where that is fewer;
- ``train_start_s`` (unless ``--no-train``): wall time of ``cpvlm train --steps 1`` (CP 1, one
  rank process), start to exit: imports, the rank's spawn, model build, the first step;
  ``first_step_data_s``: that step's wait for data (``data_time_s`` of metrics.jsonl: the
  loader's start, planning the first window, decoding pixels); ``train_cpu_s``: the CPU seconds
  of that command and its rank processes. Its parts: ``imports_s`` (a fresh ``python`` importing
  torch, transformers and cpvlm's trainer: the launcher and the rank each pay it), the data's
  start (``open_s`` + ``first_rows_s``, measured in this process), ``first_step_s`` (the first
  step, ``step_time_s``, its data wait included) and ``rest_s``, what is left of
  ``train_start_s`` (the rank's spawn and second import, the model build, the exit).

``prepare_s``: ``cpvlm prepare`` of the N samples with ``--workers`` processes, paid once
(``prepare_cpu_s``: its CPU seconds, workers included; ``prepare_cpu_ms_per_sample``);
``prepare_again_s``: the same command on the finished folder (checks the key, plans nothing).
Cheap parts are the best of ``--repeats`` runs; ``all_sizes_s`` of the JSONL file and
``train_start_s`` are one run each. Ratios are JSONL over prepared, measured in the same run.
``load``: ``os.getloadavg()`` (1 min) when each row was finished (the machine may be shared:
wall seconds there are inflated, CPU seconds much less).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import Clock, cores, parser, print_table, write_json

SAMPLES, QUICK_SAMPLES = [10_000, 30_000, 100_000], [500]
WINDOW, SEQ_LEN, REPEATS = 64, 1024, 3


def _write_data(folder: Path, n: int) -> tuple[Path, Path]:
    from cpvlm.hf.tiny_checkpoint import example_records, make_tiny_checkpoint

    ckpt = folder / "ckpt"
    if not ckpt.is_dir():
        make_tiny_checkpoint(ckpt, "qwen3_vl")
    pool = [json.dumps(r) for r in example_records(folder / "data", 25, seed=0)]
    jsonl = folder / "data" / f"train_{n}.jsonl"
    jsonl.write_text("".join(pool[i % len(pool)] + "\n" for i in range(n)))
    return ckpt, jsonl


def _best(fn, repeats: int) -> tuple[float, float]:
    """The lowest wall seconds of ``repeats`` runs of ``fn``, and the lowest CPU seconds."""
    times = []
    for _ in range(repeats):
        clock = Clock()
        fn()
        times.append((clock.wall(), clock.cpu()))
    return min(t[0] for t in times), min(t[1] for t in times)


def _encoder(ckpt: Path):
    from transformers import AutoConfig

    from cpvlm.hf.data.processor import ChatEncoder

    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    return config, ChatEncoder(ckpt, config)


def _first_rows(ckpt: Path, spec: str) -> None:
    from cpvlm.data import RowStream, open_source
    from cpvlm.data.prepared import PreparedSource
    from cpvlm.hf.data.prepared_key import check_prepared
    from cpvlm.train.config import DataConfig

    config, encoder = _encoder(ckpt)
    source = open_source(spec)
    plan = encoder.plan
    if isinstance(source, PreparedSource):
        check_prepared(source, encoder, config, DataConfig(source=spec))
        plan = source.plan
    next(RowStream(source, plan, seq_len=SEQ_LEN, window=WINDOW).rows())


def _children_cpu() -> float:
    """CPU seconds of this process's finished (waited-for) children and theirs."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _all_sizes(ckpt: Path, spec: str, most: int | None) -> tuple[float, float, int]:
    """Wall and CPU seconds to read every sample's size (scaled to all N from the first ``most``
    samples of a JSONL file where that is fewer; all of a prepared folder), and the samples
    measured."""
    from cpvlm.data import open_source
    from cpvlm.data.prepared import PreparedSource

    source = open_source(spec)
    total, n = 0, len(source)
    if isinstance(source, PreparedSource):
        clock = Clock()
        for i in range(n):
            total += source.meta(i).tokens
        return clock.wall(), clock.cpu(), n
    _, encoder = _encoder(ckpt)
    measured = n if most is None else min(n, most)
    clock = Clock()
    for i in range(measured):
        total += len(encoder.plan(source[i]))  # the example data has no bad samples
    return clock.wall() * n / measured, clock.cpu() * n / measured, measured


IMPORTS = "import torch, transformers, cpvlm.cli, cpvlm.train.loop, cpvlm.hf"


def _imports() -> tuple[float, float]:
    """Wall and CPU seconds of a fresh ``python`` importing what ``cpvlm train`` imports."""
    clock, cpu = Clock(), _children_cpu()
    subprocess.run([sys.executable, "-c", IMPORTS], check=True, env=os.environ.copy())
    return clock.wall(), _children_cpu() - cpu


def _train_start(ckpt: Path, spec: str, out: Path) -> tuple[float, float, float, float]:
    """Wall seconds of ``cpvlm train --steps 1``, its first step's wait for data, its CPU
    seconds (the command and its ranks) and its first step's seconds."""
    cmd = [
        sys.executable,
        "-m",
        "cpvlm.cli",
        "train",
        "--model",
        str(ckpt),
        "--data",
        spec,
        "--steps",
        "1",
        "--cp",
        "1",
        "--seq-len",
        str(SEQ_LEN),
        "--pack-window",
        str(WINDOW),
        "--out",
        str(out),
        "--overwrite",
    ]
    clock, cpu = Clock(), _children_cpu()
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    wall, cpu = clock.wall(), _children_cpu() - cpu
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return wall, first["data_time_s"], cpu, first["step_time_s"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--samples", type=int, nargs="+", default=None, help="dataset sizes N")
    p.add_argument("--quick", action="store_true", help=f"N = {QUICK_SAMPLES}, one repeat")
    p.add_argument(
        "--sizes-max",
        type=int,
        default=None,
        help="JSONL samples planned for all_sizes_s (default: all N; fewer are scaled to N)",
    )
    p.add_argument("--workers", type=int, default=cores(), help="cpvlm prepare processes")
    p.add_argument(
        "--prepare-max",
        type=int,
        default=None,
        help="prepare (and measure the prepared folder) only for N up to this (default: all)",
    )
    p.add_argument("--repeats", type=int, default=REPEATS, help="runs of the cheap parts")
    p.add_argument("--no-train", dest="train", action="store_false", help="skip cpvlm train")
    args = p.parse_args()
    if args.samples is None:
        args.samples = QUICK_SAMPLES if args.quick else SAMPLES
    if args.quick:
        args.repeats = 1
    from cpvlm.train.prepare import PrepareConfig, prepare_dataset

    rows, ratios, load_start = [], [], os.getloadavg()[0]
    imports = min((_imports() for _ in range(args.repeats)), default=None) if args.train else None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for n in args.samples:
            ckpt, jsonl = _write_data(folder, n)
            cache = folder / f"prepared_{n}"
            prepared = args.prepare_max is None or n <= args.prepare_max
            setup = PrepareConfig(
                model=str(ckpt), data=str(jsonl), out=cache, workers=args.workers, progress=False
            )
            if prepared:
                clock, children = Clock(), _children_cpu()
                prepare_dataset(setup)
                prepare_s, prepare_cpu_s = clock.wall(), clock.cpu() + _children_cpu() - children
                clock = Clock()
                prepare_dataset(setup)
                prepare_again_s = clock.wall()
            per = {}
            sources = (("jsonl", str(jsonl)), ("prepared", str(cache)))[: 1 + prepared]
            for name, spec in sources:
                from cpvlm.data import open_source

                r = {"samples": n, "source": name}
                r["open_s"], r["open_cpu_s"] = _best(
                    lambda spec=spec: open_source(spec), args.repeats
                )
                r["first_rows_s"], r["first_rows_cpu_s"] = _best(
                    lambda spec=spec, ckpt=ckpt: _first_rows(ckpt, spec), args.repeats
                )
                sizes = _all_sizes(ckpt, spec, args.sizes_max)
                r["all_sizes_s"], r["all_sizes_cpu_s"], r["all_sizes_measured"] = sizes
                if args.train:
                    run = folder / f"run_{name}"
                    start = _train_start(ckpt, spec, run)
                    r["train_start_s"], r["first_step_data_s"], r["train_cpu_s"] = start[:3]
                    r["first_step_s"] = start[3]
                    r["imports_s"], r["imports_cpu_s"] = imports
                    r["rest_s"] = r["train_start_s"] - r["imports_s"] - r["open_s"]
                    r["rest_s"] -= r["first_rows_s"] + r["first_step_s"]
                if name == "prepared":
                    r["prepare_s"] = prepare_s
                    r["prepare_cpu_s"] = prepare_cpu_s
                    r["prepare_cpu_ms_per_sample"] = 1e3 * prepare_cpu_s / n
                    r["prepare_samples_per_s"] = n / prepare_s
                    r["prepare_again_s"] = prepare_again_s
                r["load"] = os.getloadavg()[0]
                per[name] = r
                rows.append(r)
            keys = ["open_s", "open_cpu_s", "first_rows_s", "first_rows_cpu_s", "all_sizes_s"]
            keys += ["all_sizes_cpu_s"] + ["train_start_s", "first_step_data_s"] * args.train
            if not prepared:
                print(f"N={n}: not prepared (--prepare-max {args.prepare_max})", flush=True)
                continue
            ratios.append({"samples": n, **{k: per["jsonl"][k] / per["prepared"][k] for k in keys}})
            print(
                f"N={n}: prepared in {prepare_s:.1f} s ({prepare_cpu_s:.1f} CPU s) with "
                f"{args.workers} workers",
                flush=True,
            )
    columns = ["samples", "source", "open_s", "open_cpu_s", "first_rows_s", "first_rows_cpu_s"]
    columns += ["all_sizes_s", "all_sizes_cpu_s"]
    columns += ["all_sizes_measured"]
    columns += ["train_start_s", "train_cpu_s", "imports_s", "first_step_s"] * args.train
    columns += ["first_step_data_s", "rest_s"] * args.train
    columns += ["prepare_s", "prepare_cpu_s", "prepare_cpu_ms_per_sample", "prepare_again_s"]
    columns += ["load"]
    print_table(rows, columns, "cpvlm train start-up: JSONL file vs cpvlm prepare folder")
    if ratios:
        print_table(ratios, ["samples", *keys], "JSONL / prepared")
    write_json(
        args.out_dir,
        "host_startup",
        {
            "workers": args.workers,
            "pack_window": WINDOW,
            "seq_len": SEQ_LEN,
            "sizes_max": args.sizes_max,
            "prepare_max": args.prepare_max,
            "repeats": args.repeats,
            "load_start": load_start,
            "rows": rows,
            "ratios": ratios,
        },
    )


if __name__ == "__main__":
    main()
