"""Moved to ``goat_dist.data.contract``; this name is that module itself (an alias, so a patch through
either name reaches the same functions)."""

import sys

from ..data import contract

sys.modules[__name__] = contract
