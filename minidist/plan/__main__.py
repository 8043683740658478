"""`python -m minidist.plan`: see `minidist.plan.cli.main`."""

import sys

from minidist.plan.cli import main

sys.exit(main())
