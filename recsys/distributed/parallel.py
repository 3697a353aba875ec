"""Process groups and ``parallelize``: how a model runs on several ranks under torchrun.

``parallelize`` swaps each EmbeddingBagCollection for its model-parallel twin
(:class:`~recsys.distributed.sharded.ShardedEmbeddingBagCollection`; an unpooled
EmbeddingCollection for :class:`~recsys.distributed.sharded_sequence.ShardedEmbeddingCollection`),
tables placed by a :class:`~recsys.distributed.planner.ShardingPlan`, and wraps the dense rest
in DistributedDataParallel.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsys.distributed.cpu_binding import bind_local_rank
from recsys.distributed.plan import ShardingPlan, check_plan
from recsys.distributed.planner import plan_sharding
from recsys.distributed.replicas import replica_groups
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.distributed.sharded_sequence import ShardedEmbeddingCollection
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic.mixin import DynamicTables
from recsys.embedding.dynamic.table import UNCAPPED
from recsys.embedding.interface import (
    EmbeddingCollectionInterface,
    embedding_collections,
    state_prefix,
)
from recsys.embedding.tiered.mixin import TieredTables
from recsys.embedding.unpooled import EmbeddingCollection
from recsys.embedding.unpooled_tables import DynamicEmbeddingCollection, TieredEmbeddingCollection


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits: ``rank`` of ``world_size``, ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    cores: tuple[int, ...] = ()  # the CPU cores this rank is bound to (distributed.cpu_binding)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device, cpu_binding: str = "off") -> DistributedInfo:
    """Join the torchrun job described by the environment (WORLD_SIZE, RANK, LOCAL_RANK);
    NCCL on CUDA, gloo on CPU. A plain ``python`` launch is a world of one. ``cpu_binding``
    (``distributed.cpu_binding``): ``auto`` binds a CPU rank to its own cores first
    (:func:`~recsys.distributed.cpu_binding.bind_local_rank`), so the transport's threads
    start there."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistributedInfo()
    cores = bind_local_rank(cpu_binding, device) if not dist.is_initialized() else []
    info = DistributedInfo(
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        cores=tuple(cores),
    )
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=_attempt_store(world_size),
            rank=info.rank,
            world_size=world_size,
        )
    return info


