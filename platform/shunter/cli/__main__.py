"""`python -m shunter.cli`: the `shunter` command."""

import sys

from shunter.cli import main

sys.exit(main())
