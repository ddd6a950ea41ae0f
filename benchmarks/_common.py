"""What every benchmark script shares: its output folder, a printed table, the JSON file, a plot
when matplotlib is there, CPU/wall clocks, the core count. (The offline unshard is
``cpvlm.testing.attention_check.unshard``.)"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by the first line of ``doc``, with ``--out-dir``."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument(
        "--out-dir",
        type=Path,
        default=RESULTS_DIR,
        help="where the JSON (and any plot) goes; default benchmarks/results/, the docs' "
        "figures: point a trial run elsewhere",
    )
    return p


def machine_info() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def cores() -> int:
    """CPU cores this process may run on (the launcher gives each rank cores // ranks threads)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Clock:
    """Wall and process CPU seconds (all threads of this process) since it was made."""

    def __init__(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def wall(self) -> float:
        return time.perf_counter() - self._wall

    def cpu(self) -> float:
        return time.process_time() - self._cpu


def max_over_mean(values) -> float:
    values = list(values)
    return max(values) / (sum(values) / len(values))


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


def _shown(path: Path) -> Path:
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def write_json(out_dir: Path, name: str, payload: dict) -> Path:
    """``out_dir/name.json``: the machine, then ``payload``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    print(f"wrote {_shown(path)}")
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None, with a line saying the plot is
    skipped, where matplotlib is not installed (the JSON holds every figure a plot shows)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {_shown(path)}")
