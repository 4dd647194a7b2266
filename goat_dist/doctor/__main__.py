"""``python -m goat_dist.doctor``: ``goat-dist doctor`` without loading the CLI's other commands."""

import sys

from .command import main

sys.exit(main())
