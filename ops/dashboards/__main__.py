"""`python -m ops.dashboards [--check | --list]`: see ops.dashboards.generate."""

import sys

from ops.dashboards.generate import main

sys.exit(main())
