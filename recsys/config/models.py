"""The ``[model]`` section and its sub-sections: the shared architecture keys, the built-in
models' own options ([model.cross], [model.xdeepfm], [model.pnn], [model.mmoe]), a user model's
constructor options ([model.args]), and where tables live ([model.dynamic], [model.storage]).
Split from :mod:`recsys.config.sections`, which assembles the whole config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from recsys.config.rules import AtLeast0, AtLeast1, Check, Fraction, Range
from recsys.config.sequences import SequenceModelConfig


@dataclass
class CrossConfig:
    """Cross network of dcn and dlrm_dcn (the one section the two share)."""

    num_layers: Annotated[int, AtLeast1] = 3
    """Number of cross layers."""
    low_rank: Annotated[int, AtLeast0] = 0
    """0: full-rank layers (W is [D, D]); r > 0: low-rank W = U V of rank r (DCN-v2; MLPerf's
    DLRM-DCNv2 uses 512)."""
    version: Literal["v2", "v1"] = "v2"
    """dcn only: v2 (matrix W, Wang et al. 2021) or v1 (vector w, Wang et al. 2017)."""
    structure: Literal["stacked", "parallel"] = "stacked"
    """dcn only: the deep network after the cross network (stacked) or beside it, their outputs
    concatenated (parallel)."""


@dataclass
class XDeepFMConfig:
    """Compressed interaction network (CIN) of xdeepfm."""

    cin_layer_sizes: list[Annotated[int, AtLeast1]] = field(default_factory=lambda: [64, 64])
    """Feature maps of each CIN layer; all but the last must be even (each sends half of its
    maps to the output and half to the next layer)."""


@dataclass
class PNNConfig:
    """Product layer of pnn."""

    product: Literal["inner", "outer", "both"] = "inner"
    """Inner products of embedding pairs (IPNN), outer products (OPNN, kernel-compressed) or
    both (PNN*)."""


@dataclass
class MMoEConfig:
    """Multi-gate mixture of experts (mmoe)."""

    num_experts: Annotated[int, AtLeast1] = 4
    """Experts shared by all tasks."""
    expert_layer_sizes: list[Annotated[int, AtLeast1]] = field(default_factory=lambda: [64, 32])
    """MLP sizes of each expert."""
    tower_layer_sizes: list[Annotated[int, AtLeast1]] = field(default_factory=lambda: [32])
    """Hidden sizes of each task's tower; a final layer to one logit is added."""


@dataclass
class DynamicConfig:
    """Dynamic tables: keyed by raw 64-bit ids, no vocabulary, growing, evicting and admitting
    rows as ids arrive (see README, "Dynamic tables"). Data with raw ids (``recsys preprocess
    --preprocess.encoding=raw``, or synthetic data with raw ids) makes every table dynamic;
    ``tables`` makes some tables of other data dynamic too. Options apply to every dynamic
    table, ``overrides`` change them per table."""

    tables: list[str] = field(default_factory=list)
    """Categorical features whose tables are dynamic (``["all"]``: every one), besides the
    ones raw-id data makes dynamic."""
    initial_capacity: Annotated[int, AtLeast1] = 4096
    """Rows a table starts with (rounded up to whole buckets); it doubles as keys arrive."""
    max_capacity: Annotated[int, AtLeast0] = 0
    """Most rows a table may hold; once full, a new id evicts the lowest-score row of its
    bucket. 0: no cap."""
    memory_budget_mb: Annotated[float, AtLeast0] = 0.0
    """Most MiB per table for its rows, optimizer state and map (0: no budget)."""
    score: Literal["lru", "lfu"] = "lru"
    """Which rows eviction drops first: least recently (lru) or least often (lfu) seen."""
    bucket_size: Annotated[int, Range(min=1, max=128)] = 32
    """Slots per bucket of the id -> slot map."""
    load_factor: Annotated[float, Range(min=0.01, max=1)] = 0.75
    """Grow once this share of the slots would be in use."""
    admit_after: Annotated[int, AtLeast0] = 0
    """An id gets a row once seen this many times (0 or 1: at once); until then it pools as
    zeros and is not trained."""
    admission_capacity: Annotated[int, AtLeast0] = 0
    """Most ids the admission counter counts (0: the table's cap, within [2**20, 2**24])."""
    ttl_steps: Annotated[int, AtLeast0] = 0
    """Drop the row of an id not seen for more than this many steps (0: never)."""
    routing_buckets: Annotated[int, AtLeast1] = 4096
    """Global buckets ids are hashed into under torchrun: each rank owns a contiguous range
    of them, so at most this many ranks share a table, and a checkpoint moves to another
    number of ranks in whole buckets. Fixed for a table's life (checkpoints record it)."""
    overrides: list[str] = field(default_factory=list)
    """Per-table options, ``"<feature>.<key>=<value>"`` (e.g. ``"cat_3.max_capacity=100000"``,
    ``"cat_7.score=lfu"``)."""


