"""Test-side helpers: worlds of ranks (``distributed``), injected faults (``faults``)."""
