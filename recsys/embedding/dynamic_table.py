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
from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingBagConfig

from recsys.embedding.row_init import initial_rows
from recsys.embedding.slot_map import AdmissionCounter, Insertion, ScorePolicy, SlotMap

__all__ = ["DynamicTable", "DynamicTableOptions"]

# Bytes per slot of the map itself: key, score, last step seen (int64 each).
MAP_BYTES_PER_SLOT = 24
# What a dynamic table saves beside its rows (see DynamicTable.key_state).
KEY_STATE = ("keys", "scores", "last_seen", "num_buckets")
ADMISSION_STATE = ("admission_keys", "admission_counts", "admission_buckets")
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
    (least often seen) or a :class:`~recsys.embedding.slot_map.ScorePolicy`."""
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
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"dynamic table option {name}={getattr(self, name)!r}; expected >= 0"
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
        one; nothing changes."""
        slots = self.map.find(ids)
        return torch.where(slots >= 0, slots, self.zero_row)

    def assign(self, ids: torch.Tensor, step: int) -> tuple[torch.Tensor, Insertion, torch.Tensor]:
        """Give the keys of a training batch their rows: expire stale keys, count the unseen
        ones for admission, insert the admitted ones (growing or evicting), score them all.

        Returns:
            (the row of each id, the zero row where not admitted; the map's
            :class:`~recsys.embedding.slot_map.Insertion` for the distinct keys; those keys,
            ascending).
        """
        if self.options.ttl_steps:
            self.map.expire(step, self.options.ttl_steps)
        keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        admit = None
        if self.admission is not None:
            unseen = self.map.find(keys) < 0
            admit = ~unseen
            admit[unseen] = self.admission.admit(keys[unseen], counts[unseen], step)
        insertion = self.map.insert(keys, counts, step, admit)
        slots = torch.where(insertion.slots >= 0, insertion.slots, self.zero_row)
        return slots[inverse], insertion, keys

    def fresh_rows(self, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The initial rows ``[len(keys), dim]`` of ``keys``: a function of (seed, table, key)."""
        return initial_rows(keys, self.seed, self.dim, self.bound, dtype)

    def stats(self) -> dict[str, float]:
        """The map's counters (size, capacity, load_factor, hits, inserts, evictions, ...),
        and the admission counter's (``admission_*``) when the table has one."""
        stats = dict(self.map.stats())
        if self.admission is not None:
            stats.update({f"admission_{k}": v for k, v in self.admission.stats().items()})
        return stats

    def state_names(self) -> tuple[str, ...]:
        """The names of the tensors :meth:`key_state` saves."""
        return KEY_STATE + (ADMISSION_STATE if self.admission is not None else ())

    def key_state(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(where each live key's row is, the table's key state for a checkpoint), keys
        ascending (the order of the rows its collection saves): ``keys``, ``scores``,
        ``last_seen``, ``num_buckets`` and, with admission, ``admission_keys`` /
        ``admission_counts`` / ``admission_buckets`` (see :meth:`state_names`)."""
        keys, slots = self.map.entries()
        state = {
            "keys": keys,
            "scores": self.map.scores[slots],
            "last_seen": self.map.last_seen[slots],
            "num_buckets": torch.tensor(self.map.num_buckets, dtype=torch.int64),
        }
        if self.admission is not None:
            state["admission_keys"], state["admission_counts"] = self.admission.state()
            state["admission_buckets"] = torch.tensor(self.admission.num_buckets)
        return slots, state

    def load_key_state(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Put back what :meth:`key_state` saved; returns the new slot of each saved key."""
        if self.admission is not None and "admission_keys" in state:
            buckets = int(state["admission_buckets"]) if "admission_buckets" in state else None
            self.admission.restore(state["admission_keys"], state["admission_counts"], buckets)
        return self.map.restore(
            int(state["num_buckets"]), state["keys"], state["scores"], state["last_seen"]
        )
