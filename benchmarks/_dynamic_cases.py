"""Cases of ``benchmarks/dynamic.py``: the key streams and the two id -> row maps it times
(recsys's :class:`~recsys.embedding.dynamic.slot_map.SlotMap`, TorchRec's
``MCHManagedCollisionModule``), and the four table treatments it trains on the drifting synthetic
stream.

See the docstring of ``benchmarks/dynamic.py`` for what each case measures.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.functional.classification import binary_auroc

from benchmarks._harness import Timing, time_fn
from recsys import KeyedJaggedTensor  # recsys quiets torchrec's import
from recsys.build.models import build_model
from recsys.config import Config, DynamicConfig
from recsys.data.batch import Batch, DatasetSpec
from recsys.data.synthetic import SyntheticDataset
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.slot_map import SlotMap
from recsys.embedding.interface import embedding_collections
from recsys.ops.slot_map.hash_map import hash_keys
from recsys.train.optimizers import build_optimizers

# ---------------------------------------------------------------------------------------------
# Map throughput: key streams


def zipf_ranks(num_ranks: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """``size`` Zipf(1) ranks in [0, num_ranks): P(r) ~ 1 / (r + 1)."""
    u = torch.rand(size, generator=generator, dtype=torch.float64)
    return (torch.pow(num_ranks + 1.0, u).floor().long() - 1).clamp_(0, num_ranks - 1)


@dataclass
class KeyStreams:
    """Raw int64 key batches of one map case (keys: ``hash_keys(rank, stream)``, so they look
    like 64-bit hashes and a rank's key is the same in every batch of a stream).

    Attributes:
        fill: batches of the ``rows`` hottest keys of the warm stream, each key once, coldest
            first (so that LRU, where a full bucket evicts during the fill, keeps the hot ones):
            they fill an empty table of ``rows`` rows.
        warm: Zipf(1) batches over ``universe`` ranks (4 x rows): after the fill the hot ranks
            hit (most draws) and the tail misses.
        fresh: Zipf(1) batches, each over ``rows`` ranks of a stream of its own: every key is
            new to the table (duplicates within the batch).
    """

    fill: list[torch.Tensor]
    warm: list[torch.Tensor]
    fresh: list[torch.Tensor]
    universe: int


def key_streams(rows: int, batch: int, num_batches: int, generator: torch.Generator) -> KeyStreams:
    """The streams of a table of ``rows`` rows, in batches of ``batch`` keys."""
    universe = 4 * rows
    fill = list(hash_keys(torch.arange(rows - 1, -1, -1), seed=0).split(batch))
    warm = [hash_keys(zipf_ranks(universe, batch, generator), 0) for _ in range(num_batches)]
    fresh = [hash_keys(zipf_ranks(rows, batch, generator), seed=1 + i) for i in range(num_batches)]
    return KeyStreams(fill, warm, fresh, universe)


# ---------------------------------------------------------------------------------------------
# Map throughput: the two maps


class SlotMapSide:
    """recsys's map at its full size ``rows`` (no growth), LRU, buckets of ``bucket_size``.

    ``find(keys)``: :meth:`SlotMap.find` of every key (duplicates, no dedupe; read-only).
    ``insert(keys)``: what a dynamic table does per training batch: ``torch.unique`` (inverse,
    counts), :meth:`SlotMap.insert` of the distinct keys (find, assign free or evicted slots to
    the new ones, LRU scores), then the slot of every key (gather by the inverse).
    """

    name = "recsys_slot_map"

    def __init__(self, rows: int, bucket_size: int, device: torch.device) -> None:
        self.map = SlotMap(rows, rows, bucket_size=bucket_size, policy="lru", device=device)
        self.step = 0

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        return self.map.find(keys)

    def insert(self, keys: torch.Tensor) -> torch.Tensor:
        self.step += 1
        unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        return self.map.insert(unique, counts, self.step).slots[inverse]

    def hit_rate(self, keys: torch.Tensor) -> float:
        return float((self.map.find(keys) >= 0).float().mean())

    def describe(self) -> str:
        stats = self.map.stats()
        return (
            f"size={stats['size']} capacity={stats['capacity']} "
            f"evictions={stats['evictions']} overflow={stats.get('overflow', 0)} "
            f"bucket_size={self.map.bucket_size}"
        )


class MCHSide:
    """TorchRec's ``MCHManagedCollisionModule(zch_size=rows, LRU_EvictionPolicy(),
    eviction_interval=1)`` on one feature.

    ``find(keys)``: ``remap()``: ``searchsorted`` of every key in the sorted raw ids
    (duplicates, no dedupe; read-only; a miss maps to the last row).
    ``insert(keys)``: ``profile()`` then ``remap()``: profile copies the batch into its
    history and, every ``eviction_interval`` = 1 batches, coalesces it (``torch.unique`` with
    counts), scores the ``rows`` held ids and the new ones by LRU, keeps the top ``rows``
    (argsort over rows + new) and re-sorts its buffers; remap then looks every key up.
    """

    name = "torchrec_mch"

    def __init__(self, rows: int, device: torch.device) -> None:
        from torchrec.modules.mc_modules import LRU_EvictionPolicy, MCHManagedCollisionModule

        self.module = MCHManagedCollisionModule(
            zch_size=rows,
            device=device,
            eviction_policy=LRU_EvictionPolicy(),
            eviction_interval=1,
        ).train()

    @staticmethod
    def _features(keys: torch.Tensor) -> dict:
        from torchrec.sparse.jagged_tensor import JaggedTensor

        lengths = torch.ones(len(keys), dtype=torch.int64, device=keys.device)
        return {"f": JaggedTensor(values=keys, lengths=lengths)}

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        return self.module.remap(self._features(keys))["f"].values()

    def insert(self, keys: torch.Tensor) -> torch.Tensor:
        features = self._features(keys)
        self.module.profile(features)
        return self.module.remap(features)["f"].values()

    def held_keys(self) -> torch.Tensor:
        held = self.module.state_dict()["_mch_sorted_raw_ids"]
        return held[held != torch.iinfo(torch.int64).max]

    def hit_rate(self, keys: torch.Tensor) -> float:
        return float(torch.isin(keys, self.held_keys()).float().mean())

    def describe(self) -> str:
        return f"size={len(self.held_keys())} zch_size={self.module.output_size()}"


def cycling(batches: list[torch.Tensor], op: Callable[[torch.Tensor], object]) -> Callable:
    """A callable that applies ``op`` to the next batch of ``batches`` at each call."""
    cycle = itertools.cycle(batches)
    return lambda: op(next(cycle))


# ---------------------------------------------------------------------------------------------
# AUC on the drifting stream


@dataclass
class Treatment:
    """One way to give the drifting stream's raw keys rows, on the same model.

    Attributes:
        name: the CSV provider.
        spec: the dataset spec the model is built from (its cardinalities size fixed tables;
            dynamic tables take them as the scale of their initial rows).
        dynamic: the ``[model.dynamic]`` section (``tables = []``: fixed tables).
        ids: raw keys of one feature -> the ids the model reads (identity for dynamic tables).
        notes: what the treatment does.
    """

    name: str
    spec: DatasetSpec
    dynamic: DynamicConfig
    ids: Callable[[int, torch.Tensor], torch.Tensor]
    notes: str


@dataclass
class DriftData:
    """The days of the stream: ``train[d]`` samples of day d, ``test[d]`` of day d + 1."""

    dataset: SyntheticDataset
    train: list[Batch]
    test: list[Batch]


def drift_data(dataset: SyntheticDataset, train_samples: int, test_samples: int) -> DriftData:
    """Day d's training samples for d in [0, D) and day d + 1's test samples (draw 1)."""
    days = dataset.config.drift_days
    train = [dataset.day(d, train_samples) for d in range(days)]
    test = [dataset.day(d + 1, test_samples, draw=1) for d in range(days)]
    return DriftData(dataset, train, test)


def feature_keys(sparse: KeyedJaggedTensor) -> list[torch.Tensor]:
    """Each feature's values, in key order."""
    offsets = sparse.offset_per_key()
    values = sparse.values()
    return [values[offsets[f] : offsets[f + 1]] for f in range(len(sparse.keys()))]


