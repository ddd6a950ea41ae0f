"""The fast lane's list (tests/conftest.py) names tests that exist: a renamed module or test would
otherwise silently move a slow launch into `-m "not slow"`."""

import ast
from pathlib import Path

from conftest import SLOW_MODULES, SLOW_TESTS

ROOT = Path(__file__).resolve().parents[1]


def test_every_slow_entry_names_a_test():
    for module in SLOW_MODULES:
        assert (ROOT / module).is_file(), module
    for entry in SLOW_TESTS:
        module, name = entry.split("::")
        tree = ast.parse((ROOT / module).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, entry


def test_ci_runs_the_fast_lane_on_the_window_floor_of_torch():
    """.ci/run's oldest torch is pyproject's floor: raising one without the other would leave the
    declared floor untested (or test one below it)."""
    import re

    floor = re.search(r'"torch>=([\d.]+)', (ROOT / "pyproject.toml").read_text()).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    tested = re.search(r"^floor_torch=([\d.]+)", ci, re.M).group(1)
    assert tested.split(".")[:2] == floor.split(".")[:2], (tested, floor)
    assert 'tools/torch_lane.sh "$floor_torch"' in ci
