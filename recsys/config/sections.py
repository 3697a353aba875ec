"""The config's sections: one dataclass per TOML table, every field with its type, default,
allowed range and docstring (the string literal under it, rendered by ``recsys config
--reference``). Each component of a run receives only its own section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from recsys.config.models import ModelConfig
from recsys.config.rules import AtLeast0, AtLeast1, Check, Fraction, Range
from recsys.config.sequences import (
    BestMetric,
    NextItemConfig,
    SyntheticSequencesConfig,
)


@dataclass
class RunConfig:
    """Identity of a run and where its files go."""

    name: str = ""
    """Run name. Empty means the recipe file's stem (``dlrm_synthetic``), or ``recsys``."""
    dir: str = ""
    """Run directory holding config.toml, metrics.jsonl and checkpoints/. Empty means
    ``runs/<name>``. A new run refuses a directory holding another run's checkpoints or
    events: continue that run (checkpoint.resume = "latest"), or set overwrite."""
    overwrite: bool = False
    """Start this run in a run.dir that holds another run, deleting that run's config.toml,
    metrics.jsonl and checkpoints/ (other files are kept) once this run has started."""
    tensorboard: bool = True
    """Also write the numbers of metrics.jsonl's events as TensorBoard scalars, tagged
    ``<split>/<field>`` (``train/loss``, ``valid/auc``, ...), to event files in
    ``<run dir>/tensorboard/`` (rank 0); view them with ``tensorboard --logdir runs``."""
    seed: int = 0
    """Seed for parameter initialization, data order and the synthetic data generator."""
    device: Annotated[
        str, Check("recsys.distributed.parallel:check_device_name", "auto, cpu, cuda or cuda:N")
    ] = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""


@dataclass
class SyntheticConfig:
    """The built-in synthetic click log: Criteo-shaped features, labels from a hidden teacher."""

    num_dense: int = 13
    """Number of dense (float) features; Criteo has 13. 0: a categorical-only log (Avazu-like);
    the teacher then has no dense term."""
    cardinalities: list[int] = field(default_factory=lambda: [1000] * 26)
    """Number of distinct ids of each categorical feature, at most 2^40; its length is the
    number of categorical features (Criteo has 26). The hidden teacher holds a table of per-id
    parameters for a feature of up to 2^20 ids and derives them from hashes of the id above
    that, so the data takes a few MB whatever the cardinality (a table larger than RAM trains
    from the built-in data; beside such a feature the small ones draw other parameters)."""
    bag_sizes: list[int] = field(default_factory=list)
    """Per categorical feature, the largest number of ids in one sample's bag. 1 (or an empty
    list, for all features) means one-hot; m > 1 draws bag lengths as ``bag_lengths`` says."""
    bag_lengths: Literal["uniform", "fixed"] = "uniform"
    """How long a bag of a feature with bag size m > 1 is: ``uniform``, drawn uniformly from
    0..m (empty bags occur); ``fixed``, exactly m ids in every bag (MLPerf DLRM-DCNv2's
    multi-hot features, 1 to 100 ids)."""
    zipf_alpha: float = 1.1
    """Skew of the id distribution: id rank r is drawn with probability ~ 1 / (r + 1)^alpha."""
    num_tasks: int = 1
    """Number of labels per sample (tasks of a multi-task model). Task t's teacher and labels
    are the same for any num_tasks > t (task 0 is the one-task data)."""
    num_train_samples: int = 1_000_000
    """Rows in the train split."""
    num_valid_samples: int = 65_536
    """Rows in the validation split (periodic evaluation)."""
    num_test_samples: int = 131_072
    """Rows in the test split (final evaluation)."""
    teacher_dim: int = 8
    """Latent dimension of the hidden teacher's embeddings."""
    teacher_logit_std: float = 2.0
    """Standard deviation of the teacher's logit; larger means a higher oracle AUC."""
    click_rate: float = 0.25
    """Mean click probability (Criteo's is about 0.25)."""
    drift_days: Annotated[int, AtLeast0] = 0
    """0: stationary data (every split from one id distribution). D > 0: a drifting stream of
    days 0..D in which ids are born, peak and die (see new_ids_per_day, popularity_drift).
    train = days 0..D-1 in day order (num_train_samples spread evenly; every chunk from one
    day): with data.shuffle = false the loader reads the days in order, with shuffle it mixes
    chunks of all days (as it does with any data). valid and test = day D, the next day, two
    independent draws. ``SyntheticDataset.day(d, n)`` draws n samples of any one day."""
    new_ids_per_day: Annotated[float, Range(min=0, max=1)] = 0.1
    """Drift only, in (0, 1]: each day every feature gets k = max(1, round(new_ids_per_day *
    cardinality)) ids that never existed before, and its k oldest ids die: a feature's
    cardinality is the number of ids alive on any one day (about ceil(1 / new_ids_per_day)
    days' worth). Over days 0..D a feature has (ceil(cardinality / k) + D) * k ids."""
    popularity_drift: Annotated[float, Fraction] = 0.3
    """Drift only, in [0, 1): every day of age multiplies an id's share of the traffic by
    (1 - popularity_drift), so popularity moves to recent ids and old ids fade. 0: a living id
    keeps its popularity until it dies (then new ids are about new_ids_per_day of a day's ids
    and of its traffic); 0.3: the newest day's ids draw about 30% of the traffic."""
    id_encoding: Literal["index", "raw"] = "index"
    """``index``: ids are numbers in [0, cardinality) (with drift, [0, ids over all days),
    which are then the table sizes), so a fixed table can hold them. ``raw``: ids are 64-bit
    keys mix63(feature * 2^40 + id number + 1) in [1, 2^63) (see ``recsys.data.keys``) that no
    vocabulary holds; the dataset's spec says ``id_encoding = "raw"`` with cardinalities 0.
    The samples are the same for both, up to that id mapping."""


