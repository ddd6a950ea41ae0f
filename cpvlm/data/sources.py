"""Where samples come from: ``--data PATH`` or ``--data pkg.module:function``.

A source is a sequence of records with random access (``len``, ``source[i] -> Record``) so that
the sample order can be shuffled and resumed, or an endless map-style source (``source[i]``
without ``len``, like the synthetic data), read in order. A record is one sample: a conversation
(``{"messages": [...]}``, optionally with an ``"images"`` / ``"videos"`` list that content items
without a path refer to in order) or an already tokenized sample (``{"input_ids": ...}``, see
``cpvlm.data.sample``). Media paths in a record resolve against the record's base directory.

- ``data.jsonl``: one JSON record a line (blank lines skipped), base directory its folder; a line
  is read only when its sample is planned.
- a folder written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` needs a ``train`` split),
  or ``.parquet`` files (a file or a folder of them): rows as records, read through Arrow so that
  image columns stay undecoded ``{"bytes", "path"}`` until a rank decodes the images it encodes.
- a folder written by ``cpvlm prepare`` (``cpvlm.data.prepared``): samples planned once, read
  back without the tokenizer.
- ``pkg.module:function``: ``function(**kwargs)`` with ``--data-arg key=value`` pairs (values
  parsed as JSON where they parse, else strings) and, if it takes them, ``model_config=`` and
  ``seed=``. The current directory is importable, as under ``python -m``. It returns a sequence,
  an endless map-style source, or a finite iterable (read into a list once).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from cpvlm.data.errors import DataError
from cpvlm.data.prepared import MANIFEST, PreparedSource, is_prepared
from cpvlm.data.record import Record

DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

# What planning a JSON record costs, about (CPU microseconds of a processor's plan: chat template,
# tokenizer, image headers): a base, its bytes, and its image and video references (each named
# twice in a content item, ``{"type": "image", "image": ...}``; a video reads several frames'
# headers). Fitted on benchmarks/data.py's conversations (2 ms text, 2 to 7 ms photos, 11 ms
# videos); only its ranking matters: it deals a window's planning over DP ranks by cost.
PLAN_COST_BASE, PLAN_COST_IMAGE, PLAN_COST_VIDEO = 2000, 1000, 4500


def plan_cost(line: bytes) -> int:
    """The estimated planning cost of the JSON record ``line``, read without parsing it."""
    images, videos = line.count(b'"image'), line.count(b'"video')
    return PLAN_COST_BASE + len(line) + PLAN_COST_IMAGE * images + PLAN_COST_VIDEO * videos


class JsonlSource:
    """A JSON-lines file; byte offsets of its lines are indexed once, lines read on demand.
    ``plan_cost(i)``: record i's estimated planning cost (``plan_cost``), counted while indexing."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.base_dir = self.path.resolve().parent
        self._offsets: list[tuple[int, int]] = []  # (byte offset, 1-based line number)
        self._costs: list[int] = []
        with open(self.path, "rb") as f:
            offset = 0
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    self._offsets.append((offset, lineno))
                    self._costs.append(plan_cost(line))
                offset += len(line)
        if not self._offsets:
            raise ValueError(f"--data {path}: the file holds no records")

    def __len__(self) -> int:
        return len(self._offsets)

    def plan_cost(self, i: int) -> int:
        return self._costs[i]

    def __getitem__(self, i: int) -> Record:
        offset, lineno = self._offsets[i]
        where = f"{self.path.name} line {lineno}"
        with open(self.path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError("bad_record", f"not valid JSON ({err})", where) from None
        return Record(i, where, data, self.base_dir)


class ArrowSource:
    """Rows of an Arrow table (a ``datasets`` folder or parquet files), undecoded."""

    def __init__(self, table, name: str, base_dir: Path):
        self.table, self.name, self.base_dir = table, name, base_dir
        if len(self) == 0:
            raise ValueError(f"--data {name}: the dataset holds no rows")

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> Record:
        row = self.table.slice(i, 1).to_pylist()[0]
        return Record(i, f"{self.name} row {i}", row, self.base_dir)


class ObjectSource:
    """What a ``pkg.module:function`` returned: a sequence, or an endless ``source[i]``."""

    def __init__(self, items, name: str):
        if not hasattr(items, "__getitem__"):
            items = list(items)  # a finite iterable: read once
        if hasattr(items, "__len__") and len(items) == 0:
            raise ValueError(f"--data {name}: the function returned no samples")
        self.items, self.name = items, name
        self.base_dir = Path.cwd()

    @property
    def endless(self) -> bool:
        return not hasattr(self.items, "__len__")

    def __len__(self) -> int:
        if self.endless:
            raise TypeError(f"{self.name} is endless")
        return len(self.items)

    def __getitem__(self, i: int) -> Record:
        return Record(i, f"{self.name} sample {i}", self.items[i], self.base_dir)


def _datasets_table(path: Path):
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"--data {path}: reading a datasets folder needs the datasets package "
            "(pip install 'cpvlm[data]')"
        ) from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(
                f"--data {path}: a DatasetDict with splits {sorted(ds)}; pass the folder of one "
                "split (e.g. {path}/train) or save one with a 'train' split"
            )
        ds = ds["train"]
    ds = ds.flatten_indices() if ds._indices is not None else ds
    return ds.with_format("arrow")[:]


