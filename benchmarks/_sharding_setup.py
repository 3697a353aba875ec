"""What every process of ``benchmarks/sharding.py`` builds the same way: the run's :class:`Setup`,
the tables, the global batches and upstream gradient, the unsharded collection every provider
starts from, recsys's sharding plans (by hand, or by ``plan_sharding``), and the timed
:class:`Provider` with its training step and checks.

Shapes: B samples per rank, W ranks, F features (one table each), D the embedding dim, L_f the
ids of feature f in a global batch.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._harness import REPO_ROOT, zipf_ids
from recsys import EmbeddingBagConfig, KeyedJaggedTensor  # recsys quiets torchrec's import
from recsys.distributed.comm import CommStats
from recsys.distributed.plan import (
    ShardingType,
    TableSharding,
    column_wise,
    data_parallel,
    row_wise,
    table_wise,
)
from recsys.distributed.planner import plan_sharding
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import Adagrad

RECIPE = REPO_ROOT / "configs" / "dlrm_synthetic.toml"
RECSYS, TORCHREC, SINGLE = "recsys_sharded", "torchrec_dmp", "single_process"
KEY_WISE = "key_wise"  # the dynamic tables' case (see _sharding_dynamic.py)
SHARDINGS = ("data_parallel", "table_wise", "row_wise", "column_wise", "planner", KEY_WISE)
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
COMM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}  # per value, for plan_sharding
LR, EPS = 0.05, 1e-10
NUM_BATCHES = 4
# Largest forward difference from the unsharded collection before training, relative to the
# sample's largest |pooled| value (int8: per-row codecs, recsys' symmetric, TorchRec's with a
# bias).
CHECK_TOLERANCE = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3, "int8": 1e-2}

Batch = list[tuple[torch.Tensor, torch.Tensor]]  # per feature: bag lengths [W*B], ids [L_f]


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything the ranks need to rebuild the same tables, batches and cases."""

    cardinalities: tuple[int, ...]
    bag_sizes: tuple[int, ...]
    dim: int
    batch_size: int  # per rank
    world_size: int
    backend: str
    device_type: str
    shardings: tuple[str, ...]
    precisions: tuple[str, ...]
    torchrec: bool
    warmup: int
    steps: int
    seed: int

    @property
    def threads_per_rank(self) -> int:
        return max(1, (os.cpu_count() or 1) // self.world_size)

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    def config(self, sharding: str, dynamic: bool = False) -> str:
        """The CSV ``config`` column of a sharded provider (``sharding="none"``: one process);
        ``dynamic`` (implied by ``key_wise``): the tables are dynamic, keyed by raw keys."""
        bags = [str(m) if m == 1 else f"0..{m}" for m in self.bag_sizes]
        bags = [f"{bag}x{len(list(group))}" for bag, group in itertools.groupby(bags)]
        ids = "zipf1"
        if dynamic or sharding == KEY_WISE:
            ids = "zipf1 as raw int64 keys, dynamic tables"
        if sharding == "none":
            where = f"batch={self.global_batch} processes=1"
        else:
            where = (
                f"batch={self.batch_size}/rank world={self.world_size} backend={self.backend} "
                f"threads/rank={self.threads_per_rank}"
            )
        return (
            f"sharding={sharding} tables={len(self.cardinalities)} "
            f"rows={min(self.cardinalities)}..{max(self.cardinalities)} "
            f"(total {sum(self.cardinalities)}) dim={self.dim} pooling=sum "
            f"bags={','.join(bags)} ids={ids} {where} optim=adagrad(lr={LR})"
        )


def table_configs(setup: Setup) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=setup.dim, num_embeddings=rows, feature_names=[f"f{i}"]
        )
        for i, rows in enumerate(setup.cardinalities)
    ]


def make_batch(setup: Setup, generator: torch.Generator) -> Batch:
    """One global batch of W x B samples."""
    n = setup.global_batch
    features = []
    for rows, m in zip(setup.cardinalities, setup.bag_sizes, strict=True):
        if m == 1:
            lengths = torch.ones(n, dtype=torch.int64)
        else:
            lengths = torch.randint(0, m + 1, (n,), generator=generator)
        features.append((lengths, zipf_ids(int(lengths.sum()), rows, generator)))
    return features


