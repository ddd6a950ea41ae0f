"""The tested version window: read from cpvlm's declared requirements (pyproject), one warning
naming it (and ``cpvlm verify``) when an installed library is outside it, none inside."""

import importlib.metadata as metadata
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from cpvlm.hf import versions

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[2]


def _declared() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [
        f"{req}; extra == '{extra}'"
        for extra, reqs in project["optional-dependencies"].items()
        for req in reqs
    ]


def test_every_watched_library_has_a_bounded_window_equal_in_every_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    window = versions.tested_window(_declared())
    assert set(window) == set(versions.WATCHED)
    for name, spec in window.items():
        assert any(s.operator in ("<", "<=") for s in spec), f"{name} has no upper bound"
        assert any(s.operator == ">=" for s in spec), f"{name} has no lower bound"
        # Each extra that names the library declares the same window.
        for reqs in project["optional-dependencies"].values():
            for req in map(Requirement, reqs):
                if req.name == name:
                    assert req.specifier == spec, req


def test_the_installed_libraries_are_inside_the_window():
    """What the README's test command installs (the constraints file) is what pyproject says was
    tested: a bump of one without the other fails here."""
    window = versions.tested_window(_declared())
    assert versions.outside_window(window) == []


def test_one_warning_outside_the_window_naming_it_and_verify(monkeypatch):
    window = versions.tested_window(_declared())
    upper = max(Version(s.version) for s in window["transformers"] if s.operator in "<<=")
    newer = f"{upper.major}.{upper.minor + 1}.0"

    def installed(name):
        if name == "peft":
            raise metadata.PackageNotFoundError(name)  # not installed: nothing to say
        return newer if name == "transformers" else metadata.version(name)

    outside = versions.outside_window(window, installed)
    assert outside == [f"transformers {newer} (tested: {window['transformers']})"]

    monkeypatch.setattr(versions, "outside_window", lambda: outside)
    versions.warn_outside_window.cache_clear()
    with pytest.warns(versions.UntestedVersionWarning) as record:
        versions.warn_outside_window()
        versions.warn_outside_window()  # once a process
    assert len(record) == 1
    message = str(record[0].message)
    assert f"transformers {newer}" in message and "cpvlm verify" in message


def test_no_warning_inside_the_window(monkeypatch):
    monkeypatch.setattr(versions, "outside_window", lambda: [])
    versions.warn_outside_window.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        versions.warn_outside_window()
    assert not seen
