"""Moved: ``cpvlm.integrations.hf`` is now ``cpvlm.hf`` (families: ``cpvlm.families``).

This name keeps the package's public names importable for one release, with a
``DeprecationWarning``; docs/changelog.md lists every moved module.
"""

import warnings

from cpvlm.hf import *  # noqa: F403
from cpvlm.hf import __all__  # noqa: F401

warnings.warn(
    "cpvlm.integrations.hf moved to cpvlm.hf (and its families to cpvlm.families); "
    "see docs/changelog.md",
    DeprecationWarning,
    stacklevel=2,
)