def kjt_rows(batch: Batch, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples [start, stop) of a global batch, features f0, f1, ..."""
    lengths, values = [], []
    for feature_lengths, ids in batch:
        first = int(feature_lengths[:start].sum())
        last = first + int(feature_lengths[start:stop].sum())
        lengths.append(feature_lengths[start:stop])
        values.append(ids[first:last])
    return KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(len(batch))],
        values=torch.cat(values),
        lengths=torch.cat(lengths),
    )


def inputs(setup: Setup) -> tuple[list[Batch], torch.Tensor]:
    """The global batches and the [W*B, F*D] upstream gradient, the same in every process."""
    generator = torch.Generator().manual_seed(setup.seed)
    batches = [make_batch(setup, generator) for _ in range(NUM_BATCHES)]
    width = len(setup.cardinalities) * setup.dim
    upstream = torch.randn(setup.global_batch, width, generator=generator)
    return batches, upstream


def unsharded_collection(setup: Setup) -> EmbeddingBagCollection:
    """The tables every provider starts from, identical in every process (seeded init)."""
    torch.manual_seed(setup.seed)
    return EmbeddingBagCollection(table_configs(setup), optimizer=Adagrad(lr=LR, eps=EPS))


# ---------------------------------------------------------------------------------------------
# recsys's plans


def hand_plan(
    sharding: str, tables: list[EmbeddingBagConfig], world: int
) -> dict[str, TableSharding]:
    """Every table sharded the same way (table-wise: table t on rank t mod W)."""
    ranks = list(range(world))
    make = {
        "data_parallel": lambda i, rows, dim: data_parallel(rows, dim, world),
        "table_wise": lambda i, rows, dim: table_wise(rows, dim, i % world),
        "row_wise": lambda i, rows, dim: row_wise(rows, dim, world),
        "column_wise": lambda i, rows, dim: column_wise(rows, dim, ranks),
    }[sharding]
    return {t.name: make(i, t.num_embeddings, t.embedding_dim) for i, t in enumerate(tables)}


def count_kinds(kinds: list[str]) -> str:
    """``DATA_PARALLEL x20, TABLE_WISE x6``."""
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(collections.Counter(kinds).items()))


def recsys_plan(
    setup: Setup,
    sharding: str,
    precision: str,
    tables: list[EmbeddingBagConfig],
    batches: list[Batch],
) -> tuple[dict[str, TableSharding], str]:
    """The hand plan of ``sharding``, or plan_sharding's choice; and a note."""
    if sharding == "data_parallel":
        note = "replicated: no pooled vectors travel, so fp32 only"
        return hand_plan(sharding, tables, setup.world_size), note
    if sharding != "planner":
        return hand_plan(sharding, tables, setup.world_size), ""
    pooling = {
        f"f{i}": torch.cat([batch[i][0] for batch in batches]).float().mean().item()
        for i in range(len(tables))
    }
    plan = plan_sharding(
        {"": tables},
        setup.world_size,
        optimizer_states=Adagrad.states,
        batch_size=setup.batch_size,
        pooling_factors=pooling,
        forward_comm_bytes=COMM_BYTES[precision],
        backward_comm_bytes=COMM_BYTES[precision],
    )
    kinds = [ShardingType(s.sharding_type).name for s in plan[""].values()]
    return plan[""], f"plan_sharding: {count_kinds(kinds)}"


# ---------------------------------------------------------------------------------------------
# The timed thing on a rank, its step and its checks


def make_step(
    forward: Callable[[KeyedJaggedTensor], torch.Tensor],
    kjts: list[KeyedJaggedTensor],
    upstream: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
) -> Callable[[], None]:
    """Forward on the next batch, backward of sum(pooled * upstream) (the fused update runs in
    it), then ``optimizer``'s step for tables with dense gradients, if any."""
    counter = itertools.count()

    def step() -> None:
        pooled = forward(kjts[next(counter) % len(kjts)])  # [B, F*D]
        (pooled * upstream).sum().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def relative_difference(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |out - expected|, relative to each sample's largest |expected| value."""
    expected = expected.float().cpu()
    scale = expected.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)  # [B, 1]
    return ((out.float().cpu() - expected).abs() / scale).max().item()


def describe_error(error: BaseException) -> str:
    """``Type: message's first line (at file:line function < caller < its caller)``."""
    text = (str(error).strip().splitlines() or [""])[0][:200]
    frames = traceback.extract_tb(error.__traceback__)[-3:]
    where = " < ".join(
        f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames)
    )
    return f"{type(error).__name__}: {text} (at {where})"