def with_ids(batch: Batch, ids: Callable[[int, torch.Tensor], torch.Tensor]) -> Batch:
    """``batch`` with each feature's keys replaced by ``ids(feature, keys)``."""
    values = torch.cat([ids(f, keys) for f, keys in enumerate(feature_keys(batch.sparse))])
    sparse = KeyedJaggedTensor(
        keys=batch.sparse.keys(), values=values, lengths=batch.sparse.lengths()
    )
    return dataclasses.replace(batch, sparse=sparse)


def day_zero_vocabulary(day_zero: Batch) -> list[torch.Tensor]:
    """Per feature, the sorted distinct keys of day 0's training samples."""
    return [torch.unique(keys) for keys in feature_keys(day_zero.sparse)]


def vocabulary_ids(vocabulary: list[torch.Tensor]) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Key -> 1 + its index in the feature's vocabulary; 0 (the shared unseen row) otherwise."""

    def ids(feature: int, keys: torch.Tensor) -> torch.Tensor:
        words = vocabulary[feature]
        index = torch.searchsorted(words, keys).clamp_(max=len(words) - 1)
        return torch.where(words[index] == keys, index + 1, 0)

    return ids


def treatments(data: DriftData, cap_fractions: list[float], bucket_size: int) -> list[Treatment]:
    """vocab_day0, then per cap fraction x: hash and dynamic_lru capped at C = x * (ids alive
    per day), then dynamic_uncapped. ``bucket_size``: slots per bucket of the dynamic maps."""
    spec = data.dataset.spec
    alive = data.dataset.config.cardinalities  # ids alive on any one day, per feature
    vocabulary = day_zero_vocabulary(data.train[0])

    def fixed(name: str, rows: list[int], ids: Callable, notes: str) -> Treatment:
        index_spec = dataclasses.replace(spec, cardinalities=tuple(rows), id_encoding="index")
        return Treatment(name, index_spec, DynamicConfig(), ids, notes)

    def dynamic(name: str, caps: list[int], notes: str) -> Treatment:
        index_spec = dataclasses.replace(spec, cardinalities=tuple(alive), id_encoding="index")
        overrides = [f"{n}.max_capacity={c}" for n, c in zip(spec.sparse_names, caps, strict=True)]
        options = DynamicConfig(tables=["all"], bucket_size=bucket_size, overrides=overrides)
        return Treatment(name, index_spec, options, lambda f, keys: keys, notes)

    out = [
        fixed(
            "vocab_day0",
            [len(v) + 1 for v in vocabulary],
            vocabulary_ids(vocabulary),
            "fixed table: the keys of day 0's training samples get rows; later new keys share "
            "row 0 (the unseen row), which trains",
        )
    ]
    for fraction in cap_fractions:
        caps = [max(1, round(fraction * n)) for n in alive]

        def hashed(f: int, keys: torch.Tensor, caps=caps) -> torch.Tensor:
            return torch.remainder(keys, caps[f])

        out.append(
            fixed(
                f"hash_c{fraction:g}",
                caps,
                hashed,
                f"fixed table of C rows, key mod C; C = {fraction:g} x ids alive per day",
            )
        )
        out.append(
            dynamic(
                f"dynamic_lru_c{fraction:g}",
                caps,
                f"dynamic table, max_capacity = C = {fraction:g} x ids alive per day (rounded "
                f"up to buckets of {bucket_size}), LRU eviction",
            )
        )
    out.append(dynamic("dynamic_uncapped", [0] * len(alive), "dynamic table, no cap"))
    return out


