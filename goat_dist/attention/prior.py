"""Re-export: the prior is ``goat_dist.goat.prior``."""

from ..goat.prior import FP32_FORWARD, GoatPrior, alibi_slopes, prior_lane_count  # noqa: F401
