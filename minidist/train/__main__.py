"""`python -m minidist.train`: see `minidist.train.loop.main`."""

import sys

from minidist.train.loop import main

sys.exit(main())
