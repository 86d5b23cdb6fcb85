"""`python -m shunter.ops.dashboards [--check | --list]`: see shunter.ops.dashboards.generate."""

import sys

from shunter.ops.dashboards.generate import main

sys.exit(main())
