# Copyright the goat-dist authors.
# SPDX-License-Identifier: Apache-2.0
# Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file except in
# compliance with the License. You may obtain a copy at http://www.apache.org/licenses/LICENSE-2.0.
# Distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND.
"""Configuration of a goat-dist model exported for Hugging Face ``transformers`` (``trust_remote_code``).

Part of goat-dist's Hugging Face export; needs only ``transformers``. The fields mirror goat-dist's
``model`` config section (``goat_*``: its ``model.goat`` subsection).
"""

from transformers import PretrainedConfig


class GoatConfig(PretrainedConfig):
    model_type = "goat_dist"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=None,
        activation="swiglu",  # swiglu | gelu
        norm="rmsnorm",  # rmsnorm | layernorm
        norm_eps=1e-5,
        bias=False,
        position="goat",  # goat | alibi | none | learned
        max_position_embeddings=256,  # the training context (learned positions stop there)
        goat_pos_rank=4,
        goat_abs_rank=4,
        goat_pos_base=10_000.0,
        goat_abs_base=10_000.0,
        goat_key_bias=True,
        goat_key_bias_lanes=3,  # u(j)'s lanes: 3 (exact in bf16; exports before the key had 3) or 1
        goat_train_len=256,
        initializer_range=0.02,
        tie_word_embeddings=True,
        use_cache=True,
        **kwargs,
    ):
        for name, value, allowed in (
            ("activation", activation, ("swiglu", "gelu")),
            ("norm", norm, ("rmsnorm", "layernorm")),
            ("position", position, ("goat", "alibi", "none", "learned")),
        ):
            if value not in allowed:
                raise ValueError(f"GoatConfig.{name}={value!r}: expected one of {', '.join(allowed)}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.activation = activation
        self.norm = norm
        self.norm_eps = norm_eps
        self.bias = bias
        self.position = position
        self.max_position_embeddings = max_position_embeddings
        self.goat_pos_rank = goat_pos_rank
        self.goat_abs_rank = goat_abs_rank
        self.goat_pos_base = goat_pos_base
        self.goat_abs_base = goat_abs_base
        self.goat_key_bias = goat_key_bias
        self.goat_key_bias_lanes = goat_key_bias_lanes
        self.goat_train_len = goat_train_len
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
