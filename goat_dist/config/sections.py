"""The configuration's sections as typed dataclasses, the allowed values of every choice key and
``ConfigError``: what a run can be told, with its defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
PRIOR_WEIGHT_DECAY = ("none", "c4", "all")  # train.prior_weight_decay (optim.decays)
WINDOW_ORDERS = ("epoch", "keyed", "numpy")  # data/schedule.py's, without importing the data package here
DEFAULT_VOCAB_SIZE = 4096


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it."""


class Section:
    """A configuration section that ``freeze`` can make read-only: a run resolves its config once (its
    precision, GOAT's L_train and lanes, the kept window order; ``trainer/resolve.py``), writes it as its
    config.yaml, and from then on every part of the run reads that same config."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise ConfigError(
                f"{type(self).__name__}.{name}: the run's config was resolved and saved as its config.yaml; "
                "it does not change afterwards"
            )
        object.__setattr__(self, name, value)


def freeze(section: Section) -> None:
    """Make ``section`` and the sections inside it read-only (``Section``)."""
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        value = getattr(section, f.name)
        if isinstance(value, Section):
            freeze(value)
    object.__setattr__(section, "_frozen", True)


@dataclass
class GoatConfig(Section):
    pos_rank: int = 4  # R: relative Fourier frequencies (2R lanes of each q/k head)
    abs_rank: int = 4  # M: absolute Fourier features of the sink MLP
    pos_base: float = 10_000.0  # base of the relative frequencies: w_r = pos_base^(-r / (R - 1))
    abs_base: float = 10_000.0  # the same for the M absolute frequencies of the sink MLP's features
    key_bias: bool = True  # the sink/recency term u(j), on key_bias_lanes lanes of each q/k head
    # u(j)'s lanes: 3 (split into parts exact in bf16/fp16: 2R+3 in all) | 1 (one lane, exact in fp32
    # only: the reference's 2R+1) | auto: 1 when train.precision resolves to fp32, else 3, or the count
    # of the checkpoint a run starts from where that is exact. Saved resolved; a start that would change
    # it is refused (checkpoint/extension.py)
    key_bias_lanes: int | str = "auto"
    sink_init_std: float = 1e-3  # std of the sink MLP's initial weights (the authors' C4 script: 1e-3)
    prior_init: str = "seeded"  # seeded (ALiBi slopes) | uniform (starts as standard attention)
    # the sink features' length normaliser L_train (t / L_train, log1p(t) / log1p(L_train)); None: the
    # run's model.seq_len, or the value of the checkpoint it resumes or starts from (train.init_from),
    # so a context-extension stage keeps the first stage's. Saved resolved in every run's config.
    train_len: int | None = None


@dataclass
class ModelConfig(Section):
    # the tokenizer's; padded internally for TP (padding gets no probability). Left out, null or auto in a
    # config: the data set manifest's (load_config), DEFAULT_VOCAB_SIZE when there is no manifest
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seq_len: int = 256  # training context; GOAT's L_train unless model.goat.train_len says otherwise
    num_layers: int = 4  # transformer blocks
    hidden_size: int = 256  # model width
    num_heads: int = 8  # query heads; head dim = hidden_size / num_heads (GOAT's prior lanes included)
    num_kv_heads: int | None = None  # None: multi-head attention; fewer: grouped-query attention
    ffn_hidden_size: int | None = None  # None: 4h for gelu, 8h/3 rounded to 64 for swiglu
    activation: str = "swiglu"  # swiglu | gelu
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5  # epsilon of every RMSNorm / LayerNorm
    bias: bool = False  # biases in the linear layers and LayerNorms
    tie_embeddings: bool = True  # the output layer shares the input embedding's weights
    position: str = "goat"  # goat | rope | alibi | none | learned
    attention_backend: str = "auto"  # auto | flash4 | flash | sdpa | eager
    rope_base: float = 10_000.0  # RoPE's frequency base (position=rope)
    init_std: float = 0.02  # normal init; the residual branches' output layers: init_std / sqrt(2 num_layers)
    # dropout on each residual branch's output (attention, MLP); must be 0: every rank seeds alike, so
    # its masks would repeat across data-parallel replicas and sequence-parallel shards
    dropout: float = 0.0
    vocab_pad_multiple: int = 128  # the vocabulary is padded to a multiple of this (and of TP)
    # torch.compile each transformer block's training forward: auto (on CUDA only) | true | false
    compile: bool | str = "auto"
    goat: GoatConfig = field(default_factory=GoatConfig)


@dataclass
class ParallelConfig(Section):
    tp: int = 1  # tensor-parallel size; data parallel = world / (tp x cp)
    sp: bool = False  # Megatron sequence parallelism (needs tp > 1)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    cp: int = 1  # context parallel: ranks sharing one sequence; data parallel = world / (tp x cp)
    # collective timeout of every group once this process's first step has ended: a frozen or dead rank
    # ends the job
    timeout_minutes: float = 10.0
    # collective timeout of every group (and the hang watchdog's) until this process's first step ends: its
    # compiles (torch.compile, FlashAttention's JIT per shape); not below parallel.timeout_minutes
    startup_timeout_minutes: float = 30.0
    # the dtype gradients are averaged over data-parallel ranks in under train.precision=bf16: fp32 (the
    # mean's error stays below 1e-7 at any DP size, as Megatron reduces) | bf16 (half the bytes on the wire;
    # its relative error grows with DP: 0.8 % at DP 64, 13 % at DP 512, docs/precision.md). No effect under
    # fp32 training. Accumulation across micro-batches is grad_accum_dtype's
    grad_reduce_dtype: str = "fp32"
    # the dtype micro-batch gradients are summed in under train.precision=bf16, at every ZeRO stage: fp32
    # (as Megatron's main_grad; ZeRO-0/1 through DeepSpeed's BF16_Optimizer, +4 bytes per parameter) |
    # bf16 (every partial sum rounded to bf16: relative error 0.3 % at 8 micro-batches, 0.8 % at 64, against
    # 4e-10 and 3e-9 in fp32; docs/precision.md). No effect under fp32 or with one micro-batch per step
    grad_accum_dtype: str = "fp32"


@dataclass
class TrainConfig(Section):
    max_steps: int = 300  # optimizer steps (train.max_tokens, when set, decides instead)
    micro_batch_size: int = 8  # sequences per rank per forward pass
    global_batch_size: int = 8  # sequences per optimizer step, fixed when DP changes
    lr: float = 3e-3  # peak learning rate, reached at the end of the warmup
    min_lr: float = 3e-4  # the learning rate at the end of the decay
    warmup_steps: int = 20  # linear warmup steps up to lr
    lr_schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay; optim.lr_at)
    decay_fraction: float = 0.2  # wsd: the last fraction of max_steps that decays to min_lr
    decay_shape: str = "linear"  # wsd's decay: linear | cosine | sqrt (1 - sqrt(progress))
    # training length in tokens instead of steps: max_steps = ceil(max_tokens / (global batch x seq_len)),
    # set when the config is loaded; 0: max_steps decides
    max_tokens: int = 0
    # [start, increment, ramp_tokens]: the global batch grows from `start` sequences by `increment` over the
    # first ramp_tokens tokens to global_batch_size (Megatron's --rampup-batch-size; goat_dist/rampup.py)
    batch_rampup: list | None = None
    weight_decay: float = 0.1  # AdamW's; none on norms, biases and GOAT prior parameters
    # which parameters decay beyond those (optim.decays): none (the paper's text) | c4 (the authors'
    # train_c4.py: also sink_gain, sink_bump, recency_slope_raw) | all (every parameter, norms, biases and
    # the whole prior: their passkey/NIAH script, at weight_decay 0.01)
    prior_weight_decay: str = "none"
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0: no clipping
    seed: int = 1234  # initial weights and data order; the same on every rank
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    activation_checkpointing: str = "none"  # none | full (whole blocks) | selective (attention core)
    eval_interval: int = 100  # steps between validation passes; 0 disables
    eval_batches: int = 4  # micro-batches per rank in each validation pass
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
class DataConfig(Section):
    source: str = (
        "builtin"  # builtin (the Python stdlib's docs and source) | a `goat-dist data` shard dir/URL
    )
    sources: list | None = None  # a mixture instead of `source`: [{path: ..., weight: ...}, ...]
    cache_dir: str = "~/.cache/goat-dist"  # where the builtin dataset and its tokenizer are built once
    # remote (pipe:/URL) shards staged per host, least recently used evicted past this many GB (1e9 bytes),
    # never a shard a reader holds; 0 or null: no limit. 50: hundreds of 64 MB shards, well inside a GPU
    # node's local scratch (data/shard_index.py)
    cache_max_gb: float | None = 50.0
    # where they are staged; null: $SLURM_TMPDIR, else $TMPDIR, inside a Slurm job, else <cache_dir>/remote
    remote_cache_dir: str | None = None
    builtin_max_bytes: int = 8_000_000  # bytes of stdlib text the builtin data set is built from
    num_workers: int = 0  # DataLoader workers per rank (batches are identical for any number)
    shuffle_buffer: int = 1024  # sequences mixed across shards before batching; 0 keeps stream order
    # window order: epoch (a seeded bijection of the whole epoch's windows, O(1) per sample at any dp; with
    # it shuffle_buffer only turns shuffling off at 0) | keyed (the same inside each shuffle_buffer block;
    # streams begun before epoch) | numpy (before keyed). A resume keeps the order its stream began with.
    window_order: str = "epoch"
    document_masking: bool = False  # positions restart per document and attention stays inside it
    # every window is BOS + seq_len - 1 corpus tokens, as the authors' C4 script frames them (the data
    # set's BOS, else its EOS); evaluation windows too (data/framing.py). Part of the data contract
    bos_framing: bool = False
    on_error: str = "raise"  # raise | skip (a corrupt shard's rest is masked, counted, logged)
    synthetic: str | None = None  # None | passkey: a generated task instead of `source` (data/synthetic.py)


@dataclass
class CheckpointConfig(Section):
    interval: int = 0  # steps between checkpoints; 0: only at the end and on preemption signals
    interval_minutes: float = 0.0  # also save when this much wall time passed since the last save; 0: off
    keep_last: int = 2  # complete checkpoints kept (older ones pruned after a new one is published)
    save_at_end: bool = True  # save when the run ends (unless its last step is saved already)
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
class LogConfig(Section):
    interval: int = 10  # steps between progress lines / metrics.jsonl records
    tensorboard: bool = True  # TensorBoard events in <run_dir>/tensorboard/ (rank 0)
    prior_interval: int = 500  # steps between GOAT prior pictures in TensorBoard; 0 disables
    prior_layers: list | None = None  # layer indices to picture; None: first, middle and last
    prior_heads: list | None = None  # KV-head indices to picture; None: every head
    attention_stats: bool = True  # sink / entropy / locality of attention per layer, at each eval
    peak_tflops: float = 0.0  # peak FLOP/s per device for MFU, in TFLOP/s; 0: known GPU table or CPU probe
    memory_per_rank: bool = False  # also every rank's memory (mem/rank_<r>/); default: min / mean / max only
    profile_steps: list | None = None  # [first, last] steps to trace with torch.profiler; None: no profile
    profile_ranks: list | None = None  # the ranks that trace (<run_dir>/profile/); None: rank 0 only


@dataclass
class RunConfig(Section):
    name: str = "goat-tiny"  # the run's name: run.dir defaults to runs/<name>
    dir: str | None = None  # default: runs/<name> under the working directory


@dataclass
class Config(Section):
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

    def frozen(self) -> Config:
        """This config, read-only from now on (every section: ``Section``); returns it."""
        freeze(self)
        return self


# ---- validation ------------------------------------------------------------------------------------
