"""A prepared dataset: every sample planned once, read back by training without a tokenizer.

Legend: N samples of the source, L tokens of a sample, (t, h, w) an item's grid in patches.

``cpvlm prepare`` (``cpvlm.train.prepare``) plans every record of a source and writes a folder:

- ``prepared.json``, the manifest: the format version, the *key* (what produced the plans: the
  processor class, hashes of the tokenizer, processor configs and chat template, the model's token
  ids, ``train_on`` and the pixel limits), the source it was made from, ``N``, the shard size,
  and ``complete`` once every shard is written;
- ``shards/shard-KKKKK.arrow``: Arrow IPC files of the samples ``[K * shard_size, ...)``, in source
  order, one row a sample: ``where``; ``input_ids`` and ``labels`` (int32 lists, L each);
  ``tokens`` (L); ``image_grids`` / ``video_grids`` (3 ints per item, flat); the media references
  (``images``: path or encoded bytes; ``videos``: fps, seconds per temporal patch, frames);
  ``vision_macs`` (the tower's modelled forward MACs, ``cpvlm.encoders.cost``); and, for a sample
  whose planning failed, ``error_reason`` / ``error_detail`` (its ``DataError``, found again at
  training time as it would be from the source).

A shard is written to a temporary name and renamed, so an interrupted ``prepare`` leaves whole
shards only and resumes from the missing ones. ``PreparedSource`` memory-maps each shard when first read:
``source[i]`` is a ``Record``, ``plan(record)`` rebuilds its ``SamplePlan`` from the columns
(pixels are still decoded from the references, by the rank that encodes them), and
``meta(i)`` gives its ``SampleMeta`` from the length and grid columns alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from cpvlm.data.errors import DataError
from cpvlm.data.media import ImageRef, VideoFrameRef
from cpvlm.data.meta import SampleMeta
from cpvlm.data.record import Record
from cpvlm.data.sample import SamplePlan, VisionItem

FORMAT_VERSION = 2
"""2: an item's kind is its column (``image_grids`` / ``video_grids``) alone; format 1 wrote
the videos of a family whose video grid is (F, S, S) (F frames of one S x S crop) with the grid
(F, 2**20, 2**20), which format 2 reads as (F, S, S)."""
MANIFEST = "prepared.json"
SHARDS = "shards"


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def write_manifest(path: str | Path, manifest: dict) -> None:
    path = Path(path)
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / MANIFEST)


def shard_path(path: str | Path, k: int) -> Path:
    return Path(path) / SHARDS / f"shard-{k:05d}.arrow"


def key_differences(made: dict, wanted: dict, flags: dict[str, str] | None = None) -> list[str]:
    """``"field (--flag): prepared with A, this run B"`` for every key field that differs."""
    flags = flags or {}
    return [
        f"{name}{f' ({flags[name]})' if name in flags else ''}: prepared with "
        f"{made.get(name)!r}, this run {wanted.get(name)!r}"
        for name in sorted(set(made) | set(wanted))
        if made.get(name) != wanted.get(name)
    ]


# ---- writing ------------------------------------------------------------------------------------


def _schema():
    import pyarrow as pa

    ref = pa.struct([("path", pa.string()), ("data", pa.binary())])
    frame = pa.struct(
        [
            ("path", pa.string()),
            ("data", pa.binary()),
            ("index", pa.int64()),  # -1: an image file (ImageRef), else a VideoFrameRef
            ("height", pa.int64()),
            ("width", pa.int64()),
        ]
    )
    video = pa.struct(
        [("fps", pa.float64()), ("second_per_grid", pa.float64()), ("frames", pa.list_(frame))]
    )
    return pa.schema(
        [
            ("index", pa.int64()),
            ("where", pa.string()),
            ("tokens", pa.int64()),
            ("input_ids", pa.list_(pa.int32())),
            ("labels", pa.list_(pa.int32())),
            ("image_grids", pa.list_(pa.int32())),
            ("video_grids", pa.list_(pa.int32())),
            ("images", pa.list_(ref)),
            ("videos", pa.list_(video)),
            ("vision_macs", pa.int64()),
            ("error_reason", pa.string()),
            ("error_detail", pa.string()),
        ]
    )


def _frame(ref) -> dict:
    if isinstance(ref, VideoFrameRef):
        return dict(path=ref.path, data=None, index=ref.index, height=ref.height, width=ref.width)
    return dict(path=ref.path, data=ref.data, index=-1, height=0, width=0)


def plan_row(index: int, where: str, result: SamplePlan | DataError, vision_macs) -> dict:
    """One row of a shard: a planned sample, or the ``DataError`` its planning raised.
    ``vision_macs(grid) -> int``: the tower's modelled cost of an item."""
    row = dict(
        index=index,
        where=where,
        tokens=0,
        input_ids=[],
        labels=[],
        image_grids=[],
        video_grids=[],
        images=[],
        videos=[],
        vision_macs=0,
        error_reason=None,
        error_detail=None,
    )
    if isinstance(result, DataError):
        return {**row, "error_reason": result.reason, "error_detail": result.detail}
    if result.audios:
        raise ValueError(
            f"{where}: a sample with audio clips cannot be prepared (the cache keeps no audio "
            "references); train from the source itself"
        )
    for item in (*result.images, *result.videos):
        if item.pixels is not None:
            raise ValueError(
                f"{where}: a tokenized sample that carries its pixels cannot be prepared (the cache "
                "keeps references to media files, not pixels); train from the source itself"
            )
    items = (*result.images, *result.videos)
    return {
        **row,
        "tokens": len(result),
        "input_ids": result.input_ids.tolist(),
        "labels": result.labels.tolist(),
        "image_grids": [v for it in result.images for v in it.grid],
        "video_grids": [v for it in result.videos for v in it.grid],
        "images": [{"path": it.image.path, "data": it.image.data} for it in result.images],
        "videos": [
            {
                "fps": it.fps,
                "second_per_grid": it.second_per_grid,
                "frames": [_frame(f) for f in it.frames],
            }
            for it in result.videos
        ],
        "vision_macs": sum(vision_macs(it.grid) for it in items),
    }


