"""``cpvlm prepare``: tokenize and plan a dataset once, for every later ``cpvlm train``.

    cpvlm prepare --model CKPT --data train.jsonl --out train.prepared
    cpvlm train   --model CKPT --data train.prepared --cp 2 ...

Every record of ``--data`` is planned with the checkpoint's processor as ``cpvlm train`` plans it
(chat template, tokenizer, grids from the image headers; no pixels), on all cores, and written to
a folder that ``cpvlm train --data`` reads without a tokenizer (the format:
``cpvlm.data.prepared``). Training from it gives the same rows, losses and bad-sample reports as
training from the source: the same records in the same order, the failed ones kept with their
error. Images and videos stay references to their files (or bytes) and are decoded at training
time by the rank that encodes them, so the source's media must stay where they are.

The folder is keyed by what produced it: the processor class, hashes of the tokenizer files, the
processor configs and the chat template, the model's token ids, ``--train-on`` and the pixel
limits. ``cpvlm train`` refuses a folder whose key differs from its own ``--model`` and flags,
naming each field that differs. An interrupted ``prepare`` keeps its finished shards; the same
command again resumes from the missing ones.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cpvlm.config_cli import add_fields, arg, from_args, like
from cpvlm.constants import TRAIN_ON
from cpvlm.data.errors import DataError
from cpvlm.data.prepared import (
    FORMAT_VERSION,
    SHARDS,
    PreparedSource,
    is_prepared,
    key_differences,
    plan_row,
    read_manifest,
    shard_path,
    write_manifest,
    write_shard,
)
from cpvlm.hf.data.prepared_key import FLAGS, PIXEL_FLAGS, prepared_key
from cpvlm.train.config import DataConfig

DEFAULT_SHARD_SIZE = 1024
PLANNING = "planning flags (part of the key: cpvlm train must pass the same)"


def _planning(name: str):
    """The ``DataConfig`` field ``name`` (its flag, default and help), in the planning group."""
    return like(
        DataConfig, name, group=PLANNING, **({} if name == "train_on" else {"metavar": "N"})
    )


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """What ``cpvlm prepare`` plans and how (its flags: ``cpvlm.config_cli``); the planning
    fields are ``DataConfig``'s, validated as ``cpvlm train`` validates them."""

    model: str = arg(
        metavar="DIR",
        help="checkpoint directory whose processor (tokenizer, chat template, image "
        "processor) plans the samples; cpvlm train --data OUT needs the same one",
    )
    data: str = arg(
        help="a .jsonl file of conversations, a datasets save_to_disk folder, .parquet "
        "files, or pkg.module:function (as cpvlm train --data)",
    )
    out: str | Path = arg(metavar="DIR", type=str, help="folder to write (or to finish)")
    data_args: tuple[str, ...] = like(DataConfig, "data_args")
    train_on: Literal[TRAIN_ON] = _planning("train_on")
    min_pixels: int | None = _planning("min_pixels")
    max_pixels: int | None = _planning("max_pixels")
    video_min_pixels: int | None = _planning("video_min_pixels")
    video_max_pixels: int | None = _planning("video_max_pixels")
    workers: int | None = arg(
        None, metavar="N", group="work", help="processes that plan shards (default: all cores)"
    )
    shard_size: int | None = arg(
        None,
        metavar="N",
        group="work",
        help=f"samples per shard file, the unit of resuming (default: {DEFAULT_SHARD_SIZE}, or "
        "fewer so that each worker gets 4 shards; on resume: the folder's)",
    )
    overwrite: bool = arg(False, group="work", help="replace an --out folder prepared otherwise")
    progress: bool | None = arg(
        None,
        group="work",
        help="a progress bar (default: one on a terminal); --no-progress: none",
    )

    def __post_init__(self):
        object.__setattr__(self, "data_args", tuple(self.data_args))
        _ = self.planning  # the train flags' validation
        if self.workers is not None and (
            isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1
        ):
            raise ValueError(f"--workers {self.workers}: must be 1 or more")
        if self.shard_size is not None and (
            not isinstance(self.shard_size, int) or self.shard_size < 1
        ):
            raise ValueError(f"--shard-size {self.shard_size}: must be a positive integer")

    @property
    def planning(self) -> DataConfig:
        """The ``cpvlm train`` data flags that plan a sample (part of the folder's key)."""
        return DataConfig(
            source=self.data,
            data_args=self.data_args,
            train_on=self.train_on,
            **{name: getattr(self, name) for name in PIXEL_FLAGS},
        )


