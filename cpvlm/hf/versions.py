"""The tested version window of the libraries cpvlm reaches into, and one warning outside it.

cpvlm adapts transformers' model families and overrides Trainer internals, so a release outside
the versions the suite passed on may break a family silently. The window is pyproject's
(``[project.optional-dependencies]``, read from the installed package's metadata, one source):
a lower bound at the oldest release the suite passed on, an upper bound at the newest.
``tools/check_release.py`` checks a new release and widens it.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import warnings

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

WATCHED = ("transformers", "trl", "peft", "accelerate", "datasets")
"""The libraries whose internals cpvlm reads (model classes, Trainer methods, PEFT wrappers)."""


class UntestedVersionWarning(UserWarning):
    """An installed library is outside the window cpvlm was tested on."""


def tested_window(requires: list[str] | None = None) -> dict[str, SpecifierSet]:
    """``{library: specifiers}`` of the watched libraries, from cpvlm's declared requirements
    (every extra that names one; pyproject keeps them equal). Empty when cpvlm is not installed
    (a source tree on ``PYTHONPATH``)."""
    if requires is None:
        try:
            requires = metadata.requires("cpvlm") or []
        except metadata.PackageNotFoundError:
            return {}
    window: dict[str, SpecifierSet] = {}
    for line in requires:
        req = Requirement(line)
        if req.name in WATCHED:
            window[req.name] = window.get(req.name, SpecifierSet()) & req.specifier
    return window


def outside_window(window: dict[str, SpecifierSet] | None = None, installed=None) -> list[str]:
    """``"library version (tested: specifiers)"`` for each installed watched library outside the
    window. ``installed(name)`` gives a version string or raises ``PackageNotFoundError``
    (default: the installed distribution's)."""
    window = tested_window() if window is None else window
    installed = installed or metadata.version
    out = []
    for name, spec in window.items():
        try:
            version = installed(name)
        except metadata.PackageNotFoundError:
            continue
        if not spec.contains(Version(version), prereleases=True):
            out.append(f"{name} {version} (tested: {spec})")
    return out


@functools.cache
def warn_outside_window() -> None:
    """One warning, at the first import of cpvlm's transformers integration, when a watched
    library is outside the tested window."""
    outside = outside_window()
    if outside:
        warnings.warn(
            f"cpvlm was not tested with {', '.join(outside)}. Check that its context-parallel "
            "gradients are still exact for your model with `cpvlm verify --model <model> --cp 2`, "
            "or install a tested version (docs/tested_versions.md).",
            UntestedVersionWarning,
            stacklevel=3,
        )


warn_outside_window()  # at the first import of cpvlm.hf (its __init__)