@dataclasses.dataclass
class Provider:
    """One timed thing on this rank.

    ``forward`` maps a KJT to [B, F*D] pooled vectors whose column j is column ``columns[j]``
    of the unsharded collection's output (``columns`` None: the same order); ``comm_stats``
    counts its bytes (recsys only). ``initial``: its own output on the check batch before
    training, for a provider whose rows do not start as the unsharded collection's (it is
    checked against that only, and not compared with recsys). ``key_stats``: for dynamic
    tables, a collective returning the key counts of every rank (see ``_sharding_dynamic``);
    ``warm_stats`` is what it returned once warmed up."""

    forward: Callable[[KeyedJaggedTensor], torch.Tensor]
    step: Callable[[], None]
    columns: torch.Tensor | None = None
    comm_stats: CommStats | None = None
    note: str = ""
    initial: torch.Tensor | None = None
    key_stats: Callable[[], dict[str, Any]] | None = None
    warm_stats: dict[str, Any] | None = None

    def ordered(self, unsharded_order: torch.Tensor) -> torch.Tensor:
        """``unsharded_order``'s columns in this provider's order."""
        return unsharded_order if self.columns is None else unsharded_order[:, self.columns]

    def before_training(self, expected: torch.Tensor) -> torch.Tensor:
        """Its output on the check batch before training: ``initial``, or the unsharded
        collection's ``expected`` in its column order."""
        return self.initial if self.initial is not None else self.ordered(expected)


def recsys_provider(
    unsharded,
    plan: dict,
    precision: str,
    kjts: list[KeyedJaggedTensor],
    upstream: torch.Tensor,
    device: torch.device,
    note: str = "",
    key_stats: Callable | None = None,
) -> Provider:
    """``ShardedEmbeddingBagCollection(unsharded, plan)`` sending pooled vectors and their
    gradients in ``precision``, as a Provider with ``note``; ``key_stats(sharded)``, if given,
    becomes the provider's key statistics."""
    sharded = ShardedEmbeddingBagCollection(
        unsharded,
        plan,
        forward_precision=precision,
        backward_precision=precision,
        device=device,
    )
    forward = lambda kjt: sharded(kjt).values()  # noqa: E731
    step = make_step(forward, kjts, upstream)
    provider = Provider(forward, step, comm_stats=sharded.comm_stats, note=note)
    if key_stats is not None:
        provider.key_stats = lambda: key_stats(sharded)
    return provider


def check_forward(
    provider: Provider, kjt: KeyedJaggedTensor, expected: torch.Tensor, precision: str
) -> None:
    """Raise AssertionError unless ``provider``'s forward on ``kjt`` is ``expected`` (the
    unsharded collection's) within the precision's tolerance."""
    with torch.no_grad():
        difference = relative_difference(provider.forward(kjt), provider.ordered(expected))
    if difference > CHECK_TOLERANCE[precision]:
        raise AssertionError(
            f"{precision}: the forward differs from the unsharded collection by {difference:.2e} "
            f"of a sample's largest value (tolerance {CHECK_TOLERANCE[precision]:.0e})"
        )


def build_on_every_rank(
    build: Callable[[], Provider], world_size: int
) -> tuple[Provider | None, str | None]:
    """``build()`` on every rank (a peer's provider), and the first rank's error if any rank
    raised (then no rank times it): (provider, None) or (None, the error described). A
    collective."""
    provider, error = None, None
    try:
        provider = build()
    except Exception as e:  # any peer failure is reported instead of timed
        error = describe_error(e)
        if dist.get_rank() == 0:
            traceback.print_exc()
    errors = [None] * world_size
    dist.all_gather_object(errors, error)
    error = next((e for e in errors if e), None)
    return (None, error) if error else (provider, None)