def _attempt_store(world_size: int) -> dist.Store | None:
    """Under torchrun, the store its agent hosts, with keys scoped to this attempt; None (the
    env:// default) elsewhere. The agent keeps one store for every attempt of an elastic job
    (--max-restarts): without the scope, the ranks of a restarted attempt can read the addresses
    the ranks of the killed one published there, and fail to connect. The scope is the
    agent's restart count, which every agent of a one-node job shares; across nodes an agent
    that joined late counts differently, and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in
    torchrun's environment (a fresh store per attempt) is the safer setting."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False
    )
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def check_device_name(name: str) -> str | None:
    """What is wrong with ``run.device = name`` (None: :func:`resolve_device` takes it): one of
    ``auto``, ``cpu``, ``cuda``, ``cuda:N``. Whether CUDA is there is checked at run time."""
    if name == "auto":
        return None
    try:
        device_type = torch.device(name).type
    except RuntimeError:
        device_type = None
    if device_type not in ("cpu", "cuda"):
        return "must be 'auto', 'cpu', 'cuda' or 'cuda:N'"
    return None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> this rank's GPU when CUDA is available, else CPU; otherwise ``name``."""
    if (problem := check_device_name(name)) is not None:
        raise ValueError(f"run.device = {name!r} {problem}")
    if name == "auto":
        name = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"run.device = {name!r} but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def parallelize(
    model: nn.Module,
    device: torch.device,
    plan: ShardingPlan | None = None,
    *,
    forward_precision: str = "fp32",
    backward_precision: str = "fp32",
    seed: int | None = None,
    sparse_replicas: int = 1,
    **planner_options: Any,
) -> nn.Module:
    """Make ``model`` train across the ranks of the initialized process group.

    Every EmbeddingBagCollection becomes a :class:`ShardedEmbeddingBagCollection` (an
    EmbeddingCollection a :class:`ShardedEmbeddingCollection`) placed by
    ``plan`` (default: :func:`plan_sharding` over all the model's collections, given
    ``planner_options`` such as ``memory_per_rank``, ``batch_size``, ``constraints``), and the
    dense parameters (plus DATA_PARALLEL tables trained by a torch optimizer) are wrapped in
    DistributedDataParallel. Set a fused optimizer on the collections before calling this: the
    shards take it, and its state, with them.

    Args:
        model: the single-process model, on ``device`` (its tables may be on ``meta``).
        device: this rank's device.
        plan: where each table goes; see :mod:`recsys.distributed.planner`.
        forward_precision / backward_precision: quantized communication of pooled embeddings
            and of their gradients (``fp32``, ``fp16``, ``bf16``, ``int8``).
        seed: the run's seed: sharded fixed tables on ``meta`` start each shard from their
            initial rows of (seed, table, row), the same on any number of ranks (default: a
            dynamic or tiered collection's own seed, else 0).
        sparse_replicas: R > 1: 2D sparse parallelism (:mod:`recsys.distributed.replicas`):
            ``plan`` is for W / R ranks, each group of W / R consecutive ranks shards the
            tables, the R groups are replicas (:func:`~recsys.distributed.replicas.sync_replicas`
            averages them). Fixed tables only.

    Returns:
        The model unchanged in a world of one, else the DDP-wrapped model.

    Example (every rank of ``torchrun --nproc-per-node=2 train.py``)::

        model = DLRM(...)                        # holds an EmbeddingBagCollection
        model = parallelize(model, device)      # planned, sharded, DDP-wrapped
        print(model.module.sharding_plan.describe())
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    collections = shardable_collections(model)
    configs = {path: ebc.embedding_bag_configs() for path, ebc in collections.items()}
    groups = None
    if sparse_replicas != 1:
        if dynamic_rows(collections) or tiered_rows(collections):
            raise ValueError(
                f"distributed.sparse_replicas = {sparse_replicas}: 2D sparse parallelism shards "
                "fixed tables; dynamic and tiered tables shard flat (sparse_replicas = 1)"
            )
        groups = replica_groups(sparse_replicas)
    world = dist.get_world_size() // sparse_replicas  # the ranks a plan spans
    if plan is None:
        states = next((dict(c.optimizer.states) for c in collections.values() if c.optimizer), None)
        planner_options.setdefault("dynamic_rows", dynamic_rows(collections))
        planner_options.setdefault("tiered_rows", tiered_rows(collections))
        plan = plan_sharding(configs, world, optimizer_states=states, **planner_options)
    check_plan(plan, configs, world)
    # Embedding collectives get their own group, so they never interleave with DDP's.
    group = groups.shard_group if groups else dist.new_group(backend=dist.get_backend())
    ignored: list[str] = []
    for path, ebc in collections.items():
        kind = (
            ShardedEmbeddingCollection
            if isinstance(ebc, EmbeddingCollection)
            else ShardedEmbeddingBagCollection
        )
        sharded = kind(
            ebc,
            plan[path],
            process_group=group,
            forward_precision=forward_precision,
            backward_precision=backward_precision,
            device=device,
            seed=seed,
        )
        sharded.replica_groups = groups
        _replace(model, path, sharded)
        ignored += _ignored_by_ddp(sharded, state_prefix(path))
    model.sharding_plan = plan
    if isinstance(model, ShardedEmbeddingBagCollection) or not any(
        p.requires_grad for p in model.parameters()
    ):
        return model
    return _data_parallel(model, device, ignored)


def _data_parallel(model: nn.Module, device: torch.device, ignored: list[str]) -> nn.Module:
    """``model`` under DDP, which leaves the ``ignored`` parameters and buffers alone."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    device_ids = [device.index] if device.type == "cuda" else None
    # Model buffers are constants (index tables): nothing to broadcast per forward.
    no_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    ddp = DistributedDataParallel(model, device_ids=device_ids, **no_sync)
    # DDP rebuilds its gradient buckets after the first backward, in the order the gradients
    # became ready; a resumed run's first step would then all-reduce in the first-iteration
    # layout where the uninterrupted run uses the rebuilt one, and on 3+ ranks a ring's float
    # sums depend on where an element sits. A dense part that fits DDP's first bucket keeps
    # that one layout for good (nothing to overlap is lost): resume is bitwise on any number of
    # ranks. A larger one keeps DDP's rebuild, for the all-reduce / backward overlap.
    ignored_names = set(ignored)
    dense = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if p.requires_grad and name not in ignored_names
    )
    if dense <= dist._DEFAULT_FIRST_BUCKET_BYTES:
        ddp.reducer._push_all_rebuilt_params()
    return ddp


