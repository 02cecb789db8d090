"""`python -m mlaquant`: the `mlaquant` command."""

import sys

from mlaquant.cli import main

sys.exit(main())
