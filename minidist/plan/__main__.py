"""`python -m minidist.plan`: see `minidist.plan.search.main`."""

import sys

from minidist.plan.search import main

sys.exit(main())
