"""``python -m cpvlm ...``: the ``cpvlm`` command (``cpvlm.cli``), for an environment whose
scripts directory is not on the PATH."""

import sys

from cpvlm.cli import main

sys.exit(main())