@dataclass
class DayResult:
    """One day of a treatment: trained on day d, tested on day d + 1."""

    auc: float
    timing: Timing
    rows: int  # rows in use over all tables after the day (dynamic: live keys)
    notes: str


def table_summary(model: nn.Module, rows_fixed: int) -> tuple[int, str]:
    """(rows in use, a note): dynamic tables' size, capacity, inserts and evictions summed over
    tables; fixed tables' rows."""
    stats: dict[str, float] = {}
    for collection in embedding_collections(model).values():
        if isinstance(collection, DynamicEmbeddingBagCollection):
            for table in collection.dynamic_stats().values():
                for key in ("size", "capacity", "inserts", "evictions", "overflow", "grows"):
                    stats[key] = stats.get(key, 0) + table.get(key, 0)
    if not stats:
        return rows_fixed, f"rows={rows_fixed}"
    note = " ".join(f"{k}={int(v)}" for k, v in stats.items())
    return int(stats["size"]), "summed over tables: " + note


def auc_of(model: nn.Module, batch: Batch, chunk: int = 8192) -> float:
    """Test AUC of ``model`` (task 0) on ``batch``, in eval mode (dynamic tables insert
    nothing: unknown keys pool as zeros)."""
    model.eval()
    with torch.no_grad():
        logits = [
            model(part.dense, part.sparse)[:, 0]
            for part in (
                batch.slice(i, min(i + chunk, len(batch))) for i in range(0, len(batch), chunk)
            )
        ]
    model.train()
    return float(binary_auroc(torch.cat(logits), batch.labels[:, 0].long()))


