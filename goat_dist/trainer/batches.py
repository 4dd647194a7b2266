"""Moved to ``goat_dist.data.batches``; this name is that module itself (an alias, so a patch through
either name reaches the same functions)."""

import sys

from ..data import batches

sys.modules[__name__] = batches
