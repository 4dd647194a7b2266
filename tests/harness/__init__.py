"""Test-side helpers: worlds of ranks (``distributed``), injected faults (``faults``), the data-loader
tests' batch helpers (``batches``)."""
