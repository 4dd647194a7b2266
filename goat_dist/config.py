"""Typed run configuration: dataclasses, YAML files and dotted command-line overrides.

``load_config("configs/tiny.yaml", ["train.max_steps=50", "model.goat.pos_rank=8"])`` returns a
validated ``Config``; unknown keys and wrong types raise ``ConfigError`` naming the key.

``model.vocab_size`` left out (or ``null`` / ``auto``) is the data set's: the largest ``vocab_size`` of
the manifests of ``data.source`` / ``data.sources`` (the model pads it as any vocabulary, see
``shapes.padded_vocab_size``). The builtin corpus, a generated task or a data set without a readable
manifest keep DEFAULT_VOCAB_SIZE (the builtin corpus trains its tokenizer to that size).
"""

from __future__ import annotations

import dataclasses
import datetime
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The allowed values of every choice key, defined once (validation, the CLI and the kernels use these).
POSITIONS = ("goat", "rope", "alibi", "none", "learned")
ATTENTION_BACKENDS = ("auto", "flash4", "flash", "sdpa", "eager")
ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
PRIOR_INITS = ("seeded", "uniform")
PRECISIONS = ("auto", "fp32", "bf16")
ON_ERROR = ("raise", "skip")
ON_NONFINITE = ("raise", "skip")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "sqrt")
DATA_RESUME = ("check", "restart")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
EXPORT_DTYPES = ("fp32", "bf16")
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
SYNTHETIC_TASKS = ("passkey",)
WINDOW_ORDERS = ("keyed", "numpy")  # data/schedule.py's, without importing the data package here
DEFAULT_VOCAB_SIZE = 4096


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it."""


@dataclass
class GoatConfig:
    pos_rank: int = 4  # R: relative Fourier frequencies (2R lanes of each q/k head)
    abs_rank: int = 4  # M: absolute Fourier features of the sink MLP
    pos_base: float = 10_000.0
    abs_base: float = 10_000.0
    key_bias: bool = True  # the sink/recency term u(j): 3 lanes (bf16/fp16-exact split); 2R+3 in all
    prior_init: str = "seeded"  # seeded (ALiBi slopes) | uniform (starts as standard attention)
    # the sink features' length normaliser L_train (t / L_train, log1p(t) / log1p(L_train)); None: the
    # run's model.seq_len, or the value of the checkpoint it resumes or starts from (train.init_from),
    # so a context-extension stage keeps the first stage's. Saved resolved in every run's config.
    train_len: int | None = None


@dataclass
class ModelConfig:
    # the tokenizer's; padded internally for TP (padding gets no probability). Left out, null or auto in a
    # config: the data set manifest's (load_config), DEFAULT_VOCAB_SIZE when there is no manifest
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seq_len: int = 256  # training context; GOAT's L_train unless model.goat.train_len says otherwise
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int | None = None  # None: multi-head attention; fewer: grouped-query attention
    ffn_hidden_size: int | None = None  # None: 4h for gelu, 8h/3 rounded to 64 for swiglu
    activation: str = "swiglu"  # swiglu | gelu
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    bias: bool = False
    tie_embeddings: bool = True
    position: str = "goat"  # goat | rope | alibi | none | learned
    attention_backend: str = "auto"  # auto | flash4 | flash | sdpa | eager
    rope_base: float = 10_000.0
    init_std: float = 0.02
    dropout: float = 0.0
    vocab_pad_multiple: int = 128
    # torch.compile each transformer block's training forward: auto (on CUDA only) | true | false
    compile: bool | str = "auto"
    goat: GoatConfig = field(default_factory=GoatConfig)


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size; data parallel = world / tp
    sp: bool = False  # Megatron sequence parallelism (needs tp > 1)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    cp: int = 1  # context parallel: ranks sharing one sequence; data parallel = world / (tp x cp)
    timeout_minutes: float = 10.0  # collective timeout of every group: a frozen or dead rank ends the job
    # the dtype gradients are averaged over data-parallel ranks in under train.precision=bf16: fp32 (the
    # mean's error stays below 1e-7 at any DP size, as Megatron reduces) | bf16 (half the bytes on the wire;
    # its relative error grows with DP: 0.8 % at DP 64, 13 % at DP 512, docs/precision.md). fp32 also
    # accumulates micro-batches in fp32 where DeepSpeed allows it (ZeRO-2/3). No effect under fp32
    grad_reduce_dtype: str = "fp32"


@dataclass
class TrainConfig:
    max_steps: int = 300
    micro_batch_size: int = 8  # sequences per rank per forward pass
    global_batch_size: int = 8  # sequences per optimizer step, fixed when DP changes
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    lr_schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay; optim.lr_at)
    decay_fraction: float = 0.2  # wsd: the last fraction of max_steps that decays to min_lr
    decay_shape: str = "linear"  # wsd's decay: linear | cosine | sqrt (1 - sqrt(progress))
    # training length in tokens instead of steps: max_steps = ceil(max_tokens / (global batch x seq_len)),
    # set when the config is loaded; 0: max_steps decides
    max_tokens: int = 0
    # [start, increment, ramp_tokens]: the global batch grows from `start` sequences by `increment` over the
    # first ramp_tokens tokens to global_batch_size (Megatron's --rampup-batch-size; goat_dist/rampup.py)
    batch_rampup: list | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    activation_checkpointing: str = "none"  # none | full (whole blocks) | selective (attention core)
    eval_interval: int = 100  # steps between validation passes; 0 disables
    eval_batches: int = 4
    resume: str = "auto"  # auto (latest checkpoint of the run dir, if any) | never | <checkpoint step dir>
    data_resume: str = "check"  # check (refuse a changed data contract on resume) | restart (new stream)
    on_nonfinite: str = "raise"  # raise | skip (drop the update; counted as nonfinite_skipped)
    max_nonfinite_in_row: int = 5  # skip mode: raise after this many non-finite steps in a row
    stop_at: str | None = None  # a wall-clock deadline (ISO 8601): save and exit 75 before it
    time_limit_minutes: float = 0.0  # the same, as minutes from the start of this process; 0: off
    # a new run (step 0, its own data, schedule and layout) from a checkpoint's weights: a step dir, its
    # checkpoints/ dir or run dir (their latest). Ignored when the run resumes its own checkpoint.
    init_from: str | None = None
    init_optimizer: bool = False  # with init_from: also carry Adam's moments (and step count) over
    # the user's own callbacks (trainer/callbacks/plugins.py), as "package.module:Name" or
    # "package.module:Name:arg1:arg2" strings: each module is imported (from sys.path; PYTHONPATH for one of
    # your own) and Name(*args) built, the args as strings, on every rank; it gets the trainer's events and
    # may ask for a save or a stop. This runs code you chose, as a training script would.
    callbacks: list = field(default_factory=list)


@dataclass
class DataConfig:
    source: str = (
        "builtin"  # builtin (the Python stdlib's docs and source) | a `goat-dist data` shard dir/URL
    )
    sources: list | None = None  # a mixture instead of `source`: [{path: ..., weight: ...}, ...]
    cache_dir: str = "~/.cache/goat-dist"  # where the builtin dataset and its tokenizer are built once
    builtin_max_bytes: int = 8_000_000
    num_workers: int = 0  # DataLoader workers per rank (batches are identical for any number)
    shuffle_buffer: int = 1024  # sequences mixed across shards before batching; 0 keeps stream order
    # order inside a shuffle block: keyed (a seeded bijection, O(1) per sample at any dp) | numpy (the
    # order of streams begun before keyed existed; a resume of such a run keeps it by itself)
    window_order: str = "keyed"
    document_masking: bool = False  # positions restart per document and attention stays inside it
    on_error: str = "raise"  # raise | skip (a corrupt shard's rest is masked, counted, logged)
    synthetic: str | None = None  # None | passkey: a generated task instead of `source` (data/synthetic.py)


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps between checkpoints; 0: only at the end and on preemption signals
    interval_minutes: float = 0.0  # also save when this much wall time passed since the last save; 0: off
    keep_last: int = 2  # complete checkpoints kept (older ones pruned after a new one is published)
    save_at_end: bool = True
    # kept so that older config.yaml files load: every checkpoint is layout-independent now (one copy of the
    # state, each rank writing its own share); ``false`` is refused, naming why
    universal: bool = True
    # the config key is ``checkpoint.async`` (a Python keyword, so the field has another name; both work):
    # stage the save in host memory and write it in the background while training continues
    async_save: bool = False


# ``checkpoint.async`` as written in YAML and overrides: an alias of ``async_save``, visible to the loader
# (which accepts the annotated names) but not a dataclass field (config.yaml records ``async_save``)
CheckpointConfig.__annotations__["async"] = "bool"
setattr(
    CheckpointConfig,
    "async",
    property(lambda self: self.async_save, lambda self, value: setattr(self, "async_save", value)),
)


@dataclass
class LogConfig:
    interval: int = 10  # steps between progress lines / metrics.jsonl records
    tensorboard: bool = True
    prior_interval: int = 500  # steps between GOAT prior pictures in TensorBoard; 0 disables
    prior_layers: list | None = None  # layer indices to picture; None: first, middle and last
    prior_heads: list | None = None  # KV-head indices to picture; None: every head
    attention_stats: bool = True  # sink / entropy / locality of attention per layer, at each eval
    peak_tflops: float = 0.0  # peak FLOP/s per device for MFU, in TFLOP/s; 0: known GPU table or CPU probe


@dataclass
class RunConfig:
    name: str = "goat-tiny"
    dir: str | None = None  # default: runs/<name> under the working directory


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) if self.run.dir else Path("runs") / self.run.name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- validation ------------------------------------------------------------------------------------
def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a type hint; accept ints for floats and YAML's '1e-3' strings."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (datetime.date, datetime.datetime)):  # YAML reads bare timestamps as these
            return value.isoformat()
    else:
        return value
    raise ConfigError(f"config key '{key}' expects {getattr(hint, '__name__', hint)}, got {value!r}")


def _merge(obj: Any, updates: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in hints:
            known = ", ".join(sorted(hints))
            raise ConfigError(f"unknown config key '{key}' (known here: {known})")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{key}' is a section; give a mapping, got {value!r}")
            _merge(current, value, prefix=f"{key}.")
        else:
            setattr(obj, name, _coerce(value, hints[name], key))


def parse_override(text: str) -> dict:
    """``a.b.c=value`` -> ``{"a": {"b": {"c": value}}}``, the value parsed as YAML (``null``, ``true``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    out: dict = {}
    node = out
    parts = dotted.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def add_config_arguments(parser) -> None:
    """``--config`` and the dotted overrides, as every command that builds a Config takes them."""
    parser.add_argument("--config", help="YAML config file (default: the built-in tiny config)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=50 run.dir=x")


def _vocab_given(update: dict, given: bool) -> bool:
    """Whether ``model.vocab_size`` is set once ``update`` (a YAML file or an override) is merged; drops a
    ``null``/``auto`` value from it, which asks for the data set's vocabulary instead."""
    model = update.get("model")
    if not isinstance(model, dict) or "vocab_size" not in model:
        return given
    if model["vocab_size"] is None or model["vocab_size"] == "auto":
        del model["vocab_size"]
        return False
    return True


def data_vocab_size(cfg: Config) -> int | None:
    """The vocabulary of the configured data set(s), from their manifests; None for the builtin corpus, a
    generated task (``data.synthetic``) and data sets without a readable manifest."""
    d = cfg.data
    if d.synthetic:
        return None
    if d.sources:
        paths = [src["path"] for src in d.sources if isinstance(src, dict) and "path" in src]
    elif d.source == "builtin":
        return None
    else:
        paths = [d.source]
    from data_tools.shard_format import manifest_vocab_size

    sizes = [n for n in (manifest_vocab_size(str(p)) for p in paths) if isinstance(n, int)]
    return max(sizes) if sizes else None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    cfg = Config()
    vocab_given = steps_given = False
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        try:
            vocab_given = _vocab_given(data, vocab_given)
            steps_given = steps_given or _steps_given(data)
            _merge(cfg, data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e
    for text in overrides or []:
        update = parse_override(text)
        vocab_given = _vocab_given(update, vocab_given)
        steps_given = steps_given or _steps_given(update)
        _merge(cfg, update)
    if not vocab_given:
        cfg.model.vocab_size = data_vocab_size(cfg) or DEFAULT_VOCAB_SIZE
    validate(cfg)
    _steps_from_tokens(cfg, steps_given)
    return cfg


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


def _steps_given(update: dict) -> bool:
    train = update.get("train")
    return isinstance(train, dict) and "max_steps" in train


def _steps_from_tokens(cfg: Config, steps_given: bool) -> None:
    """``train.max_tokens`` -> ``train.max_steps`` (whole steps, rounded up), so everything downstream (the
    schedule, the deadline, the planner, the console) reads one length. A saved config carries both, in
    agreement; a ``max_steps`` given beside ``max_tokens`` that disagrees with it is refused."""
    t = cfg.train
    if t.max_tokens < 0:
        raise ConfigError(f"config key 'train.max_tokens' must be >= 0, got {t.max_tokens}")
    if not t.max_tokens:
        return
    from .rampup import steps_for_tokens

    steps = steps_for_tokens(t.max_tokens, t.global_batch_size, t.batch_rampup, cfg.model.seq_len)
    if steps_given and t.max_steps != steps:
        raise ConfigError(
            f"train.max_tokens={t.max_tokens} is {steps} steps of train.global_batch_size x model.seq_len "
            f"tokens (after any train.batch_rampup), but train.max_steps={t.max_steps} is also set; set one"
        )
    t.max_steps = steps


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
    _choice("data.on_error", cfg.data.on_error, ON_ERROR)
    _choice("data.window_order", cfg.data.window_order, WINDOW_ORDERS)
    _choice("train.on_nonfinite", t.on_nonfinite, ON_NONFINITE)
    _choice("train.data_resume", t.data_resume, DATA_RESUME)
    _choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    _choice("train.decay_shape", t.decay_shape, DECAY_SHAPES)
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
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size {m.hidden_size} must divide by model.num_heads {m.num_heads}")
    kv = m.num_kv_heads or m.num_heads
    if m.num_heads % kv:
        raise ConfigError(f"model.num_heads {m.num_heads} must divide by model.num_kv_heads {kv}")
    head_dim = m.hidden_size // m.num_heads
    from .shapes import prior_lane_count

    lanes = prior_lane_count(m.goat.pos_rank, m.goat.key_bias)
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
    timeout = cfg.parallel.timeout_minutes
    if not timeout > 0:
        raise ConfigError(f"config key 'parallel.timeout_minutes' must be > 0, got {timeout}")


def save_config(cfg: Config, path: Path) -> None:
    from goat_dist.atomic import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
