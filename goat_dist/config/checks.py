"""The checks of a loaded ``Config`` that need no process group, each naming the key and the value at
fault (the layout's checks against the world size live in ``goat_dist.distributed``)."""

from __future__ import annotations

from .sections import (
    ACTIVATION_CHECKPOINTING,
    ACTIVATIONS,
    ATTENTION_BACKENDS,
    DATA_RESUME,
    DECAY_SHAPES,
    GRAD_REDUCE_DTYPES,
    LR_SCHEDULES,
    NORMS,
    ON_ERROR,
    ON_NONFINITE,
    POSITIONS,
    PRECISIONS,
    PRIOR_INITS,
    PRIOR_WEIGHT_DECAY,
    SYNTHETIC_TASKS,
    WINDOW_ORDERS,
    Config,
    ConfigError,
    TrainConfig,
)


def _check_rampup(t: TrainConfig) -> None:
    ramp = t.batch_rampup
    if ramp is None:
        return
    shape = isinstance(ramp, list) and len(ramp) == 3 and all(type(v) is int and v > 0 for v in ramp)
    if not shape:
        raise ConfigError(
            f"train.batch_rampup must be [start, increment, ramp_tokens] (positive integers), got {ramp!r}"
        )
    start, increment, _ = ramp
    if start >= t.global_batch_size or (t.global_batch_size - start) % increment:
        raise ConfigError(
            f"train.batch_rampup={ramp}: the start ({start}) must be below train.global_batch_size="
            f"{t.global_batch_size} and reach it in whole increments of {increment}"
        )


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"config key '{key}' must be one of {allowed}, got {value!r}")