@dataclass
class CriteoConfig:
    """Reading a raw Criteo TSV directly (small files; large ones go through preprocess)."""

    hash_buckets: Annotated[int, AtLeast1] = 100_000
    """Rows of every categorical table: ids are int(hex) mod hash_buckets."""
    valid_fraction: Annotated[float, Fraction] = 0.05
    """Share of the lines drawn (seeded by run.seed) into the validation split."""
    test_fraction: Annotated[float, Fraction] = 0.05
    """Share of the lines drawn into the test split."""
    strict: bool = False
    """Stop at the first malformed line instead of counting and skipping it."""


@dataclass
class DataConfig:
    """Where batches come from and how they are loaded."""

    source: Literal[
        "auto", "synthetic", "parquet", "criteo", "sequences", "synthetic_sequences"
    ] = "auto"
    """``auto``: ``parquet`` when data.path is a preprocessed directory (``sequences`` when it
    holds user histories, written by ``recsys preprocess --format interactions``), ``criteo``
    when it is a file, ``synthetic`` when data.path is empty (``synthetic_sequences`` for a
    sequence model: sasrec, hstu)."""
    path: str = ""
    """A directory written by ``recsys preprocess`` (or a raw Criteo TSV file, read whole)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """Settings of the synthetic source."""
    synthetic_sequences: SyntheticSequencesConfig = field(default_factory=SyntheticSequencesConfig)
    """Settings of the synthetic interaction log (sequence models)."""
    criteo: CriteoConfig = field(default_factory=CriteoConfig)
    """Settings of the direct Criteo TSV reader."""
    prefetch_batches: Annotated[int, Range(min=-1)] = -1
    """Batches made ready ahead by a background thread of the training process while the
    current one trains (with loader_workers: received from the workers and, on CUDA, pinned).
    -1: 4 on CUDA, 0 on CPU (without workers the thread would build batches there, competing
    with training for the interpreter and the same cores; measured in benchmarks/data.py);
    0: in the training thread."""
    loader_workers: Annotated[int, Range(min=-1)] = -1
    """Processes that build the batches (each a shuffle buffer's worth ahead of training), so
    that a step does not wait for its batch; the batches are the same for any value. -1: half
    the CPUs of each rank on this machine, at most 8, and 0 where a rank has fewer than 2;
    0: build them in the training process."""
    shuffle: bool = True
    """Shuffle the train split every epoch: the order of its chunks and the rows within each
    shuffle buffer."""
    shuffle_buffer_chunks: Annotated[int, AtLeast1] = 4
    """Chunks (row groups) whose rows are mixed together when shuffling; more mixes better and
    holds more rows in memory."""
    validate: bool = True
    """Check every chunk read from disk: labels in {0, 1}, finite dense values, ids inside
    their tables (raw 64-bit keys, ``id_encoding = "raw"`` in metadata.json: any int64)."""


# MLPerf Training DLRM-DCNv2 (recommendation_v2/torchrec_dlrm in mlcommons/training, README.MD)
# fmt: off
MLPERF_TABLE_ROWS = (40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000,
                     3_067_956, 405_282, 10, 2_209, 11_938, 155, 4, 976, 14, 40_000_000,
                     40_000_000, 40_000_000, 590_152, 12_973, 108, 36)
MLPERF_BAG_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3,
                    1, 1)
# fmt: on


@dataclass
class PreprocessConfig:
    """``recsys preprocess``: raw logs or tables -> parquet + metadata that training reads."""

    format: Literal["criteo", "parquet", "csv", "interactions"] = "criteo"
    """Input format: Criteo TSV (label, 13 counts, 26 hex categories; .gz allowed), or parquet /
    CSV with named columns (give their roles below); ``interactions``: an interaction log
    (parquet or CSV, by file suffix) with ``user``, ``item`` and ``time`` columns, turned into
    per-user histories (``recsys.data.sequences``)."""
    input: str = ""
    """Training data: a file, a directory of files, or a glob."""
    valid: str = ""
    """Validation data; empty: carve valid_fraction out of input."""
    test: str = ""
    """Test data; empty: carve test_fraction out of input."""
    output: str = ""
    """Directory to write: train/, valid/, test/ parquet, metadata.json, workflow/. It may be new,
    empty, or (with overwrite) one written by preprocess; anything else is refused, as is an input
    inside it."""
    overwrite: bool = False
    """Replace an output directory written by an earlier preprocess run (the old one is deleted
    only after the new one is in place)."""
    apply: str = ""
    """A directory written by preprocess: transform the input with its fitted workflow instead of
    fitting a new one (same ids, table sizes and fingerprint; unseen values get the rare id).
    Column roles, encoding and dense transform come from there; label columns may be absent
    (scoring), and valid_fraction = test_fraction = 0 puts every row in train/, in input order.
    A raw-encoded directory has nothing fitted: its roles and options hash the input alike."""
    categorical: list[str] = field(default_factory=list)
    """parquet/csv: one-id-per-row categorical columns (null or an empty CSV field: missing)."""
    multi_hot: list[str] = field(default_factory=list)
    """parquet/csv: list columns, each row a bag of ids. A null list is an empty bag; null items
    (CSV: an empty item between two separators) are dropped; both are counted in the report."""
    dense: list[str] = field(default_factory=list)
    """parquet/csv: numeric feature columns (null or an empty CSV field: missing)."""
    label: list[str] = field(default_factory=list)
    """parquet/csv: 0/1 label columns (several for multi-task models)."""
    encoding: Literal["categorify", "hash", "raw", "mlperf"] = "categorify"
    """``categorify``: contiguous ids fitted on train (0 padding, 1 missing, 2 rare or unseen,
    frequent values from 3); ``hash``: id = hash(value) mod hash_buckets; ``raw``: no
    vocabulary and no fit, one streaming pass: each value (multi-hot: each item) becomes a
    stable 64-bit key in [1, 2^63), a hash of its text (integers by their decimal digits, so
    12 and "12" agree; Criteo hex lowercased), missing -> 0; the same value gets the same key
    in any run, file or process (``recsys.data.keys``). The data then needs dynamic tables
    (metadata.json says ``id_encoding = "raw"``, cardinalities 0). Not with normalize_dense.
    ``mlperf`` (criteo day files, ``--valid`` the last day): the data of MLPerf Training's
    DLRM-DCNv2 reference, id for id: ids numbered in order of first appearance over every file,
    modulo ``mlperf_table_rows``, each made a fixed-size bag as the reference materializes
    multi-hot (``mlperf_bag_sizes``), dense log(x - file min + 2), the valid file cut in halves
    into valid and test (``recsys.data.etl_mlperf``)."""
    mlperf_table_rows: list[int] = field(default_factory=lambda: list(MLPERF_TABLE_ROWS))
    """encoding = "mlperf": rows of each of the 26 tables, the modulus of its ids (the
    reference's ``num_embeddings_per_feature``)."""
    mlperf_bag_sizes: list[int] = field(default_factory=lambda: list(MLPERF_BAG_SIZES))
    """encoding = "mlperf": ids per bag of each of the 26 features (the reference's
    ``multi_hot_sizes``)."""
    mlperf_bag_distribution: Literal["uniform", "pareto"] = "uniform"
    """encoding = "mlperf": how the reference draws the ids that join each id in its bag
    (``multi_hot_distribution_type``; MLPerf runs uniform)."""
    user: str = ""
    """interactions: the user column (any type; its text identifies the user)."""
    item: str = ""
    """interactions: the item column (any type), encoded as ``encoding`` says."""
    time: str = ""
    """interactions: the time column (numbers, or parquet timestamps); a user's events are
    ordered by it, ties in input order."""
    max_len: Annotated[int, AtLeast0] = 0
    """interactions: the most recent events kept of a history (0: every event). Training learns
    from every event kept (``train.next_item.train_rows``) and ``exclude_history`` masks every
    item kept before a target, so a cap below the longest history drops targets and leaves
    older items unmasked; it only bounds the stored size (train rows keep max_len + 1 events,
    so that max_len next-item targets remain)."""
    item_universe: Literal["train", "log", "catalog"] = "train"
    """interactions, categorify: the items that get ids, and so the items ranked: ``train``,
    the items of the train events (an item that occurs only as a valid or test target gets the
    rare id and is never a candidate: a forced miss, the cold-item protocol); ``log``, every
    item of the log (as RecBole and most papers rank; an item seen only as a target has a row
    that is never trained); ``catalog``, the items of ``item_catalog`` (every one of them, even
    one the log never names; a logged item outside it is rare). Ids go by train count either
    way (``log``: by count in the log)."""
    item_catalog: str = ""
    """interactions, ``item_universe = "catalog"``: a parquet or CSV file (by suffix) whose column
    named like ``item`` lists the catalog's items (duplicates allowed); freq_threshold does not
    apply to them."""
    freq_threshold: Annotated[int, AtLeast0] = 1
    """categorify: values seen fewer times than this in train share the rare id."""
    hash_buckets: Annotated[int, AtLeast1] = 1_000_000
    """hash: table size of every categorical feature."""
    log_dense: bool = True
    """Dense values become sign(x) * log(1 + abs(x)): log(1 + x) for counts (Criteo's), and
    negative values keep their sign; missing ones are 0. The report counts negative values per
    column."""
    normalize_dense: bool = False
    """Standardize dense values with the train split's mean and std (after the log); not with
    encoding = "raw", which fits nothing."""
    valid_fraction: Annotated[float, Fraction] = 0.05
    """Share of input rows carved into valid when no valid data is given (0: none, apply only)."""
    test_fraction: Annotated[float, Fraction] = 0.05
    """Share of input rows carved into test when no test data is given (0: none, apply only)."""
    seed: int = 0
    """Seed of the carve-out draw."""
    chunk_mb: Annotated[int, AtLeast1] = 64
    """Input is read and transformed in pieces of about this many MB: memory stays bounded."""
    row_group_rows: Annotated[int, AtLeast1] = 65_536
    """Rows per parquet row group in the output; a row group is the unit training reads and
    shards across ranks."""
    strict: bool = False
    """Stop at the first malformed line / row (wrong field count, label not 0/1, dense value not a
    finite number, ...) instead of counting and skipping it."""


@dataclass
class TrainConfig:
    """The optimization loop."""

    batch_size: Annotated[int, AtLeast1] = 1024
    """Samples per step on each rank."""
    epochs: Annotated[int, AtLeast0] = 1
    """Passes over the train split. Training stops at whichever of epochs / max_steps is first
    (0: no training, only the test evaluation and the checkpoint of the initial model)."""
    max_steps: Annotated[int, AtLeast0] = 0
    """Stop after this many steps (0: no limit beyond epochs)."""
    dense_optimizer: Literal["adam", "adamw", "adagrad", "sgd"] = "adam"
    """torch optimizer for the dense (MLP) parameters."""
    dense_lr: Annotated[float, AtLeast0] = 1e-3
    """Learning rate of the dense optimizer."""
    task_loss_weights: list[Annotated[float, AtLeast0]] = field(default_factory=list)
    """Weight of each task's BCE loss in the total (multi-task models); empty: 1 for every
    task. The loss is sum_t w_t * BCE_t / sum_t w_t."""
    embedding_optimizer: Literal["adagrad", "rowwise_adagrad", "adam", "sgd"] = "adagrad"
    """Optimizer of the embedding tables (recsys.embedding.optim; rowwise_adagrad keeps one
    state float per row)."""
    embedding_lr: Annotated[float, AtLeast0] = 0.05
    """Learning rate of the embedding optimizer."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate multiplier after warmup, for both optimizers: constant 1, or decaying
    linearly / along a half cosine from 1 to min_lr_ratio at the last step."""
    warmup_steps: Annotated[int, AtLeast0] = 0
    """Steps over which the learning rates ramp up linearly from lr / warmup_steps to lr."""
    min_lr_ratio: Annotated[float, Range(min=0, max=1)] = 0.0
    """Multiplier reached at the last step by the linear and cosine schedules."""
    embedding_stochastic_rounding: bool = True
    """fp16 / bf16 tables: write fused updates back with stochastic rounding (else round to
    nearest, which drops updates smaller than half a unit in the last place)."""
    fused_embedding_update: bool = True
    """Apply the embedding optimizer inside backward, to the touched rows only, building no
    table-sized gradient (on sharded tables too). Off: tables take dense gradients and the
    torch optimizer of the same name (rowwise_adagrad needs the fused update)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Precision of the dense layers: "bf16" / "fp16" run the model's forward under autocast
    (tables keep their own dtype and pool in fp32; the loss is computed in fp32). fp16 adds
    dynamic loss scaling: a step whose gradients overflow is skipped (dense optimizer and
    fused embedding update alike) and halves the scale."""
    compile: bool = False
    """Run the dense part of the model (every submodule that holds no embedding table: MLPs,
    interaction, cross network) under torch.compile; the tables stay eager. The first steps
    pay for compilation; parameter names and checkpoints are unchanged."""
    id_checks: Literal["auto", "sync", "async", "off"] = "auto"
    """How the embedding lookups check each step's ids, offsets and per-sample weights. "sync":
    a bad one raises at once (each lookup waits for the device once). "async": checked on the
    device without waiting; the first bad input raises at the next log event, evaluation or
    checkpoint, naming the step, feature, id and table size, and the bad batch's fused table
    update is withheld. "off": no check (an id past its table reads out of bounds on a GPU).
    "auto": async on CUDA, sync on CPU (where waiting costs nothing). Sharded tables check
    in sync mode (their update runs on other ranks)."""
    cuda_graphs: bool = False
    """Replay the dense part's forward and backward as CUDA graphs: compile it as compile does,
    in torch.compile's mode "reduce-overhead" (CUDA graph trees), so each dense module's
    kernels launch as one graph. Implies compile. The tables, their fused update, and the
    optimizers' step stay eager. Without a CUDA device the dense part is compiled in that mode
    without graphs (torch's fallback) and the run says so at start."""
    log_every_steps: Annotated[int, AtLeast1] = 100
    """Write a train event (loss, samples/s) every this many steps."""
    eval_every_steps: Annotated[int, AtLeast0] = 0
    """Evaluate on the validation split every this many steps (0: only at the end)."""
    early_stopping_patience: Annotated[int, AtLeast0] = 0
    """Stop training after this many validations in a row without improving on the best one
    (by early_stopping_metric); the test evaluation and final checkpoint follow as usual.
    0: never stop early. Needs eval_every_steps > 0."""
    early_stopping_metric: BestMetric = "valid_auc"
    """What early stopping watches: higher valid AUC or lower valid logloss is better; a
    sequence model watches a ranking metric (valid_hr@10, valid_ndcg@10, valid_mrr,
    valid_hr@50, valid_ndcg@50; higher is better)."""
    eval_batch_size: Annotated[int, AtLeast1] = 8192
    """Samples per evaluation batch."""
    progress_bar: bool = True
    """Show a progress bar on rank 0 when the output is a terminal."""
    pipeline: Literal["auto", "on", "off"] = "auto"
    """Pipelined train step: while batch i trains, batch i+1 is on the device and its ids have
    been through the sharded tables' input_dist (TorchRec's TrainPipelineSparseDist); the
    losses are the plain loop's, bitwise. "auto": on under torchrun on CUDA when some table is
    sharded (not data_parallel); off on CPU (no gain measured on 2 gloo ranks) and in one
    process, where it has nothing to run ahead."""
    next_item: NextItemConfig = field(default_factory=NextItemConfig)
    """[train.next_item]: the loss and ranking evaluation of sequence models."""


@dataclass
class DistributedConfig:
    """How tables are sharded over ranks under torchrun (ignored in one process)."""

    constraints: list[str] = field(default_factory=list)
    """Per-table placements that override the planner, "<table>=<type>[@<rank>,...]" with type
    data_parallel, table_wise, row_wise or column_wise; e.g. ["t_cat_2=row_wise",
    "t_cat_9=table_wise@1"]."""
    memory_per_rank_gb: Annotated[float, AtLeast0] = 0.0
    """GiB each rank may use for tables and their optimizer state (0: no limit)."""
    forward_precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    """How pooled embeddings travel between ranks (int8: per-row scale)."""
    backward_precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    """How the gradients of pooled embeddings travel back."""
    print_plan: bool = True
    """Print the sharding plan (rank 0) before training."""
    hardware: Literal["", "h100_8x_ib400", "h200_8x_ib400", "a100_8x_ib200", "cpu_host"] = ""
    """A cluster preset (recsys.distributed.topology: data sheet figures): the planner then
    places tables to minimise the predicted step time on it, in seconds, with the data's bag
    lengths. "" (and no topology file): the planner weighs bytes moved, a communicated byte 10x
    a byte read, one id per bag."""
    topology: str = ""
    """A topology TOML file (what `recsys plan --calibrate` writes, or a preset with figures
    overridden) to plan for, as hardware does; not both."""
    ranks_per_node: Annotated[int, AtLeast0] = 0
    """Ranks per node for hardware / topology: 0 takes LOCAL_WORLD_SIZE under torchrun (the
    preset's or file's elsewhere)."""
    sparse_replicas: Annotated[int, AtLeast1] = 1
    """2D sparse parallelism: R > 1 shards the tables inside each group of world / R
    consecutive ranks (a node, when that is the ranks per node) and replicates the groups, so
    the embedding all-to-alls stay inside a group; replicas average their shards' weights and
    optimizer state every sync_every steps. Must divide the world size; fixed tables only."""
    sync_every: Annotated[int, AtLeast1] = 1
    """2D: steps between two averagings of the replicas (also before every evaluation and
    checkpoint). 1 with SGD trains like the flat plan."""
    cpu_binding: Literal["auto", "off"] = "auto"
    """CPU ranks under torchrun: "auto" binds each local rank (and its collectives' threads)
    to its own block of the cores the job may use (cores // LOCAL_WORLD_SIZE of them, in
    order), when there are at least as many cores as ranks on the node; "off" leaves the
    threads to the OS (do so when several torchrun agents share one host: each splits the
    cores among its own ranks). CUDA ranks and one-process runs are never bound. Losses are
    the same either way (recsys.distributed.cpu_binding; benchmarks/cpu_binding.py measures
    the step)."""


@dataclass
class CheckpointConfig:
    """Checkpoints written under <run dir>/checkpoints."""

    every_steps: Annotated[int, AtLeast0] = 0
    """Also save every this many steps (0: only at the end)."""
    delta_every_steps: Annotated[int, AtLeast0] = 0
    """Every this many steps, at every checkpoint and at the last step, write what changed in
    the dynamic tables since the previous delta (rows trained, keys evicted or expired) to
    <run dir>/deltas/step_<N>/, for serving: a base checkpoint or export plus the deltas after
    it rebuild the current tables (recsys predict --deltas). 0: no deltas."""
    keep: Annotated[int, AtLeast0] = 3
    """Keep the newest this many checkpoints; older ones are deleted (0: keep all)."""
    keep_best: Literal["", BestMetric] = ""
    """Also keep the checkpoint of the best validation by this metric (saved when a validation
    improves on the best: higher AUC, lower logloss; higher ranking metrics of a sequence
    model, e.g. valid_hr@10), linked as checkpoints/best and never
    pruned while it is the best; "" keeps none. Needs train.eval_every_steps > 0."""
    save_final: bool = True
    """Save a checkpoint when training ends."""
    resume: str = ""
    """Continue a run exactly where a checkpoint left it (model, optimizers, LR schedule, step,
    data position, RNG): "latest" (the newest checkpoint of run.dir; a fresh start when there
    is none, so an elastic job's first attempt and its restarts share one command), or a
    checkpoint / run directory. Empty: start fresh."""
    init_from: str = ""
    """Fine-tune: start from a checkpoint's (or run directory's newest) model weights, with
    fresh optimizers, step 0 and this config's learning rates. Ignored when resume finds a
    checkpoint of this run."""
    freeze: list[str] = field(default_factory=list)
    """Modules that do not train: "embeddings" (every table), or module paths of the model such
    as "dense_arch" (DLRM's bottom MLP) or "sparse_arch" (one embedding collection)."""
    new_modules: list[str] = field(default_factory=list)
    """init_from: module or parameter paths the checkpoint does not have and that start from
    their fresh initialization, e.g. ["tower_arch.1"] for a task head added to an MMoE."""
    grow: list[str] = field(default_factory=list)
    """init_from: parameters whose first dimension grew since the checkpoint; its rows are
    loaded and the new rows keep their fresh initialization. "embeddings" covers every table
    (row counts grown with new ids); else paths such as "moe_arch.gates" (a task added to an
    MMoE appends its gate rows)."""
    strict: bool = True
    """init_from: every model parameter must come from the checkpoint with the same shape, bar
    new_modules and grow; anything else is an error listing the differences. false: load
    what matches, keep the rest freshly initialized, and print what was skipped."""


@dataclass
class Config:
    """A whole run. Each component receives only its own section."""

    run: RunConfig = field(default_factory=RunConfig)
    """[run]"""
    data: DataConfig = field(default_factory=DataConfig)
    """[data]"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """[model]"""
    train: TrainConfig = field(default_factory=TrainConfig)
    """[train]"""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """[distributed]"""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """[checkpoint]"""
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    """[preprocess] (read by ``recsys preprocess`` only)"""
