"""`python -m quantmla ...`: the same command line as `quantmla ...`."""

import sys

from quantmla.cli import main

sys.exit(main())
