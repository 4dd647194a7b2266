"""Config rules checked before any work (config.validate) that the checkpoint/resume work added."""

from __future__ import annotations

import pytest

from goat_dist.config import ConfigError, load_config


def test_learned_positions_with_document_masking_is_rejected():
    """Document positions continue across windows, so a long document's positions pass model.seq_len, where
    the learned table ends: the combination is a config error naming both keys, not a crash mid-run."""
    with pytest.raises(ConfigError, match=r"model\.position=learned cannot be combined with data\.document"):
        load_config(None, ["model.position=learned", "data.document_masking=true"])
    load_config(None, ["model.position=learned"])
    for position in ("goat", "rope", "alibi", "none"):
        load_config(None, [f"model.position={position}", "data.document_masking=true"])
