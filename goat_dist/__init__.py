"""goat-dist: distributed pretraining of decoder LMs with GOAT attention priors."""

__version__ = "0.1.0"
