"""Start-up of ``cpvlm train`` on N conversations, from the JSONL file and from a ``cpvlm prepare``
folder of it.

    python benchmarks/host_startup.py                # N = 100k: prepare plans them all (long)
    python benchmarks/host_startup.py --quick --out-dir DIR  # N = 500, one repeat: a trial run
    python benchmarks/host_startup.py --samples 10000 --repeats 2  # the committed run

The committed run (N = 10k) took 20 minutes on 2 cores shared with six other jobs, ``prepare``
348 s of it (2 workers, ~29 samples/s): planning is per sample, so N = 100k would prepare for
about an hour there (its time falls with --workers).

Data: the conversations of ``cpvlm.integrations.hf.tiny_checkpoint.example_records`` (text, one
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
  ``meta(i)`` of every prepared one. Planning is per sample, so the JSONL figure is measured on
  the first ``all_sizes_measured`` samples (``--sizes-max``) and scaled to N where that is fewer;
- ``train_start_s`` (unless ``--no-train``): wall time of ``cpvlm train --steps 1`` (CP 1, one
  rank process), start to exit: imports, the rank's spawn, model build, the first step;
  ``first_step_data_s``: that step's wait for data (``data_time_s`` of metrics.jsonl: the
  loader's start, planning the first window, decoding pixels).

``prepare_s``: ``cpvlm prepare`` of the N samples with ``--workers`` processes, paid once;
``prepare_again_s``: the same command on the finished folder (checks the key, plans nothing).
Cheap parts are the best of ``--repeats`` runs; ``all_sizes_s`` of the JSONL file and
``train_start_s`` are one run each. Ratios are JSONL over prepared, measured in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import Clock, cores, parser, print_table, write_json

SAMPLES, QUICK_SAMPLES = [100_000], [500]
WINDOW, SEQ_LEN, REPEATS, SIZES_MAX = 64, 1024, 3, 2000


def _write_data(folder: Path, n: int) -> tuple[Path, Path]:
    from cpvlm.integrations.hf.tiny_checkpoint import example_records, make_tiny_checkpoint

    ckpt = folder / "ckpt"
    if not ckpt.is_dir():
        make_tiny_checkpoint(ckpt, "qwen3_vl")
    pool = [json.dumps(r) for r in example_records(folder / "data", 25, seed=0)]
    jsonl = folder / "data" / f"train_{n}.jsonl"
    jsonl.write_text("".join(pool[i % len(pool)] + "\n" for i in range(n)))
    return ckpt, jsonl


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        clock = Clock()
        fn()
        times.append(clock.wall())
    return min(times)


def _encoder(ckpt: Path):
    from transformers import AutoConfig

    from cpvlm.integrations.hf.processor import ChatEncoder

    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    return config, ChatEncoder(ckpt, config)


def _first_rows(ckpt: Path, spec: str) -> None:
    from cpvlm.data import RowStream, open_source
    from cpvlm.data.prepared import PreparedSource
    from cpvlm.integrations.hf.prepared_key import check_prepared
    from cpvlm.train.config import DataConfig

    config, encoder = _encoder(ckpt)
    source = open_source(spec)
    plan = encoder.plan
    if isinstance(source, PreparedSource):
        check_prepared(source, encoder, config, DataConfig(source=spec))
        plan = source.plan
    next(RowStream(source, plan, seq_len=SEQ_LEN, window=WINDOW).rows())


def _all_sizes(ckpt: Path, spec: str, most: int) -> tuple[float, int]:
    """Seconds to read every sample's size (scaled to all N from the first ``most`` samples of
    a JSONL file; all of a prepared folder), and the samples measured."""
    from cpvlm.data import open_source
    from cpvlm.data.prepared import PreparedSource

    source = open_source(spec)
    total, n = 0, len(source)
    if isinstance(source, PreparedSource):
        clock = Clock()
        for i in range(n):
            total += source.meta(i).tokens
        return clock.wall(), n
    _, encoder = _encoder(ckpt)
    measured = min(n, most)
    clock = Clock()
    for i in range(measured):
        total += len(encoder.plan(source[i]))  # the example data has no bad samples
    return clock.wall() * n / measured, measured


def _train_start(ckpt: Path, spec: str, out: Path) -> tuple[float, float]:
    """Wall seconds of ``cpvlm train --steps 1``, and its first step's wait for data."""
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
    clock = Clock()
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    wall = clock.wall()
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return wall, first["data_time_s"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--samples", type=int, nargs="+", default=None, help="dataset sizes N")
    p.add_argument("--quick", action="store_true", help=f"N = {QUICK_SAMPLES}, one repeat")
    p.add_argument(
        "--sizes-max", type=int, default=SIZES_MAX, help="JSONL samples planned for all_sizes_s"
    )
    p.add_argument("--workers", type=int, default=cores(), help="cpvlm prepare processes")
    p.add_argument("--repeats", type=int, default=REPEATS, help="runs of the cheap parts")
    p.add_argument("--no-train", dest="train", action="store_false", help="skip cpvlm train")
    args = p.parse_args()
    if args.samples is None:
        args.samples = QUICK_SAMPLES if args.quick else SAMPLES
    if args.quick:
        args.repeats = 1
    from cpvlm.train.prepare import prepare_dataset

    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for n in args.samples:
            ckpt, jsonl = _write_data(folder, n)
            cache = folder / f"prepared_{n}"
            clock = Clock()
            prepare_dataset(str(ckpt), str(jsonl), cache, workers=args.workers, progress=False)
            prepare_s = clock.wall()
            clock = Clock()
            prepare_dataset(str(ckpt), str(jsonl), cache, workers=args.workers, progress=False)
            prepare_again_s = clock.wall()
            per = {}
            for name, spec in (("jsonl", str(jsonl)), ("prepared", str(cache))):
                from cpvlm.data import open_source

                r = {"samples": n, "source": name}
                r["open_s"] = _best(lambda spec=spec: open_source(spec), args.repeats)
                r["first_rows_s"] = _best(
                    lambda spec=spec, ckpt=ckpt: _first_rows(ckpt, spec), args.repeats
                )
                r["all_sizes_s"], r["all_sizes_measured"] = _all_sizes(ckpt, spec, args.sizes_max)
                if args.train:
                    run = folder / f"run_{name}"
                    r["train_start_s"], r["first_step_data_s"] = _train_start(ckpt, spec, run)
                if name == "prepared":
                    r["prepare_s"] = prepare_s
                    r["prepare_samples_per_s"] = n / prepare_s
                    r["prepare_again_s"] = prepare_again_s
                per[name] = r
                rows.append(r)
            keys = ["open_s", "first_rows_s", "all_sizes_s"]
            keys += ["train_start_s", "first_step_data_s"] * args.train
            ratios.append({"samples": n, **{k: per["jsonl"][k] / per["prepared"][k] for k in keys}})
            print(f"N={n}: prepared in {prepare_s:.1f} s with {args.workers} workers")
    columns = ["samples", "source", "open_s", "first_rows_s", "all_sizes_s", "all_sizes_measured"]
    columns += ["train_start_s", "first_step_data_s"] * args.train
    columns += ["prepare_s", "prepare_again_s"]
    print_table(rows, columns, "cpvlm train start-up: JSONL file vs cpvlm prepare folder")
    print_table(ratios, ["samples", *keys], "JSONL / prepared")
    write_json(
        args.out_dir,
        "host_startup",
        {
            "workers": args.workers,
            "pack_window": WINDOW,
            "seq_len": SEQ_LEN,
            "sizes_max": args.sizes_max,
            "rows": rows,
            "ratios": ratios,
        },
    )


if __name__ == "__main__":
    main()