@dataclass
class StorageConfig:
    """Where the tables' rows live (see README, "Tables larger than memory"). ``device``: whole
    in the compute device's memory. ``host`` / ``disk``: every row (weights and optimizer state)
    in host memory or in a file on local disk, with a cache of the hot rows where the kernels
    run, filled one batch ahead. Options apply to every table with at least ``min_rows`` rows
    (and to every dynamic table); ``overrides`` change them per table."""

    tier: Literal["device", "host", "disk"] = "device"
    """Where a table's full rows live: device, host (a cache on the device in front) or disk."""
    min_rows: Annotated[int, AtLeast0] = 0
    """Only tables with at least this many rows take ``tier`` (smaller ones stay on the
    device); dynamic tables always take it."""
    cache_rows: Annotated[int, AtLeast0] = 0
    """Rows of each tiered table's cache (under torchrun: on each rank holding a shard of it);
    0: from ``cache_mb``. Size it from the hit rate the train log prints
    (``tiered/<table>/hit_rate``); it must hold two batches' distinct ids."""
    cache_mb: Annotated[float, AtLeast0] = 256.0
    """MiB of each tiered table's cache (rows and optimizer state; per rank under torchrun),
    when cache_rows is 0."""
    policy: Literal["lru", "lfu"] = "lru"
    """Which cached rows leave first: least recently (lru) or least often (lfu) used."""
    path: str = ""
    """Directory of the disk tier's files (one per table; sparse: only rows trained take
    disk). "": ``<run dir>/tables``. Put it on a local SSD."""
    overrides: list[str] = field(default_factory=list)
    """Per-table options, ``"<feature>.<key>=<value>"`` (e.g. ``"cat_3.tier=device"``,
    ``"cat_7.cache_rows=100000"``)."""


@dataclass
class ModelConfig:
    """Model architecture. Table sizes and the number of tasks come from the data, never from
    here. The keys below are shared by the models; a model's own options are in its section
    ([model.cross], [model.xdeepfm], [model.pnn], [model.mmoe])."""

    name: Annotated[
        str,
        Check(
            "recsys.build.registry:model_name_problem",
            "a built-in model, an installed recsys.models entry point, or 'module:Class'",
        ),
    ] = "dlrm"
    """Model to build: a built-in (dlrm, dlrm_dcn, dcn, deepfm, wide_deep, xdeepfm, pnn,
    mmoe; sasrec and hstu, sequence models with options in [model.sequence]; hstu_ranking,
    target-aware ranking), the name of an installed package's ``recsys.models`` entry point,
    or a class of your own as ``"module:Class"`` (imported from the installed packages, then
    the working directory). Any of them is built through the same contract (README, "Your
    model class"): its constructor gets the tables and sizes it names, its own options come
    from [model.args]."""
    args: dict[str, Any] = field(default_factory=dict)
    """[model.args]: constructor arguments of the model class beyond the ones the trainer
    passes (checked against its signature before any table is built); e.g. ``gate_hidden =
    32``. A built-in's own options are in its section ([model.cross], ...) instead."""
    embedding_dim: Annotated[int, AtLeast1] = 16
    """Embedding dimension of every table (sasrec / hstu: the item and hidden dimension)."""
    pooling: Literal["sum", "mean"] = "sum"
    """How a bag of ids is reduced to one vector."""
    embedding_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    """Storage dtype of the tables (pooled in fp32 either way); fp16 / bf16 halve their memory."""
    dense_arch_layer_sizes: list[Annotated[int, AtLeast1]] = field(default_factory=lambda: [64, 16])
    """Bottom MLP over the dense features; the last size must equal embedding_dim (DLRM)."""
    over_arch_layer_sizes: list[Annotated[int, AtLeast1]] = field(
        default_factory=lambda: [64, 32, 1]
    )
    """Top (deep) MLP; its last size is the number of tasks (every model but mmoe)."""
    activation: Literal["relu", "gelu", "silu"] = "relu"
    """Activation of the hidden MLP layers."""
    dropout: Annotated[float, Fraction] = 0.0
    """Dropout after each hidden MLP layer, in training only."""
    cross: CrossConfig = field(default_factory=CrossConfig)
    """[model.cross]: dcn and dlrm_dcn."""
    xdeepfm: XDeepFMConfig = field(default_factory=XDeepFMConfig)
    """[model.xdeepfm]"""
    pnn: PNNConfig = field(default_factory=PNNConfig)
    """[model.pnn]"""
    mmoe: MMoEConfig = field(default_factory=MMoEConfig)
    """[model.mmoe]"""
    sequence: SequenceModelConfig = field(default_factory=SequenceModelConfig)
    """[model.sequence]: sasrec and hstu."""
    dynamic: DynamicConfig = field(default_factory=DynamicConfig)
    """[model.dynamic]: tables keyed by raw ids."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """[model.storage]: tables in host memory or on disk behind a cache."""