def _parquet_table(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"--data {path}: parquet files need pyarrow (pip install pyarrow)"
        ) from None
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    return pa.concat_tables([pq.read_table(f) for f in files])


def parse_data_args(pairs: Sequence[str]) -> dict[str, object]:
    """``["n=3", "name=x"]`` -> ``{"n": 3, "name": "x"}`` (JSON values where they parse)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--data-arg {pair!r}: expected key=value with a Python name as key")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _call_function(spec: str, data_args: Mapping, model_config, seed: int) -> ObjectSource:
    module_name, _, func_name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--data {spec}: cannot import {module_name!r} ({err})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"--data {spec}: {module_name} has no function {func_name!r}")
    params = inspect.signature(func).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = dict(data_args)
    for key, value in (("model_config", model_config), ("seed", seed)):
        if key not in kwargs and (takes_any or key in params):
            kwargs[key] = value
    return ObjectSource(func(**kwargs), spec)


def source_kind(spec: str) -> str:
    """``"jsonl"``, ``"datasets"``, ``"parquet"``, ``"prepared"`` or ``"function"`` for a
    ``--data`` value."""
    path = Path(spec)
    if path.is_file() and path.suffix == ".jsonl":
        return "jsonl"
    if path.is_file() and path.suffix == ".parquet":
        return "parquet"
    if path.is_dir():
        if is_prepared(path):
            return "prepared"
        if any((path / m).is_file() for m in DATASET_MARKERS):
            return "datasets"
        if any(path.glob("*.parquet")):
            return "parquet"
        raise ValueError(
            f"--data {spec}: a folder without a datasets save_to_disk layout "
            f"({', '.join(DATASET_MARKERS)}), .parquet files or a cpvlm prepare folder "
            f"({MANIFEST})"
        )
    if ":" in spec and not path.exists():
        return "function"
    raise ValueError(
        f"--data {spec}: not a .jsonl or .parquet file, a datasets folder, or pkg.module:function"
    )


def open_source(spec: str, *, data_args: Mapping = (), model_config=None, seed: int = 0):
    """The record source named by ``--data``."""
    kind = source_kind(spec)
    if kind == "jsonl":
        return JsonlSource(spec)
    if kind == "function":
        return _call_function(spec, dict(data_args), model_config, seed)
    if kind == "prepared":
        return PreparedSource(spec)
    path = Path(spec)
    table = _datasets_table(path) if kind == "datasets" else _parquet_table(path)
    base = path.resolve() if path.is_dir() else path.resolve().parent
    return ArrowSource(table, path.name, base)
