"""``[distributed]`` -> a sharded model: :func:`~recsys.distributed.parallel.parallelize` with a
run's options, for the trainer and ``recsys eval`` alike; and what ``recsys plan`` needs to plan
a config for any number of ranks without a process group (:func:`plan_inputs`)."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torchrec import EmbeddingBagConfig

from recsys.config import Config
from recsys.distributed.id_profiles import IdProfile
from recsys.distributed.op_trace import OpTrace, trace_ops
from recsys.distributed.parallel import (
    dynamic_rows,
    parallelize,
    shardable_collections,
    tiered_rows,
)
from recsys.distributed.plan import ShardingPlan
from recsys.distributed.planner import parse_constraints, plan_sharding
from recsys.distributed.step_cost import StepInputs, dense_bytes
from recsys.distributed.topology import Topology, topology
from recsys.embedding.interface import embedding_collections

__all__ = [
    "PlanInputs",
    "id_profiles",
    "parallelize_from_config",
    "plan_inputs",
    "planner_options",
    "pooling_factors",
    "run_topology",
    "step_inputs",
]

_COMM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
# fp32 values a dense optimizer keeps per parameter.
_DENSE_STATES = {"adam": 2, "adamw": 2, "adagrad": 1, "sgd": 0}


def planner_options(
    config: Config, ranks_per_node: int = 0, pooling: dict[str, float] | None = None
) -> dict[str, Any]:
    """:func:`~recsys.distributed.planner.plan_sharding`'s options from the run's
    ``[distributed]`` section and ``train.batch_size`` (what the trainer plans with); with
    ``distributed.hardware`` or ``topology``, the cluster (``distributed.ranks_per_node``, else
    ``ranks_per_node``, else the preset's) and the data's pooling factors (``pooling``, else
    :func:`pooling_factors`)."""
    cfg = config.distributed
    options: dict[str, Any] = {
        "memory_per_rank": int(cfg.memory_per_rank_gb * 2**30),
        "batch_size": config.train.batch_size,
        "constraints": parse_constraints(cfg.constraints),
        "forward_comm_bytes": _COMM_BYTES[cfg.forward_precision],
        "backward_comm_bytes": _COMM_BYTES[cfg.backward_precision],
    }
    cluster = run_topology(config, ranks_per_node)
    if cluster is not None:
        options["topology"] = cluster
        options["pooling_factors"] = pooling if pooling is not None else pooling_factors(config)[0]
    return options


def run_topology(config: Config, ranks_per_node: int = 0) -> Topology | None:
    """The cluster ``[distributed]`` names (``hardware`` or ``topology``), None for neither."""
    cfg = config.distributed
    if not (cfg.hardware or cfg.topology):
        return None
    return topology(cfg.hardware, cfg.topology, cfg.ranks_per_node or ranks_per_node)


def parallelize_from_config(model: nn.Module, config: Config, device: torch.device) -> nn.Module:
    """:func:`~recsys.distributed.parallel.parallelize` with the run's ``[distributed]`` options
    (placement constraints, memory per rank, communication precisions), ``train.batch_size``
    and ``run.seed``; the model unchanged in a world of one."""
    cfg = config.distributed
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return parallelize(
        model,
        device,
        seed=config.run.seed,
        forward_precision=cfg.forward_precision,
        backward_precision=cfg.backward_precision,
        sparse_replicas=cfg.sparse_replicas,
        **planner_options(config, local),
    )


@dataclass(frozen=True)
class PlanInputs:
    """A config's tables and what its steps move, for planning without ranks.

    Attributes:
        configs: module path -> the collection's table configs.
        optimizer_states: the fused embedding optimizer's state kinds.
        dynamic_rows / tiered_rows: as :func:`~recsys.distributed.planner.plan_sharding` takes.
        pooling_factors: feature -> mean ids per bag (see :func:`plan_inputs`).
        dense_parameters: parameters outside the tables (trained under DDP).
        dense_state_values: fp32 values the dense optimizer keeps per parameter.
        pooling_source: where ``pooling_factors`` come from, in words.
        id_profiles: table name -> how often each row is read (:func:`id_profiles`).
        profile_source: where ``id_profiles`` come from, in words.
        fused_update: ``train.fused_embedding_update``.
        dense_trace: the ops of a step's dense part at ``train.batch_size`` (forward, loss,
            backward, dense optimizer; :func:`dense_step_trace`), or None where tracing it
            failed (``trace_source`` says why): the cost model then charges 6 flops per dense
            parameter per sample.
        trace_source: how the dense part is costed, in words.
        input_s: seconds this host takes to make one train batch for a rank, its loader
            workers sharing it out (0: not measured; :func:`input_seconds`).
        input_inline: the trainer makes its batches inside the step (no loader workers, no
            prefetching): their time adds to the step's.
        input_source: how ``input_s`` was measured, in words.
    """

    configs: dict[str, list[EmbeddingBagConfig]]
    optimizer_states: dict[str, str]
    dynamic_rows: dict[str, int]
    tiered_rows: dict[str, int]
    pooling_factors: dict[str, float]
    dense_parameters: int
    dense_state_values: int
    pooling_source: str
    id_profiles: dict[str, IdProfile] = field(default_factory=dict)
    profile_source: str = "uniform"
    fused_update: bool = True
    dense_trace: OpTrace | None = None
    trace_source: str = "6 flops per dense parameter per sample"
    input_s: float = 0.0
    input_inline: bool = True
    input_source: str = "not measured"

    @property
    def dense_bytes(self) -> int:
        return dense_bytes(self.dense_parameters, self.dense_state_values)

    def options(self, config: Config, cluster: Topology) -> tuple[dict[str, Any], bool]:
        """:func:`planner_options` of ``config`` for ``cluster`` (its ranks per node; these
        pooling factors), with ``memory_per_rank`` the device's memory less the dense part
        when the config sets none; and whether it was so set."""
        options = planner_options(config, cluster.ranks_per_node, self.pooling_factors)
        from_device = not options["memory_per_rank"]
        if from_device:
            device = int(cluster.memory_gib * 2**30)
            options["memory_per_rank"] = max(device - self.dense_bytes, 1)
        return options, from_device

    def plan(self, world_size: int, options: dict[str, Any]) -> ShardingPlan:
        """:func:`~recsys.distributed.planner.plan_sharding` of these tables on ``world_size``
        ranks with ``options`` (:func:`planner_options`), as the trainer plans them."""
        return plan_sharding(
            self.configs,
            world_size,
            optimizer_states=self.optimizer_states,
            dynamic_rows=self.dynamic_rows,
            tiered_rows=self.tiered_rows,
            **options,
        )


def step_inputs(
    config: Config, inputs: PlanInputs, *, pipeline: bool, replicas: int = 1, sync_every: int = 1
) -> StepInputs:
    """What a step of ``config`` moves, for :func:`~recsys.distributed.step_cost.predict_step`
    (``extras``: the input check's verdict, sent when ids are checked: always under torchrun,
    where sharded tables check in sync mode unless ``train.id_checks = "off"``)."""
    cfg = config.distributed
    return StepInputs(
        config.train.batch_size,
        inputs.pooling_factors,
        inputs.optimizer_states,
        cfg.forward_precision,
        cfg.backward_precision,
        inputs.dense_parameters,
        inputs.dense_state_values,
        pipeline=pipeline,
        replicas=replicas,
        sync_every=sync_every,
        extras=int(config.train.id_checks != "off"),
        dense_precision=config.train.precision,
        id_profiles=inputs.id_profiles,
        fused_update=inputs.fused_update,
        dense_trace=inputs.dense_trace,
        input_s=inputs.input_s,
        input_inline=inputs.input_inline,
    )


def plan_inputs(
    config: Config, time_input: bool = False, ranks_per_node: int = 1, cuda: bool | None = None
) -> PlanInputs:
    """The model of ``config`` built with its tables on ``meta`` (nothing table-sized is
    allocated), as the trainer builds it: its tables, the state its fused embedding optimizer
    keeps and the dense parameters. Pooling factors: the synthetic data's expected
    bag lengths (``bag_sizes``: m ids per bag when fixed, m / 2 when uniform), else the mean
    bag lengths of the first chunk of the train split.

    With ``time_input``, the train loader is timed on this host (:func:`input_seconds`), for
    ranks ``ranks_per_node`` to a node training on CUDA or not (``cuda``, None: as this host
    would; :func:`batch_makers`: who makes the batches).

    Raises:
        ValueError: a model of user histories (``recsys plan`` plans click models), or what
            building the model or opening the data raises.
    """
    from recsys.build.models import build_model, fused_embedding_optimizer
    from recsys.config import SEQUENCE_MODELS, TARGET_RANKING_MODELS
    from recsys.data import build_dataset

    if config.model.name in SEQUENCE_MODELS + TARGET_RANKING_MODELS:
        raise ValueError(
            f"model.name = {config.model.name!r}: recsys plan plans click models (a model of "
            "user histories has one item table, placed by the same planner when it trains)"
        )
    dataset = build_dataset(config.data, config.run.seed)
    optimizer = fused_embedding_optimizer(config.train)  # what the trainer fuses (or None)
    model = build_model(
        config.model,
        dataset.spec,
        torch.device("cpu"),
        seed=config.run.seed,
        embedding_optimizer=optimizer,
        table_device=torch.device("meta"),
    )
    collections = shardable_collections(model)
    configs = {path: list(c.embedding_bag_configs()) for path, c in collections.items()}
    states = dict(optimizer.states) if optimizer is not None else {}
    tables = {id(p) for c in embedding_collections(model).values() for p in c.parameters()}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in tables)
    first_chunk = functools.cache(lambda: dataset.chunk("train", 0))  # read once, if at all
    pooling, source = pooling_factors(config, first_chunk)
    profiles, profile_source = id_profiles(config, configs, first_chunk)
    dynamic, tiered = dynamic_rows(collections), tiered_rows(collections)
    trace, trace_source = dense_step_trace(config, model, first_chunk)  # moves it to meta
    workers, prefetched = batch_makers(config, ranks_per_node, cuda)
    inline = not (workers or prefetched)
    timed = (0.0, "not measured")
    if time_input:
        input_s, how = input_seconds(config, dataset, workers)
        where = "inside the step" if inline else "beside the step (workers or prefetching)"
        timed = (input_s, f"{how}, made {where}")
    return PlanInputs(
        configs,
        states,
        dynamic,
        tiered,
        pooling,
        dense,
        _DENSE_STATES[config.train.dense_optimizer],
        source,
        profiles,
        profile_source,
        optimizer is not None,
        trace,
        trace_source,
        input_s=timed[0],
        input_inline=inline,
        input_source=timed[1],
    )


def batch_makers(config: Config, ranks_per_node: int, cuda: bool | None = None) -> tuple[int, bool]:
    """How the trainer makes its train batches: its loader worker processes
    (``data.loader_workers``, -1: half the CPUs each of ``ranks_per_node`` ranks of this host
    has, none under 2) and whether batches are prefetched (``data.prefetch_batches``, -1: 4 on
    CUDA, none on CPU; ``run.device = "auto"`` trains on CUDA where ``cuda`` says, None: where
    this host has it). No workers and no prefetching: inside the step."""
    from recsys.data.loader import default_prefetch, default_workers

    data = config.data
    workers = data.loader_workers if data.loader_workers >= 0 else default_workers(ranks_per_node)
    name = config.run.device
    if name != "auto":
        cuda = name.startswith("cuda")
    elif cuda is None:
        cuda = torch.cuda.is_available()
    return workers, default_prefetch(data.prefetch_batches, cuda) > 0


def input_seconds(
    config: Config, dataset: Any, workers: int, seconds: float = 0.5
) -> tuple[float, str]:
    """The mean seconds this host takes to make one train batch of ``train.batch_size`` rows
    as one rank's loader makes them in one process (shuffled as the config says, one chunk to a
    shuffle buffer, whatever ``data.shuffle_buffer_chunks``: a buffer's work per batch is the
    same, and planning reads no more than a chunk ahead), over the batches after the first for
    about ``seconds`` and at least a whole chunk of the data (its reading or generating shared
    out over its batches), ten times that at most; divided among ``workers`` loader processes,
    when there are any; and how, in words."""
    from recsys.data.loader import BatchLoader

    batch_size = config.train.batch_size
    loader = BatchLoader(
        dataset,
        "train",
        batch_size,
        shuffle=config.data.shuffle,
        seed=config.run.seed,
        drop_last=True,
    )
    chunk_batches = max(1, dataset.chunk_rows("train", 0) // batch_size)
    batches = iter(loader)
    next(batches, None)  # the first opens the data
    count, start = 0, time.perf_counter()
    for _ in batches:
        count += 1
        elapsed = time.perf_counter() - start
        if (count >= chunk_batches and elapsed >= seconds) or elapsed >= 10 * seconds:
            break
    if not count:
        return 0.0, "not measured (the train split holds one batch or none)"
    alone = (time.perf_counter() - start) / count
    shared = f", shared by {workers} loader workers" if workers else ""
    return alone / max(workers, 1), (
        f"{1e3 * alone:,.2f} ms a batch of {batch_size:,} on this host (the train loader in one "
        f"process, {count} batch{'es' * (count > 1)}){shared}"
    )


def dense_step_trace(
    config: Config, model: nn.Module, first_chunk: Callable[[], Any]
) -> tuple[OpTrace | None, str]:
    """The ops of one training step's dense part
    (:func:`~recsys.distributed.op_trace.trace_ops`): ``model`` moved to ``meta`` (its tables
    are there already), a batch of ``train.batch_size`` rows of the train split's first chunk
    (``first_chunk()``, its rows repeated if it has fewer), the forward, the loss, the backward
    and the dense optimizer's step (a second step: the first creates the optimizer's state),
    less the embedding collections, in fp32 whatever ``train.precision`` (the cost model charges
    the precision's rate, not its smaller tensors); and how the dense part is costed, in words.
    A model whose step cannot run on ``meta`` gives None (the cost model then charges 6 flops
    per dense parameter per sample) and the reason."""
    from recsys.build.models import dense_optimizer, dense_parameters

    meta = torch.device("meta")
    batch_size = config.train.batch_size
    try:
        model = model.to(meta)
        chunk = first_chunk()
        batch = chunk.take(torch.arange(batch_size) % chunk.batch_size).to(meta)
        collections = list(embedding_collections(model).values())
        parameters = dense_parameters(model)  # after the move: the dense ones are new
        dense = dense_optimizer(config.train, parameters) if parameters else None

        def step() -> None:  # TrainStep's order, in fp32, one BCE loss over every task
            logits = model(batch.dense, batch.sparse)
            model.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(logits.float(), batch.labels).backward()
            if dense is not None:
                dense.step()

        trace_ops(step, skip=collections)  # the optimizer's first step creates its state
        trace = trace_ops(step, skip=collections, batch_size=batch_size)
    except Exception as error:  # any failure falls back to the parameter count
        return None, f"6 flops per dense parameter per sample (no meta trace: {error})"
    flops, moved = trace.flops.sum() / batch_size, trace.bytes.sum() / batch_size
    return trace, (
        f"traced on meta: {trace.ops} ops a step, {flops / 1e6:.3g} MFLOP and "
        f"{moved / 1e3:,.0f} KB read and written a sample"
    )


def id_profiles(
    config: Config,
    configs: dict[str, list[EmbeddingBagConfig]],
    first_chunk: Callable[[], Any] | None = None,
) -> tuple[dict[str, IdProfile], str]:
    """Table name -> how often each of its rows is read, for the distinct rows a batch
    touches (:mod:`recsys.distributed.id_profiles`), and where that comes from: the synthetic
    log's power law (``zipf_alpha``) for its tables of one feature, else the id frequencies
    of the first chunk of the train split (``first_chunk()``, else read from the data
    ``[data]`` opens)."""
    from recsys.data import resolve_source

    tables = [table for group in configs.values() for table in group]
    synthetic = config.data.synthetic
    if (
        resolve_source(config.data) == "synthetic"
        and synthetic.drift_days == 0
        and synthetic.id_encoding == "index"
    ):
        cardinality = {f"cat_{i}": n for i, n in enumerate(synthetic.cardinalities)}
        profiles = {
            t.name: IdProfile.zipf(t.num_embeddings, synthetic.zipf_alpha)
            for t in tables
            if len(t.feature_names) == 1 and cardinality.get(t.feature_names[0]) == t.num_embeddings
        }
        return profiles, f"the synthetic log's power law, zipf_alpha {synthetic.zipf_alpha:g}"
    batch = first_chunk() if first_chunk is not None else _first_chunk(config)
    ids = dict(
        zip(
            batch.sparse.keys(),
            batch.sparse.values().split(batch.sparse.length_per_key()),
            strict=True,
        )
    )
    profiles = {
        t.name: IdProfile.from_ids(np.concatenate([ids[f].numpy() for f in t.feature_names]))
        for t in tables
        if all(f in ids for f in t.feature_names)
    }
    return profiles, f"id frequencies of the first train chunk ({batch.batch_size} rows)"


def pooling_factors(
    config: Config, first_chunk: Callable[[], Any] | None = None
) -> tuple[dict[str, float], str]:
    """Feature -> mean ids per bag, and where that comes from: the synthetic log's expected bag
    lengths (``bag_sizes``: m when fixed, m / 2 when uniform over 0..m), else the mean bag
    lengths of the first chunk of the train split (``first_chunk()``, else read from the data
    ``[data]`` opens)."""
    from recsys.data import resolve_source

    if resolve_source(config.data) == "synthetic":
        synthetic = config.data.synthetic
        sizes = list(synthetic.bag_sizes) or [1] * len(synthetic.cardinalities)
        fixed = synthetic.bag_lengths == "fixed"
        pooling = {f"cat_{i}": float(m if m == 1 or fixed else m / 2) for i, m in enumerate(sizes)}
        how = "fixed" if fixed else "drawn from 0..m: m / 2 each"
        return pooling, f"from the synthetic log's bag sizes, {how}"
    batch = first_chunk() if first_chunk is not None else _first_chunk(config)
    rows = max(batch.batch_size, 1)
    lengths = batch.sparse.length_per_key()
    pooling = {key: n / rows for key, n in zip(batch.sparse.keys(), lengths, strict=True)}
    return pooling, f"mean bag lengths of the first train chunk ({rows} rows)"


def _first_chunk(config: Config) -> Any:
    """The first chunk of the train split of the data ``[data]`` opens."""
    from recsys.data import build_dataset

    return build_dataset(config.data, config.run.seed).chunk("train", 0)
