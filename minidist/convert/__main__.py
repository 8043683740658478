"""`python -m minidist.convert`: see `minidist.convert.runs.main`."""

import sys

from minidist.convert.runs import main

sys.exit(main())