def write_shard(path: Path, rows: list[dict]) -> None:
    """The rows as an Arrow IPC file at ``path``, whole or not at all."""
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=_schema())
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, path)


# ---- reading ------------------------------------------------------------------------------------


@dataclass
class _Shard:
    """A memory-mapped shard; the list columns as flat numpy arrays and their offsets."""

    table: object
    where: list[str]

    def __post_init__(self):
        self.flat = {}
        for name in ("input_ids", "labels", "image_grids", "video_grids"):
            col = self.table.column(name).combine_chunks()
            self.flat[name] = (col.offsets.to_numpy(), col.values.to_numpy())
        self.tokens = self.table.column("tokens").to_numpy()
        self.errors = self.table.column("error_reason").to_pylist()

    def ints(self, name: str, r: int):
        offsets, values = self.flat[name]
        return values[offsets[r] : offsets[r + 1]]

    def grids(self, name: str, r: int) -> tuple[tuple[int, int, int], ...]:
        g = self.ints(name, r).tolist()
        return tuple(tuple(g[k : k + 3]) for k in range(0, len(g), 3))

    def value(self, name: str, r: int):
        return self.table.column(name)[r].as_py()


def _ref(frame: dict):
    if frame["index"] < 0:
        return ImageRef(path=frame["path"], data=frame["data"])
    return VideoFrameRef(frame["path"], frame["index"], frame["height"], frame["width"])


class PreparedSource:
    """The samples of a ``cpvlm prepare`` folder (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        m = self.manifest
        if m.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"--data {path}: prepared with cache format {m.get('format')}, this cpvlm reads "
                f"format {FORMAT_VERSION}; run cpvlm prepare again"
            )
        if not m.get("complete"):
            raise ValueError(
                f"--data {path}: the prepare that wrote it did not finish; run the same cpvlm "
                "prepare command again to complete it"
            )
        self.key, self.num_samples, self.shard_size = m["key"], m["samples"], m["shard_size"]
        self.base_dir = None
        self._shards: list[_Shard | None] = [None] * -(-self.num_samples // self.shard_size)
        missing = [k for k in range(len(self._shards)) if not shard_path(path, k).is_file()]
        if missing:
            raise ValueError(
                f"--data {path}: shard {missing[0]} is missing; run cpvlm prepare again"
            )

    def __len__(self) -> int:
        return self.num_samples

    def _locate(self, i: int) -> tuple[_Shard, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        k = i // self.shard_size
        if self._shards[k] is None:  # memory-mapped on first use
            import pyarrow as pa

            table = pa.ipc.open_file(pa.memory_map(str(shard_path(self.path, k)))).read_all()
            self._shards[k] = _Shard(table, table.column("where").to_pylist())
        return self._shards[k], i % self.shard_size

    def __getitem__(self, i: int) -> Record:
        shard, r = self._locate(i)
        return Record(i, shard.where[r], None, None)

    def _error(self, shard: _Shard, r: int) -> DataError | None:
        reason = shard.errors[r]
        return None if reason is None else DataError(reason, shard.value("error_detail", r))

    def meta(self, index: int) -> SampleMeta:
        """The sample's length and grids (a failed sample raises its ``DataError``, located)."""
        shard, r = self._locate(index)
        err = self._error(shard, r)
        if err is not None:
            raise err.at(shard.where[r])
        return SampleMeta(
            int(shard.tokens[r]), shard.grids("image_grids", r), shard.grids("video_grids", r)
        )

    def vision_macs(self, index: int) -> int:
        shard, r = self._locate(index)
        return int(shard.table.column("vision_macs")[r].as_py())

    def plan(self, record: Record) -> SamplePlan:
        """The ``SamplePlan`` that was prepared for ``record`` (or its ``DataError``)."""
        shard, r = self._locate(record.index)
        err = self._error(shard, r)
        if err is not None:
            raise err
        images = tuple(
            VisionItem("image", grid, image=ImageRef(path=ref["path"], data=ref["data"]))
            for grid, ref in zip(
                shard.grids("image_grids", r), shard.value("images", r), strict=True
            )
        )
        videos = tuple(
            VisionItem(
                "video",
                grid,
                frames=tuple(_ref(f) for f in v["frames"]),
                fps=v["fps"],
                second_per_grid=v["second_per_grid"],
            )
            for grid, v in zip(shard.grids("video_grids", r), shard.value("videos", r), strict=True)
        )
        ids = torch.from_numpy(shard.ints("input_ids", r).astype("int64"))
        labels = torch.from_numpy(shard.ints("labels", r).astype("int64"))
        return SamplePlan(record.index, record.where, ids, labels, images=images, videos=videos)
