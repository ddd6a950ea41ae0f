"""``python -m cpvlm.train [flags]`` = ``cpvlm train [flags]`` (the module torchrun runs)."""

import sys

from cpvlm.train.command import main

if __name__ == "__main__":
    sys.exit(main())