def _source_fingerprint(spec: str, data_args) -> dict:
    """The source a cache was made from: its name, and the names, sizes and times of its files."""
    path = Path(spec)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files if path.exists() else []:
        st = f.stat()
        h.update(
            f"{f.relative_to(path) if path.is_dir() else f.name}:{st.st_size}:{st.st_mtime_ns};".encode()
        )
    name = str(path.resolve()) if path.exists() else spec
    return {"data": name, "data_args": list(data_args), "files": h.hexdigest()[:16]}


def _encoder(model: str, data):
    """The checkpoint's config and ``ChatEncoder`` for the flags of ``data``."""
    from transformers import AutoConfig

    from cpvlm.hf import adapter_for
    from cpvlm.hf.data.processor import ChatEncoder
    from cpvlm.train.loader import has_processor

    if not has_processor(model):
        raise ValueError(
            f"--model {model}: not a checkpoint directory with a tokenizer, chat template and "
            "image processor; cpvlm prepare plans samples with the model's own processor"
        )
    config = AutoConfig.from_pretrained(model, local_files_only=True)
    adapter_for(config)
    kwargs = {name: getattr(data, name) for name in ("train_on", *PIXEL_FLAGS)}
    return config, ChatEncoder(model, config, **kwargs)


# ---- the workers ---------------------------------------------------------------------------------

_WORK: dict = {}  # per worker process: the encoder, source, output folder and sizes


def _init(encoder, source, out: str, shard_size: int, samples: int, worker: bool = True) -> None:
    if worker:
        import torch

        from cpvlm.distributed import compat

        torch.set_num_threads(1)  # one core per worker process
        compat.die_with_parent()  # a killed prepare stops its workers (it resumes from whole shards)
    cost = encoder.adapter.vision_cost()
    _WORK.update(
        encoder=encoder,
        source=source,
        out=out,
        shard_size=shard_size,
        samples=samples,
        cost=cost.unit_cost,
    )


def _prepare_shard(k: int) -> int:
    """Plan the samples of shard ``k`` and write it; returns its sample count."""
    w = _WORK
    rows = []
    for i in range(k * w["shard_size"], min(w["samples"], (k + 1) * w["shard_size"])):
        where = f"sample {i}"
        try:
            record = w["source"][i]
            where = record.where
            result = w["encoder"].plan(record)
        except DataError as err:
            result = err
            where = where if where != f"sample {i}" else (err.where or where)
        rows.append(plan_row(i, where, result, w["cost"]))
    write_shard(shard_path(w["out"], k), rows)
    return len(rows)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _context():
    import multiprocessing as mp

    # fork: workers inherit the encoder and source without rebuilding them; elsewhere they are
    # pickled (the ChatEncoder rebuilds itself from its arguments).
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


# ---- the command -------------------------------------------------------------------------------