def shardable_collections(
    model: nn.Module,
) -> dict[str, EmbeddingBagCollection | EmbeddingCollection]:
    """The model's collections, each of a kind parallelize() can shard (an unpooled one plain,
    dynamic or tiered)."""
    collections = embedding_collections(model)
    unpooled = (EmbeddingCollection, DynamicEmbeddingCollection, TieredEmbeddingCollection)
    for path, collection in collections.items():
        if not (isinstance(collection, EmbeddingBagCollection) or type(collection) in unpooled):
            raise ValueError(
                f"parallelize(): the collection at '{path}' is a {type(collection).__name__}; "
                "only an (unsharded) EmbeddingBagCollection or EmbeddingCollection can be "
                "sharded"
            )
    return collections


def dynamic_rows(collections: dict[str, EmbeddingBagCollection]) -> dict[str, int]:
    """``"<path>:<table>"`` (or the table's name for a bare collection) -> the most rows each
    dynamic table may hold (0: no cap), for :func:`plan_sharding`'s ``dynamic_rows``."""
    out = {}
    for path, collection in collections.items():
        if isinstance(collection, DynamicTables):
            for name, table in collection.dynamic.items():
                cap = table.map.max_capacity
                out[f"{path}:{name}" if path else name] = 0 if cap >= UNCAPPED else cap
        if isinstance(collection, TieredTables):  # a tiered one keeps every key
            out.update(
                {f"{path}:{name}" if path else name: 0 for name in collection.dynamic_options}
            )
    return out


def tiered_rows(collections: dict[str, EmbeddingBagCollection]) -> dict[str, int]:
    """``"<path>:<table>"`` (or the table's name for a bare collection) -> the cache rows of
    each tiered table's shards, for :func:`plan_sharding`'s ``tiered_rows``."""
    out = {}
    for path, collection in collections.items():
        if isinstance(collection, TieredTables):
            for name in collection.tiered_tables():
                rows = collection.table_modules[name].weight.shape[0] - 1  # the spare row
                out[f"{path}:{name}" if path else name] = rows
    return out


def _ignored_by_ddp(collection: EmbeddingCollectionInterface, prefix: str) -> list[str]:
    """Names of the collection's parameters and buffers DDP must leave alone: all but its
    :meth:`~EmbeddingCollectionInterface.ddp_parameters`."""
    trained_by_ddp = {id(p) for p in collection.ddp_parameters()}
    names = [prefix + n for n, p in collection.named_parameters() if id(p) not in trained_by_ddp]
    return names + [prefix + name for name, _ in collection.named_buffers()]


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    if not path:
        raise ValueError(
            "parallelize() needs a model that holds its EmbeddingBagCollection; to shard a bare "
            "collection build ShardedEmbeddingBagCollection(ebc, plan[''], device=...)"
        )
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, module)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
