"""One dynamic table's options and key bookkeeping: its id -> slot map, its admission counter,
and the initial rows of the keys it admits.

A :class:`DynamicTable` holds no weights: its collection keeps the rows in the packed buffers
the fused kernels read, and asks the table which row each key reads (:meth:`DynamicTable.assign`
while training, :meth:`DynamicTable.find` otherwise). Row ``capacity`` of a dynamic table (one
past the map's slots) is its **zero row**: every key without a row (not admitted yet, or looked
up outside training) reads it, so it pools as zeros; the collection puts it back to zero (and
its optimizer state to the initial value) before every lookup, so no update it received is
ever seen.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingBagConfig

from recsys.embedding.dynamic.admission import AdmissionCounter
from recsys.embedding.dynamic.key_routing import KeyRouting, decode_layout, encode_layout
from recsys.embedding.dynamic.slot_map import Insertion, ScorePolicy, SlotMap
from recsys.embedding.row_init import initial_rows
from recsys.ops.slot_map.hash_map import EMPTY_KEY

__all__ = ["DynamicTable", "DynamicTableOptions", "load_every_key"]

# Bytes per slot of the map itself: key, score, last step seen (int64 each).
MAP_BYTES_PER_SLOT = 24
# What a dynamic table saves beside its rows (see DynamicTable.key_state).
KEY_STATE = ("keys", "scores", "last_seen", "bucket_counts", "num_buckets", "layout")
ADMISSION_STATE = (
    "admission_keys",
    "admission_counts",
    "admission_bucket_counts",
    "admission_buckets",
)
# How each saved tensor splits over the parts of a sharded table: one entry per key (ordered
# by routing bucket; the bucket counts say how many per bucket), one per routing bucket, one
# per part, or the same everywhere.
KEYED = {"keys": "bucket_counts", "scores": "bucket_counts", "last_seen": "bucket_counts"}
KEYED |= {"admission_keys": "admission_bucket_counts"}
KEYED |= {"admission_counts": "admission_bucket_counts"}
PER_BUCKET = ("bucket_counts", "admission_bucket_counts")
PER_PART = ("num_buckets", "admission_buckets")
# A cap of "no cap": more slots than any machine holds; the map only allocates what it uses.
UNCAPPED = 1 << 40


@dataclass
class DynamicTableOptions:
    """How a dynamic table grows, what it evicts, and which keys it admits.

    Its config's ``num_embeddings`` is the number of rows it starts with (rounded up to whole
    buckets); it grows (doubling, rehashing its keys) whenever its load would pass
    ``load_factor``, up to ``max_capacity`` rows or ``memory_budget_mb``. Once there, a new key
    evicts the entry of its bucket with the lowest score (ties: the smaller key).
    """

    max_capacity: int = 0
    """Most rows the table may hold; 0: no cap (or the one ``memory_budget_mb`` sets)."""
    memory_budget_mb: float = 0.0
    """Most MiB its rows, optimizer state and map may take (0: no budget); with
    ``max_capacity`` too, the smaller cap applies."""
    score: str | ScorePolicy = "lru"
    """Which entries a full bucket evicts first: ``"lru"`` (least recently seen), ``"lfu"``
    (least often seen) or a :class:`~recsys.embedding.dynamic.slot_map.ScorePolicy`."""
    bucket_size: int = 32
    """Slots per bucket of the map (a key lives only in its hash's bucket)."""
    load_factor: float = 0.75
    """Grow once this share of the slots would be in use."""
    admit_after: int = 0
    """A key gets a row once it has been seen this many times (0 or 1: at once); until then
    it pools as zeros and receives no update."""
    admission_capacity: int = 0
    """Most keys the admission counter keeps counts for (0: the table's cap, clamped to
    [2**20, 2**24])."""
    ttl_steps: int = 0
    """Drop the row of a key not seen for more than this many training steps (0: never)."""
    routing_buckets: int = 4096
    """Global buckets the table's keys are hashed into when it is split over ranks (see
    :mod:`recsys.embedding.dynamic.key_routing`); fixed for the table's life."""
    init_bound: float | None = None
    """New rows are uniform in ``[-init_bound, init_bound)`` from a generator keyed by
    (seed, table, key); None: ``sqrt(1 / num_embeddings)``, TorchRec's default."""

    def __post_init__(self) -> None:
        checks = {
            "max_capacity": self.max_capacity >= 0,
            "memory_budget_mb": self.memory_budget_mb >= 0,
            "admit_after": self.admit_after >= 0,
            "admission_capacity": self.admission_capacity >= 0,
            "ttl_steps": self.ttl_steps >= 0,
            "routing_buckets": self.routing_buckets >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"dynamic table option {name}={getattr(self, name)!r}; expected "
                    f">= {1 if name == 'routing_buckets' else 0}"
                )
        if self.init_bound is not None and not (
            math.isfinite(self.init_bound) and self.init_bound >= 0
        ):
            raise ValueError(
                f"dynamic table option init_bound={self.init_bound!r}; expected a finite "
                "number >= 0 or None"
            )

    def max_rows(self, row_bytes: int) -> int:
        """The table's cap in rows, for rows of ``row_bytes`` bytes (weights and state)."""
        caps = [self.max_capacity] if self.max_capacity else []
        if self.memory_budget_mb:
            per_row = row_bytes + MAP_BYTES_PER_SLOT
            caps.append(int(self.memory_budget_mb * 2**20) // per_row)
        return min(caps) if caps else UNCAPPED


class DynamicTable(nn.Module):
    """The keys of one dynamic table: the id -> slot map, the admission counter and the
    generator of fresh rows. Its state (``keys``, ``scores``, ``last_seen``, ``num_buckets``,
    ``admission_keys``, ``admission_counts``, ``admission_buckets``) is saved by its
    collection.

    Args:
        config: the table's config (``num_embeddings``: initial rows).
        options: its :class:`DynamicTableOptions`.
        seed: the generator key of its fresh rows (:func:`recsys.embedding.row_init.table_seed`).
        row_bytes: bytes of one row's weights and optimizer state (for ``memory_budget_mb``).
        device: where the map lives.
        backend: the map kernels' backend (``"auto"``, ``"torch"``, ``"triton"``).
    """

    def __init__(
        self,
        config: EmbeddingBagConfig,
        options: DynamicTableOptions,
        seed: int,
        row_bytes: int,
        device: torch.device,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.name = config.name
        self.options = options
        self.seed = seed
        self.dim = config.embedding_dim
        self.bound = (
            options.init_bound
            if options.init_bound is not None
            else math.sqrt(1.0 / config.num_embeddings)
        )
        max_rows = options.max_rows(row_bytes)
        if max_rows < 1:
            raise ValueError(
                f"table '{config.name}': memory_budget_mb={options.memory_budget_mb} holds no "
                f"row of {row_bytes + MAP_BYTES_PER_SLOT} bytes"
            )
        self.map = SlotMap(
            min(config.num_embeddings, max_rows),
            max_rows,
            bucket_size=options.bucket_size,
            policy=options.score,
            load_factor=options.load_factor,
            device=device,
            backend=backend,
            name=config.name,
        )
        self.routing = KeyRouting(options.routing_buckets)
        self.admission = None
        if options.admit_after > 1:
            self.admission = AdmissionCounter(
                options.admit_after,
                options.admission_capacity or min(max(max_rows, 1 << 20), 1 << 24),
                bucket_size=options.bucket_size,
                device=device,
                backend=backend,
                name=config.name,
            )
        # Deltas (see start_delta): the dynamic step of the baseline, the keys that lost their
        # row since (None: not recording), and without recording, the count of departures
        # (evictions and expirations) at a load.
        self._delta_step = 0
        self._deleted: list[torch.Tensor] | None = None
        self.dropped_at_load = torch.empty(0, dtype=torch.int64)
        """Keys of the last load left out to keep the cap (see :meth:`load_key_state`)."""
        self.load_past_cap = False
        """A load keeps every saved key, past the cap if it must (set to score a checkpoint
        exactly as the run did; training keeps the cap)."""
        self._untracked_from: int | None = None

    def budget(self, row_bytes: int) -> None:
        """Rows now cost ``row_bytes`` (weights and optimizer state): with a memory budget,
        the cap follows (never below the rows the table already has)."""
        if self.options.memory_budget_mb:
            rows = self.options.max_rows(row_bytes)
            buckets = -(-rows // self.map.bucket_size)
            self.map.max_buckets = max(self.map.num_buckets, buckets)

    @property
    def zero_row(self) -> int:
        """The row keys without a row read: one past the map's slots."""
        return self.map.capacity

    @property
    def rows(self) -> int:
        """Rows the table takes in its collection's buffers: the slots and the zero row."""
        return self.map.capacity + 1

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The row of each id (any shape, duplicates allowed), the zero row for ids without
        one; nothing changes. Each distinct id is looked up once (batches repeat hot ids)."""
        keys, inverse = torch.unique(ids, return_inverse=True)
        slots = self.map.find(keys)
        return torch.where(slots >= 0, slots, self.zero_row)[inverse]

    def assign(self, ids: torch.Tensor, step: int) -> tuple[torch.Tensor, Insertion, torch.Tensor]:
        """Give the keys of a training batch their rows: expire stale keys, count the unseen
        ones for admission, insert the admitted ones (growing or evicting), score them all.

        Returns:
            (the row of each id, the zero row where not admitted; the map's
            :class:`~recsys.embedding.dynamic.slot_map.Insertion` for the distinct keys; those keys,
            ascending).
        """
        if self.options.ttl_steps:
            self._record_deleted(self.map.expire_keys(step, self.options.ttl_steps)[1])
        keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        admit = None
        if self.admission is not None:
            unseen = self.map.find(keys) < 0
            admit = ~unseen
            admit[unseen] = self.admission.admit(keys[unseen], counts[unseen], step)
        insertion = self.map.insert(keys, counts, step, admit)
        self._record_deleted(insertion.evicted)
        slots = torch.where(insertion.slots >= 0, insertion.slots, self.zero_row)
        return slots[inverse], insertion, keys

    def fresh_rows(self, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The initial rows ``[len(keys), dim]`` of ``keys``: a function of (seed, table, key)."""
        return initial_rows(keys, self.seed, self.dim, self.bound, dtype)

    def changed_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys ascending, their slots) of the live keys trained since the delta baseline
        (:meth:`start_delta`): those last seen at a later step. A row changes only when its
        key is trained, so these are the rows inserted or updated since."""
        changed = (self.map.keys != EMPTY_KEY) & (self.map.last_seen > self._delta_step)
        slots = changed.nonzero().squeeze(1)
        keys, order = torch.sort(self.map.keys[slots])
        return keys, slots[order]

    def deleted_keys(self) -> torch.Tensor:
        """[m] int64, ascending: the keys recorded as losing their row (evicted or expired)
        since the delta baseline that have none now (a key evicted and inserted again is
        among :meth:`changed_keys` instead). Recording starts at the first
        :meth:`start_delta` that is not a load's; a load before it warns here when keys left
        the table unrecorded."""
        if self._deleted is None and self._untracked_from is not None:
            lost = self._departures() - self._untracked_from
            if lost:
                warnings.warn(
                    f"dynamic table '{self.name}': {lost} key(s) lost their row after it was "
                    "loaded and before its first delta was taken, unrecorded: this delta does "
                    "not list them as deleted. Take a delta right after loading (the trainer "
                    "does) to record deletions",
                    stacklevel=3,
                )
        if not self._deleted:
            return self.map.keys[:0]
        recorded = torch.unique(torch.cat(self._deleted))
        recorded = recorded[recorded != EMPTY_KEY]  # the padding of record_deleted
        return recorded[self.map.find(recorded) < 0]

    def start_delta(self, step: int, *, loaded: bool = False) -> None:
        """Make dynamic step ``step`` the baseline of the next delta and forget the deletions
        recorded so far. Deletions are recorded from the first call that is not ``loaded`` on
        (one int64 per key that loses its row between two deltas; a table whose deltas are
        never taken records nothing); ``loaded``: the table's state was just loaded."""
        self._delta_step = step
        if loaded and self._deleted is None:
            self._untracked_from = self._departures()
            return
        dropped, self.dropped_at_load = self.dropped_at_load, self.dropped_at_load[:0]
        self._deleted, self._untracked_from = [dropped] if len(dropped) else [], None

    def _departures(self) -> int:
        """Keys that lost their row since the map was built: evictions and expirations."""
        stats = self.map.stats()
        return int(stats["evictions"] + stats["expirations"])

    @property
    def records_deletions(self) -> bool:
        """Whether the keys that lose their row are recorded (see :meth:`start_delta`)."""
        return self._deleted is not None

    def record_deleted(self, keys: torch.Tensor) -> None:
        """Record ``keys`` [K] as having lost their row (``EMPTY_KEY`` entries: padding, not
        keys), when recording (see :meth:`start_delta`)."""
        self._record_deleted(keys)

    def _record_deleted(self, keys: torch.Tensor) -> None:
        if self._deleted is None or not len(keys):
            return
        self._deleted.append(keys)
        if len(self._deleted) > 64:  # few tensors, each key once
            self._deleted = [torch.unique(torch.cat(self._deleted))]

    def stats(self) -> dict[str, float]:
        """The map's counters (size, capacity, load_factor, hits, inserts, evictions, ...),
        and the admission counter's (``admission_*``) when the table has one."""
        stats = dict(self.map.stats())
        if self.admission is not None:
            stats.update({f"admission_{k}": v for k, v in self.admission.stats().items()})
        return stats

    def layout(self) -> dict[str, object]:
        """What a checkpoint records of how the table places keys: its routing (function,
        seed, bucket count) and score policy. Loading a checkpoint of another layout is a
        ValueError."""
        return {**self.routing.describe(), "score": self.map.policy.name}

    def state_names(self) -> tuple[str, ...]:
        """The names of the tensors :meth:`key_state` saves."""
        return KEY_STATE + (ADMISSION_STATE if self.admission is not None else ())

    def key_state(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(where each live key's row is, the table's key state for a checkpoint), keys in
        (routing bucket, key) order (the order of the rows its collection saves; see
        :mod:`recsys.embedding.dynamic.key_routing`): ``keys``, ``scores``, ``last_seen``,
        ``bucket_counts`` (keys per routing bucket), ``num_buckets`` ([1]: the map's buckets),
        ``layout`` and, with admission, the counter's ``admission_keys`` /
        ``admission_counts`` (in the same order), ``admission_bucket_counts`` and
        ``admission_buckets`` (see :meth:`state_names`)."""
        keys, slots = self.map.entries()
        order, counts = self.routing.key_order(keys)
        slots = slots[order]
        state = {
            "keys": keys[order],
            "scores": self.map.scores[slots],
            "last_seen": self.map.last_seen[slots],
            "bucket_counts": counts,
            "num_buckets": torch.tensor([self.map.num_buckets], dtype=torch.int64),
            "layout": encode_layout(self.layout()),
        }
        if self.admission is not None:
            keys, counts = self.admission.state()
            order, per_bucket = self.routing.key_order(keys)
            state["admission_keys"], state["admission_counts"] = keys[order], counts[order]
            state["admission_bucket_counts"] = per_bucket
            state["admission_buckets"] = torch.tensor([self.admission.num_buckets])
        return slots, state

    def load_key_state(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Put back what :meth:`key_state` saved, in any key order, into a map of the saved
        ``num_buckets`` (of several parts: their sum; doubled while a bucket would overflow);
        returns the new slot of each saved key.

        Raises:
            ValueError: the checkpoint's layout differs from this table's.

        At the cap, a bucket keeps its highest-scored keys; the others get slot -1 and are
        :attr:`dropped_at_load` (a checkpoint saved on more ranks, each with its share of the
        cap, into fewer ranks: the cap a user set holds after any reshard), unless
        :attr:`load_past_cap`."""
        if "layout" in state:
            self.check_layout(decode_layout(state["layout"]))
        if self.admission is not None and "admission_keys" in state:
            buckets = state.get("admission_buckets")
            self.admission.restore(
                state["admission_keys"],
                state["admission_counts"],
                int(buckets.sum()) if buckets is not None else None,
            )
        buckets = min(int(state["num_buckets"].sum()), self.map.max_buckets)
        slots = self.map.restore(
            buckets,
            state["keys"],
            state["scores"],
            state["last_seen"],
            grow=True,
            past_cap=self.load_past_cap,
        )
        # Keys of a checkpoint saved under another sharding, over this table's cap: the next
        # delta deletes them (its base holds them).
        self.dropped_at_load = self.map.dropped.cpu()
        return slots

    def check_layout(self, saved: dict[str, object]) -> None:
        """Raise ValueError naming every difference between a checkpoint's layout of this
        table and the table's own."""
        mine = self.layout()
        differ = [
            f"{key} {saved.get(key)!r} there, {value!r} here"
            for key, value in mine.items()
            if saved.get(key) != value
        ]
        if differ:
            raise ValueError(
                f"dynamic table '{self.name}': the checkpoint places keys differently: "
                f"{'; '.join(differ)}; load it with the options it was saved with"
            )


def load_every_key(model: nn.Module) -> None:
    """Make every dynamic table of ``model`` keep all the keys a checkpoint holds when it is
    loaded, past its cap if need be (:attr:`DynamicTable.load_past_cap`): a model loaded to
    score or export, which must score as the run that saved it did, on any number of ranks."""
    for module in model.modules():
        if isinstance(module, DynamicTable):
            module.load_past_cap = True