def run_treatment(
    treatment: Treatment, config: Config, data: DriftData, batch_size: int, seed: int
) -> list[DayResult]:
    """Build the model, then day by day: one pass over day d's samples in batches of
    ``batch_size`` (each step timed), test AUC on day d + 1."""
    model_config = dataclasses.replace(config.model, dynamic=treatment.dynamic)
    device = torch.device("cpu")
    model = build_model(model_config, treatment.spec, device, seed=seed)
    optimizers = build_optimizers(config.train, model).values()
    rows_fixed = sum(treatment.spec.cardinalities)
    results = []
    for train, test in zip(data.train, data.test, strict=True):
        train, test = with_ids(train, treatment.ids), with_ids(test, treatment.ids)
        steps = math.ceil(len(train) / batch_size)
        batches = iter([train.slice(i * batch_size, (i + 1) * batch_size) for i in range(steps)])
        step = train_step(model, list(optimizers), batches)
        timing = time_fn(step, device, warmup=0, repeats=steps, min_time_s=0, max_repeats=steps)
        rows, notes = table_summary(model, rows_fixed)
        results.append(DayResult(auc_of(model, test), timing, rows, notes))
    return results


def train_step(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], batches: Iterator[Batch]
) -> Callable[[], None]:
    """A callable that trains ``model`` on the next batch: BCE on task 0, every optimizer
    (the tables' update is fused into backward)."""

    def step() -> None:
        batch = next(batches)
        logits = model(batch.dense, batch.sparse)[:, 0]  # [B]
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels[:, 0])
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        if not torch.isfinite(loss):
            raise AssertionError(f"non-finite loss {loss.item()}")

    return step


def oracle_aucs(data: DriftData) -> list[float]:
    """The teacher's AUC on each test day: the ceiling of any model."""
    return [
        float(binary_auroc(data.dataset.click_probability(test)[:, 0], test.labels[:, 0].long()))
        for test in data.test
    ]


def with_bucket_size(treatment: Treatment, bucket_size: int) -> Treatment:
    """``treatment`` with dynamic maps of ``bucket_size`` slots per bucket (name ``_b<S>``)."""
    dynamic = dataclasses.replace(treatment.dynamic, bucket_size=bucket_size)
    return dataclasses.replace(
        treatment,
        name=f"{treatment.name}_b{bucket_size}",
        dynamic=dynamic,
        notes=treatment.notes.replace(
            f"buckets of {treatment.dynamic.bucket_size}", f"buckets of {bucket_size}"
        ),
    )
