import sys

from cpvlm.verify.command import main

sys.exit(main())