def validate(cfg: Config) -> None:
    """Checks that need no process group (layout checks against the world size live in distributed)."""
    m, t = cfg.model, cfg.train
    _choice("model.position", m.position, POSITIONS)
    _choice("model.attention_backend", m.attention_backend, ATTENTION_BACKENDS)
    if m.compile not in ("auto", True, False):
        raise ConfigError(f"config key 'model.compile' must be auto, true or false, got {m.compile!r}")
    _choice("model.activation", m.activation, ACTIVATIONS)
    _choice("model.norm", m.norm, NORMS)
    _choice("model.goat.prior_init", m.goat.prior_init, PRIOR_INITS)
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("parallel.grad_reduce_dtype", cfg.parallel.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
    _choice("parallel.grad_accum_dtype", cfg.parallel.grad_accum_dtype, GRAD_REDUCE_DTYPES)
    _choice("data.on_error", cfg.data.on_error, ON_ERROR)
    _choice("data.window_order", cfg.data.window_order, WINDOW_ORDERS)
    if cfg.data.cache_max_gb is not None and not cfg.data.cache_max_gb >= 0:
        raise ConfigError(f"data.cache_max_gb must be >= 0 (0 or null: no limit): {cfg.data.cache_max_gb}")
    _choice("train.on_nonfinite", t.on_nonfinite, ON_NONFINITE)
    _choice("train.data_resume", t.data_resume, DATA_RESUME)
    _choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    _choice("train.decay_shape", t.decay_shape, DECAY_SHAPES)
    _choice("train.prior_weight_decay", t.prior_weight_decay, PRIOR_WEIGHT_DECAY)
    if not 0 < t.decay_fraction <= 1:
        raise ConfigError(f"config key 'train.decay_fraction' must be in (0, 1], got {t.decay_fraction}")
    _check_rampup(t)
    plugins = t.callbacks if isinstance(t.callbacks, list) else [None]
    if not all(isinstance(e, str) and ":" in e.strip(":") for e in plugins):
        want = "a list of 'package.module:Name' strings"
        raise ConfigError(f"train.callbacks must be {want}, got {t.callbacks!r}")
    if not cfg.checkpoint.universal:
        raise ConfigError(
            "checkpoint.universal=false is no longer an option: a checkpoint is one layout-independent copy "
            "of the state (each rank writes its own share), with no separate copy to turn off; remove the key"
        )
    for i, src in enumerate(cfg.data.sources or []):
        if not isinstance(src, dict) or set(src) - {"path", "weight"} or "path" not in src:
            raise ConfigError(
                f"data.sources[{i}] must be a mapping with 'path' and optional 'weight', got {src!r}"
            )
        if not isinstance(src.get("weight", 1.0), (int, float)) or src.get("weight", 1.0) <= 0:
            raise ConfigError(
                f"data.sources[{i}].weight must be a positive number, got {src.get('weight')!r}"
            )
    _choice("train.activation_checkpointing", t.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    if cfg.data.synthetic is not None:
        _choice("data.synthetic", cfg.data.synthetic, SYNTHETIC_TASKS)
    for key in ("prior_layers", "prior_heads"):
        chosen = getattr(cfg.log, key)
        ints = isinstance(chosen, list) and all(type(i) is int for i in chosen)  # bool is not an int here
        if chosen is not None and not ints:
            raise ConfigError(f"config key 'log.{key}' must be a list of integers or null, got {chosen!r}")
        limit = m.num_layers if key == "prior_layers" else m.num_kv_heads or m.num_heads
        if chosen and not all(-limit <= i < limit for i in chosen):
            what = "layers" if key == "prior_layers" else "KV heads"
            raise ConfigError(f"config key 'log.{key}'={chosen}: the model has {limit} {what}")
    if m.goat.train_len is not None and m.goat.train_len < 1:
        raise ConfigError(f"model.goat.train_len must be >= 1 or null, got {m.goat.train_len}")
    if cfg.log.prior_interval < 0 or cfg.log.peak_tflops < 0:
        raise ConfigError("log.prior_interval and log.peak_tflops must be >= 0")
    _check_profile(cfg.log)
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size {m.hidden_size} must divide by model.num_heads {m.num_heads}")
    kv = m.num_kv_heads or m.num_heads
    if m.num_heads % kv:
        raise ConfigError(f"model.num_heads {m.num_heads} must divide by model.num_kv_heads {kv}")
    head_dim = m.hidden_size // m.num_heads
    from ..shapes import KEY_BIAS_LANE_CHOICES, goat_lane_count

    if m.goat.key_bias_lanes not in KEY_BIAS_LANE_CHOICES:
        raise ConfigError(
            f"config key 'model.goat.key_bias_lanes' must be one of {KEY_BIAS_LANE_CHOICES}, "
            f"got {m.goat.key_bias_lanes!r}"
        )
    if not m.goat.sink_init_std >= 0:
        raise ConfigError(f"model.goat.sink_init_std must be >= 0, got {m.goat.sink_init_std}")
    lanes = goat_lane_count(m)  # auto counted as 3: a config valid in bf16 is valid in fp32
    if m.position == "goat" and head_dim <= lanes:
        raise ConfigError(
            f"head dim {head_dim} leaves no content lanes after GOAT's {lanes} prior lanes "
            f"(model.goat.pos_rank={m.goat.pos_rank})"
        )
    if m.position == "rope" and head_dim % 2:
        raise ConfigError(f"rope needs an even head dim, got {head_dim}")
    if m.position == "learned" and cfg.data.document_masking:
        # document positions continue across windows, so a long document's positions pass seq_len
        raise ConfigError(
            "model.position=learned cannot be combined with data.document_masking=true: with document "
            "masking a token's position is its offset in its document, which continues across windows and "
            f"exceeds the learned table's model.seq_len={m.seq_len} entries for any document longer than a "
            "window. Use model.position=goat, rope, alibi or none with document masking"
        )
    if cfg.data.bos_framing and (cfg.data.document_masking or cfg.data.synthetic or m.seq_len < 2):
        # a window-level BOS at position 0 next to per-document positions, or in a generated task that
        # frames its own samples, has no meaning the authors' recipe gives; one token leaves no corpus
        raise ConfigError(
            "data.bos_framing=true needs data.document_masking=false, no data.synthetic task and "
            f"model.seq_len >= 2 (got document_masking={cfg.data.document_masking}, "
            f"synthetic={cfg.data.synthetic}, seq_len={m.seq_len})"
        )
    if cfg.parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage must be 0-3, got {cfg.parallel.zero_stage}")
    if cfg.parallel.sp and cfg.parallel.tp == 1:
        raise ConfigError("parallel.sp=true needs parallel.tp > 1")
    positive = {
        "train.max_steps": t.max_steps,
        "train.micro_batch_size": t.micro_batch_size,
        "train.global_batch_size": t.global_batch_size,
        "model.seq_len": m.seq_len,
        "model.vocab_size": m.vocab_size,
        "log.interval": cfg.log.interval,
        "parallel.tp": cfg.parallel.tp,
        "parallel.cp": cfg.parallel.cp,
        "train.max_nonfinite_in_row": t.max_nonfinite_in_row,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {value}")
    _check_timeouts(cfg.parallel)
    _check_dropout(m.dropout)


def _check_timeouts(p) -> None:
    """Both collective timeouts > 0, and the start-up one (step 1's compiles) not below the steady one: a
    longer steady timeout asks for as long a start-up one, named, rather than one silently raised."""
    for key in ("timeout_minutes", "startup_timeout_minutes"):
        value = getattr(p, key)
        if not value > 0:
            raise ConfigError(f"config key 'parallel.{key}' must be > 0, got {value}")
    if p.startup_timeout_minutes < p.timeout_minutes:
        raise ConfigError(
            f"config key 'parallel.startup_timeout_minutes'={p.startup_timeout_minutes:g} is below "
            f"parallel.timeout_minutes={p.timeout_minutes:g}: the start-up timeout covers the first step's "
            "compiles and must not be the shorter one; set parallel.startup_timeout_minutes="
            f"{p.timeout_minutes:g} or more"
        )


def _check_dropout(dropout: float) -> None:
    """``model.dropout`` must be 0: every rank seeds its generators alike and megatron's model-parallel RNG
    tracker is not set up for dropout, so the masks would repeat across data-parallel replicas (the same
    mask on different data) and sequence- or context-parallel shards (the same mask on every slice)."""
    if dropout != 0:
        raise ConfigError(
            f"config key 'model.dropout'={dropout} is refused: every rank seeds alike, so dropout masks "
            "would repeat across data-parallel replicas and sequence-parallel shards (no shipped config "
            "uses dropout); set model.dropout=0"
        )


def _check_profile(log) -> None:
    """``log.profile_steps`` is [first, last] with 1 <= first <= last; ``log.profile_ranks`` ranks >= 0."""
    steps = log.profile_steps
    if steps is not None:
        ok = isinstance(steps, list) and len(steps) == 2 and all(type(x) is int for x in steps)
        if not ok or not 1 <= steps[0] <= steps[1]:
            raise ConfigError(f"log.profile_steps must be [first, last] with 1 <= first <= last, got {steps}")
    ranks = log.profile_ranks
    if ranks is not None and not (isinstance(ranks, list) and all(type(r) is int and r >= 0 for r in ranks)):
        raise ConfigError(f"log.profile_ranks must be a list of ranks (ints >= 0), got {ranks}")
