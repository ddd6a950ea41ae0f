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