def prepare_dataset(config: PrepareConfig) -> dict:
    """Write (or finish) the prepared folder ``config.out``; returns its manifest."""
    from tqdm import tqdm

    from cpvlm.data import open_source, parse_data_args

    model, data, data_args = config.model, config.data, config.data_args
    shard_size, overwrite = config.shard_size, config.overwrite
    flags = config.planning
    workers = config.workers or _cores()
    model_config, encoder = _encoder(model, flags)
    source = open_source(data, data_args=parse_data_args(data_args), model_config=model_config)
    if isinstance(source, PreparedSource):
        raise ValueError(f"--data {data}: already a prepared folder")
    if getattr(source, "endless", False) or not hasattr(source, "__len__"):
        raise ValueError(f"--data {data}: an endless source cannot be prepared")
    key = prepared_key(encoder, model_config, flags)
    origin = _source_fingerprint(data, data_args)
    out = Path(config.out)
    n = len(source)
    old = _existing(out, key, origin, n, shard_size, overwrite)
    if old is not None and old.get("complete"):
        return old
    shard_size = old["shard_size"] if old is not None else shard_size
    shard_size = shard_size or max(1, min(DEFAULT_SHARD_SIZE, -(-n // (4 * workers))))
    manifest = {
        "format": FORMAT_VERSION,
        "key": key,
        "source": origin,
        "model": str(model),
        "samples": n,
        "shard_size": shard_size,
        "complete": False,
    }
    (out / SHARDS).mkdir(parents=True, exist_ok=True)
    for tmp in (out / SHARDS).glob("*.tmp"):  # half-written by an interrupted run
        tmp.unlink()
    write_manifest(out, manifest)
    shards = -(-n // shard_size)
    todo = [k for k in range(shards) if not shard_path(out, k).is_file()]
    done = n - sum(min(n, (k + 1) * shard_size) - k * shard_size for k in todo)
    args = (encoder, source, str(out), shard_size, n)
    bar = tqdm(
        total=n,
        initial=done,
        unit="sample",
        desc="cpvlm prepare",
        disable=None if config.progress is None else not config.progress,
    )
    with bar:
        if workers == 1 or len(todo) <= 1:
            _init(*args, worker=False)
            try:
                for k in todo:
                    bar.update(_prepare_shard(k))
            finally:
                _WORK.clear()
        else:
            with _context().Pool(min(workers, len(todo)), _init, args) as pool:
                for count in pool.imap_unordered(_prepare_shard, todo):
                    bar.update(count)
    manifest.update(complete=True, stats=_stats(out))
    write_manifest(out, manifest)
    return manifest


def _existing(out: Path, key, origin, n, shard_size, overwrite) -> dict | None:
    """The manifest of the same preparation in ``out`` (to resume or to keep), or None where
    there is none; a folder prepared otherwise is refused, or cleared under ``overwrite``."""
    if not is_prepared(out):
        if out.exists() and any(out.iterdir()):
            if not overwrite:
                raise ValueError(
                    f"--out {out}: not empty and not a prepared dataset; choose another --out "
                    "or pass --overwrite"
                )
            shutil.rmtree(out)
        return None
    old = read_manifest(out)
    diffs = key_differences(old.get("key", {}), key, FLAGS)
    if old.get("source") != origin or old.get("samples") != n:
        diffs.append(f"source: prepared from {old.get('source')}, now {origin}")
    if shard_size is not None and old.get("shard_size") != shard_size:
        diffs.append(f"shard_size: {old.get('shard_size')}, now {shard_size}")
    if not diffs:
        return old
    if not overwrite:
        raise ValueError(
            f"--out {out}: holds a prepared dataset made otherwise ({'; '.join(diffs)}); pass "
            "--overwrite to replace it, or choose another --out"
        )
    shutil.rmtree(out / SHARDS, ignore_errors=True)
    return None


def _stats(out: Path) -> dict:
    import pyarrow as pa

    tokens, longest, errors, macs = 0, 0, Counter(), 0
    for path in sorted((out / SHARDS).glob("shard-*.arrow")):
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        t = table.column("tokens").to_numpy()
        tokens, longest = tokens + int(t.sum()), max(longest, int(t.max(initial=0)))
        errors.update(r for r in table.column("error_reason").to_pylist() if r is not None)
        macs += int(table.column("vision_macs").to_numpy().sum())
    return {
        "tokens": tokens,
        "longest": longest,
        "errors": dict(sorted(errors.items())),
        "vision_macs": macs,
    }


DESCRIPTION = """\
Tokenize and plan a dataset once (all cores), for every later cpvlm train:

    cpvlm prepare --model CKPT --data train.jsonl --out train.prepared
    cpvlm train   --model CKPT --data train.prepared --cp 2 ...

Training from the folder gives the same rows and losses as training from --data, and starts
without tokenizing. Images and videos stay references to their files, decoded at training time.
cpvlm train refuses the folder with another --model processor, chat template, --train-on or
pixel flag, naming what differs. Interrupted? Run the same command again: it resumes.
"""


def build_parser() -> argparse.ArgumentParser:
    from cpvlm.cli import HelpFormatter

    p = argparse.ArgumentParser(
        prog="cpvlm prepare", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_fields(p, PrepareConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        m = prepare_dataset(from_args(PrepareConfig, a))
    except (ValueError, DataError) as err:
        print(f"cpvlm prepare: error: {err}", file=sys.stderr)
        return 2
    s = m["stats"]
    bad = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "none"
    print(
        f"prepared {m['samples']} samples into {a.out}: {s['tokens']} tokens (longest "
        f"{s['longest']}), bad samples: {bad}"
    )
    print(f"train:    cpvlm train --model {a.model} --data {a.out} ...")
    return 0
