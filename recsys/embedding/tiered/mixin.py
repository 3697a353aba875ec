"""TieredTables: what tiered tables add to a collection of packed tables, pooled
(:class:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection`) or unpooled
(:class:`~recsys.embedding.unpooled_tables.TieredEmbeddingCollection`): the caches in front of
the row stores, prefetch, streaming checkpoints and the counters. What a tiered table promises
is in the docstring of :mod:`recsys.embedding.tiered.collection`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsys.embedding.dynamic.admission import AdmissionCounter
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.inputs import feature_positions, feature_spans
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.row_init import initial_rows, table_seed
from recsys.embedding.tables import table_dtype
from recsys.embedding.tiered.files import TablePart, TieredFiles
from recsys.embedding.tiered.options import (
    RowBlock,
    TieredLayout,
)
from recsys.embedding.tiered.prefetch import PrefetchBatch
from recsys.embedding.tiered.row_cache import RowCache, RowCodec
from recsys.embedding.tiered.row_store import DiskRecords, FixedStore, HostRecords, KeyedStore
from recsys.ops.slot_map.hash_map import EMPTY_KEY, check_keys

__all__ = ["TieredTables"]


class TieredTables:
    """What tiered tables add to a collection of packed tables: the caches in front of the
    stores, prefetch, streaming checkpoints and the counters (see the module docstring). The
    first base of :class:`TieredEmbeddingBagCollection` and of the unpooled
    :class:`~recsys.embedding.unpooled_tables.TieredEmbeddingCollection`, whose constructor
    builds its packed tables from :func:`tiered_layout`'s configs, then calls
    :meth:`_init_tiered`."""

    def _init_tiered(
        self,
        tables: list[BaseEmbeddingConfig],
        layout: TieredLayout,
        seed: int,
        blocks: dict[str, RowBlock] | None,
    ) -> None:
        self._record_bytes = layout.record_bytes
        self._logical_configs = tables
        self.storage = layout.options
        self.seed = seed
        self.dynamic_options = layout.dynamic
        self.blocks = {
            n: (blocks or {}).get(n, RowBlock(0, c.num_embeddings))
            for n, c in layout.tiered.items()
        }
        self._tiered = list(layout.tiered)
        self.caches: dict[str, RowCache] = {}
        self.admission: dict[str, AdmissionCounter] = {}
        for name, config in layout.tiered.items():
            if self.device.type != "meta":
                self.caches[name] = self._build_cache(
                    config, layout.cache_rows[name], layout.dynamic.get(name)
                )
        self._train_steps = 0
        self._queue: list[PrefetchBatch] = []
        self.prefetch_wait_seconds = 0.0
        self.prefetch_deferred = 0
        self.reset_parameters()
        self.register_state_dict_post_hook(_drop_tiered_rows)
        self.register_load_state_dict_post_hook(_allow_missing_tiered_rows)

    def _build_cache(
        self, config: EmbeddingBagConfig, rows: int, dynamic: DynamicTableOptions | None
    ) -> RowCache:
        name, options = config.name, self.storage[config.name]
        width = self._record_bytes[name]
        size = config.num_embeddings if dynamic is None else 1024
        if options.tier == "host":
            records = HostRecords(size, width, pin=self.device.type == "cuda")
        else:
            records = DiskRecords(Path(options.path) / f"{name}.rows", size, width)
        store = FixedStore(records) if dynamic is None else KeyedStore(records, name)
        codec = RowCodec(lambda: self._table_tensors(name))
        if dynamic is not None and dynamic.admit_after > 1:
            self.admission[name] = AdmissionCounter(
                dynamic.admit_after,
                dynamic.admission_capacity or 1 << 20,
                bucket_size=dynamic.bucket_size,
                device=self.device,
                name=name,
            )
        block = self.blocks[name]
        bound = (
            dynamic.init_bound
            if dynamic is not None and dynamic.init_bound is not None
            else math.sqrt(1.0 / block.table_rows)
        )
        seed, dtype = table_seed(self.seed, name), table_dtype(config)
        initial = [self.optimizer.initial_state(s) for s in self.optimizer.states]

        def fresh(keys: torch.Tensor) -> torch.Tensor:
            rows = keys.cpu() + block.offset
            weights = initial_rows(rows, seed, config.embedding_dim, bound, dtype)
            states = [
                torch.full((len(keys), *t.shape[1:]), value, dtype=t.dtype)
                for value, t in zip(initial, self._table_tensors(name)[1:], strict=True)
            ]
            return codec.encode([weights, *states])

        return RowCache(
            rows, store, codec, fresh, policy=options.policy, device=self.device, name=name
        )

    def _table_tensors(self, name: str) -> list[torch.Tensor]:
        """Table ``name``'s weight and optimizer-state views in the packed buffers."""
        bag = self.table_modules[name]
        return [bag.weight.data] + [getattr(bag, s) for s in self.optimizer.states]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._logical_configs

    def tiered_tables(self) -> list[str]:
        """The tables in host memory or on disk (on the ``meta`` device too, where no store
        exists yet)."""
        return list(self._tiered)

    def set_optimizer(self, optimizer: FusedOptimizer | None) -> None:
        """As the packed tables', once the tiered tables exist only with an optimizer of
        the same state (their stored rows hold it, and keep it: the cached rows are written
        back first, and read again from the store).

        Raises:
            ValueError: another kind of optimizer for tiered tables."""
        caches = getattr(self, "caches", {})
        if caches and (optimizer is None or optimizer.states != self.optimizer.states):
            raise ValueError(
                f"tiered tables {list(caches)} store {type(self.optimizer).__name__}'s state "
                f"in every row; cannot switch to {optimizer!r}. Change its learning rate "
                "instead (collection.optimizer.lr = ...)"
            )
        if caches:
            self.drop_prefetched()  # their rows would be gone
            self.flush()
        super().set_optimizer(optimizer)
        for cache in caches.values():
            cache.clear()

    def reset_parameters(self) -> None:
        """Device-tier tables from their ``init_fn``; tiered tables empty (every row back to
        its initial value, lazily)."""
        if self.device.type == "meta" or not hasattr(self, "caches"):
            return
        for config in self._logical_configs:
            if config.name not in self.caches:
                with torch.no_grad():
                    config.init_fn(self.table_modules[config.name].weight)
        for cache in self.caches.values():
            cache.clear()
            cache.store.clear()
        for tensor in (t for n in self.caches for t in self._table_tensors(n)):
            tensor.zero_()

    def lookup_ids(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The ids with every tiered table's ids replaced by their cache rows (prepared by
        :meth:`prefetch` for this batch, else now)."""
        values = features.values()
        if not self.caches:
            return values
        train = self._trains()
        if train:
            self._train_steps += 1
        prepared = self._take_prefetched(features)
        if prepared is None:
            # Every batch looked up before is done (its update applied): only the prefetched
            # batches' rows stay pinned while this one's rows are prepared.
            for name, cache in self.caches.items():
                cache.begin(min([cache.next_ticket, *self._pending_tickets(name)]))
            prepared = self._prepare(features, train)
        else:
            self._admit_deferred(prepared, features, train)
        out = values.clone()
        for name, (where, rows, tickets) in prepared.items():
            cache = self.caches[name]
            cache.begin(min([*tickets, *self._pending_tickets(name)]))
            out[where] = torch.where(rows >= 0, rows, cache.num_rows)
        self._zero_spare_rows()
        self._start_next()
        return out

    def _trains(self) -> bool:
        return self.training and not self.is_frozen()

    def _prepare(self, features: KeyedJaggedTensor, train: bool, *, defer: bool = False):
        """Per tiered table: (positions of its ids, the cache row of each id, the batch's
        tickets). ``defer``: keys of dynamic tables that neither the cache nor the store holds
        get no row yet (:meth:`_admit_deferred` decides in the batch's forward, so admission
        counts only batches that train)."""
        prepared, tables = {}, self._ids_by_table(features)
        for name, (where, ids) in tables.items():
            keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            admit = self._admit(name, train and not defer)
            # A prefetch thread's batch that does not fit is deferred to its forward instead.
            grow = None if defer else self._grower(name)
            cache = self.caches[name]
            rows, ticket = cache.prepare(keys, counts, train=train, admit=admit, grow=grow)
            prepared[name] = (where, rows[inverse], [ticket])
        return prepared

    def _grower(self, name: str):
        """``grow(n)`` for table ``name``'s cache: n more rows in the packed buffers, the
        cached rows and their optimizer state where they are, the row past the cache (zero)
        moved past the new ones. Called in a forward only: no other batch's lookup or update
        is in flight then (prefetched batches keep their rows, which do not move)."""
        index = list(self.table_modules).index(name)

        def grow(count: int) -> None:
            kept = torch.arange(self.caches[name].num_rows, device=self.device)
            self.resize_table(index, len(kept) + count + 1, (kept, kept))

        return grow

    def _ids_by_table(self, features: KeyedJaggedTensor) -> dict[str, tuple]:
        """Per tiered table: (the positions of its ids in ``features.values()``, the ids),
        after checking them."""
        values, spans, out = features.values(), feature_spans(features), {}
        for config in self._logical_configs:
            if config.name in self.caches:
                where = feature_positions(spans, config.feature_names)
                out[config.name] = (where, values[where])
                self._check_ids(config, out[config.name][1])
        return out

    def _admit_deferred(self, prepared: dict, features: KeyedJaggedTensor, train: bool) -> None:
        """Rows for the keys a prefetch left without one (new keys of dynamic tables)."""
        if not train:
            return
        values = features.values()
        for name, (where, rows, tickets) in prepared.items():
            missing = rows < 0
            if name not in self.dynamic_options or not bool(missing.any()):
                continue
            ids = values[where][missing]
            keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            cache = self.caches[name]
            admit, grow = self._admit(name, True), self._grower(name)
            found, ticket = cache.prepare(keys, counts, train=True, admit=admit, grow=grow)
            rows[missing] = found[inverse]
            tickets.append(ticket)

    def _admit(self, name: str, train: bool):
        """Which keys the store lacks get a row: a fixed table's all; a dynamic table's while
        training, past its admission count; none outside training."""
        if name not in self.dynamic_options:
            return None
        if not train:
            return lambda keys, counts: torch.zeros(len(keys), dtype=torch.bool)
        if name not in self.admission:
            return None
        step = self._train_steps
        return lambda keys, counts: self.admission[name].admit(keys, counts, step)

    def _check_ids(self, config: EmbeddingBagConfig, ids: torch.Tensor) -> None:
        if config.name in self.dynamic_options:
            check_keys(ids, f"ids of dynamic table '{config.name}'")
            return
        if not len(ids):
            return
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= config.num_embeddings:
            bad = ids[(ids < 0) | (ids >= config.num_embeddings)][0].item()
            raise ValueError(
                f"table '{config.name}' (features {config.feature_names}): id {bad} is outside "
                f"[0, {config.num_embeddings})"
            )

    def _zero_spare_rows(self) -> None:
        """The row past each cache (ids without a row read it) back to zero and its state to
        the initial value."""
        with torch.no_grad():
            for name, cache in self.caches.items():
                tensors = self._table_tensors(name)
                tensors[0][cache.num_rows] = 0
                for state, tensor in zip(self.optimizer.states, tensors[1:], strict=True):
                    tensor[cache.num_rows] = self.optimizer.initial_state(state)

    def _room_beside_prefetched(self) -> dict[str, int]:
        """Per tiered table, the cache rows a lookup may take now: all but the prefetched
        batches' (after waiting for the running prefetch)."""
        self.wait_prefetch()
        room = {}
        for name, cache in self.caches.items():
            pending = self._pending_tickets(name)
            pinned = int((cache.row_ticket >= min(pending)).sum()) if pending else 0
            room[name] = cache.num_rows - pinned
        return room

    def _fits(self, features: KeyedJaggedTensor, room: dict[str, int]) -> bool:
        """Whether each tiered table's distinct ids of ``features`` fit in its ``room``."""
        tables = self._ids_by_table(features)
        return all(len(torch.unique(ids)) <= room[n] for n, (_, ids) in tables.items())

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Queue a coming batch ``features`` (call it between steps, for the batches to train
        next, in order). Its rows are prepared in a background thread that the forward of the
        batch before it starts once its own rows are settled, so preparing batch i+1 overlaps
        the lookup, dense layers and backward of batch i; the rows of batch i and of every
        prepared batch are pinned meanwhile. Its forward then waits for the thread if needed."""
        if not self.caches:
            return
        idle = not self._queue
        self._queue.append(PrefetchBatch(features, self._trains()))
        if idle:  # else the forward of the batch before it starts it
            self._start_next()

    def _start_next(self) -> None:
        """Start the first queued batch's thread, once no other runs. The last batch looked up
        may still be in flight (its backward to come), so its rows stay pinned."""
        waiting = [p for p in self._queue if not p.started]
        if not waiting or any(p.started and not p.done for p in self._queue):
            return
        batch = waiting[0]
        for name, cache in self.caches.items():
            cache.begin(min([cache.oldest_live, *self._pending_tickets(name)]))
        batch.start(lambda: self._prepare(batch.features, batch.train, defer=True))

    def _pending_tickets(self, name: str) -> list[int]:
        """Table ``name``'s tickets of the batches prepared and not yet trained."""
        return [t for p in self._queue if p.done and p.result for t in p.result[name][2]]

    def wait_prefetch(self) -> None:
        """Wait for the running prefetch thread (its result stays for its batch)."""
        for batch in self._queue:
            if batch.started:
                batch.join()

    def drop_prefetched(self) -> None:
        """Forget queued batches that will not be trained (their rows merely stay cached)."""
        self.wait_prefetch()
        self._queue = []

    def _take_prefetched(self, features: KeyedJaggedTensor) -> dict[str, tuple] | None:
        """The prepared rows of ``features`` if it is the next queued batch (None: prepare
        now). Another batch (an evaluation between steps) waits for the running thread and
        leaves the queue to its batches."""
        if not self._queue:
            return None
        head = self._queue[0]
        if head.features is not features:
            self.wait_prefetch()
            return None
        self._queue.pop(0)
        if not head.started:
            return None
        start = time.perf_counter()
        head.join()
        self.prefetch_wait_seconds += time.perf_counter() - start
        if head.deferred:
            self.prefetch_deferred += 1
        return head.result

    def flush(self) -> None:
        """Write every changed cached row back to its store (checkpoints do this first)."""
        self.wait_prefetch()
        for cache in self.caches.values():
            cache.flush()

    def close(self) -> None:
        """Let go of the stores' files (a disk tier's mappings and locks, so another
        collection may use the same path); the tiered tables are unusable after. Call
        :meth:`flush` first to keep their rows in the files."""
        self.wait_prefetch()
        self._queue = []
        for cache in self.caches.values():
            close = getattr(cache.store.records, "close", None)
            if close is not None:
                close()

    def tiered_stats(self) -> dict[str, dict[str, float]]:
        """Per tiered table, its counters since the collection was built: ``lookups`` and
        ``hits`` (distinct ids per batch), ``misses``, ``fetched`` (rows read from the store),
        ``initialized`` (rows new to the store), ``evicted``, ``written_back``, ``bytes_read``
        and ``bytes_written`` (of the store), ``cache_rows``, ``stored`` (rows in a dynamic
        table's store), and ``prefetch_wait_s`` (the collection's: forwards waiting for their
        prefetch)."""
        out = {}
        for name, cache in self.caches.items():
            store = cache.store
            out[name] = {
                **cache.stats,
                "bytes_read": store.bytes_read,
                "bytes_written": store.bytes_written,
                "cache_rows": cache.num_rows,
                "prefetch_wait_s": self.prefetch_wait_seconds,
                "prefetch_deferred": self.prefetch_deferred,
            }
            if isinstance(store, KeyedStore):
                out[name]["stored"] = store.num_stored
        return out

    def live_keys(self, name: str) -> torch.Tensor | None:
        """[n] int64, ascending: the keys dynamic tiered table ``name`` holds a row for (in its
        store or in its cache, not written back yet; waits for a running prefetch); None for
        a fixed table, whose ids are its rows."""
        if name not in self.dynamic_options or name not in self.caches:
            return None
        self.wait_prefetch()
        cache = self.caches[name]
        stored = cache.store.index.entries()[0]
        cached = cache.row_key[cache.row_key != EMPTY_KEY]
        return torch.unique(torch.cat([stored.to(self.device), cached.to(self.device)]))

    def tiered_files(self, parts: dict[str, TablePart] | None = None) -> TieredFiles:
        """The streaming reader / writer of the tiered tables' rows for checkpoints.

        Args:
            parts: table -> which part of it this collection holds (a rank's shard; default:
                a fixed table's :class:`RowBlock`, a dynamic table's every key).
        """
        self.wait_prefetch()
        layouts, given, parts = {}, parts or {}, {}
        for name in self.caches:
            names = ["weight", *self.optimizer.states]
            layouts[name] = [
                f"{n}:{str(t.dtype).removeprefix('torch.')}:{t[0].numel()}"
                for n, t in zip(names, self._table_tensors(name), strict=True)
            ]
            if name in given:
                parts[name] = given[name]
            elif name not in self.dynamic_options:
                rows = next(c.num_embeddings for c in self._logical_configs if c.name == name)
                block = self.blocks[name]
                parts[name] = TablePart(block.offset, rows, table_rows=block.table_rows)
        return TieredFiles(dict(self.caches), layouts, parts)

    def tiered_state_keys(self) -> list[str]:
        """The state_dict keys of the tiered tables' cache buffers, which ``state_dict()``
        leaves out (their rows are saved by :meth:`tiered_files`)."""
        states = list(self.optimizer.states) if self.optimizer is not None else []
        return [f"{self.tables_key}.{n}.{k}" for n in self.caches for k in ["weight", *states]]


def _drop_tiered_rows(module: TieredTables, state_dict, prefix, local_metadata):
    """state_dict post-hook: a tiered table's cache buffers are not its state (its rows are
    streamed by :meth:`TieredEmbeddingBagCollection.tiered_files`)."""
    for key in module.tiered_state_keys():
        state_dict.pop(prefix + key, None)


def _allow_missing_tiered_rows(module: TieredTables, incompatible) -> None:
    """load_state_dict post-hook: a state without tiered tables' cache buffers is complete."""
    dropped = module.tiered_state_keys()
    for key in list(incompatible.missing_keys):
        if any(key == k or key.endswith("." + k) for k in dropped):
            incompatible.missing_keys.remove(key)
