"""Shared output helpers for benchmark scripts: a printed table and a JSON file per run."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def print_table(rows: list[dict], columns: list[str], title: str = "") -> None:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    if title:
        print(title)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))


def write_json(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return path
