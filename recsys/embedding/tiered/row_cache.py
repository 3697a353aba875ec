"""The cache of a tiered table: the rows of a few keys in the packed buffers the fused kernels
read, in front of a :class:`~recsys.embedding.tiered.row_store.RowStore` holding every row.

A :class:`RowCache` of ``num_rows`` rows keeps, per cache row, the key it holds, a score (LRU:
the ticket of the last batch that used it; LFU: how many ids used it), whether training changed
it since it came from the store (dirty), and the ticket of the last batch that used it. Keys find
their row through an id -> slot map (:class:`~recsys.embedding.dynamic.slot_map.SlotMap`, growing:
it never evicts on its own) and one int64 per map slot. The rows holding no key are kept in a list,
lowest first, so taking a free row never scans the cache.

:meth:`RowCache.prepare` gives a batch's distinct keys cache rows::

    hits: their rows; misses: rows that are free, else the lowest-score rows not pinned
          (dirty ones written back to the store first), filled from the store, or for a key
          the store does not have, from the table's initial rows (lazy initialization)

**Pinning.** Every batch gets a ticket; a row is pinned while the batch in flight or the batch
being prepared uses it (ticket >= :attr:`RowCache.oldest_live`): prefetching batch i+1 while
batch i trains never evicts a row of batch i, whose fused update is still to come.

**A batch larger than the cache.** A batch needing more rows than the unpinned cache holds
makes the cache grow by the rows it lacks when :meth:`RowCache.prepare` is given ``grow`` (the
owner adds them to its packed buffers, then :meth:`RowCache.extend`; counted in ``grown``): the
batch trains exactly as with a cache that held it from the start. Without ``grow`` (a prefetch
in the background, while the batch in flight uses the buffers) it is a
:class:`CacheTooSmallError` that names the minimum size.

Evicted rows go back to the store exactly (bytes), and a row's value never depends on which
cache row holds it, so a tiered table trains bitwise like the same table held whole in memory,
whatever the cache size and policy: they change speed, not results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recsys.embedding.dynamic.slot_map import SlotMap
from recsys.embedding.dynamic.table import UNCAPPED
from recsys.embedding.tiered.row_store import RowStore
from recsys.ops.slot_map.hash_map import EMPTY_KEY

__all__ = ["CACHE_POLICIES", "CacheTooSmallError", "RowCache", "RowCodec"]

CACHE_POLICIES = ("lru", "lfu")


class CacheTooSmallError(ValueError):
    """A batch needs more cache rows than a tiered table's cache has free of pinned rows.

    Attributes:
        tables: table name -> (its cache rows, the distinct rows the batch needs there).
        pinned: rows pinned by other batches (in flight, or prepared) when it was raised.
    """

    def __init__(self, tables: dict[str, tuple[int, int]], pinned: int = 0) -> None:
        self.tables, self.pinned = tables, pinned
        parts = [
            f"'{name}' has {rows} rows, this batch needs {needed} (set its cache_rows >= "
            f"{needed})"
            for name, (rows, needed) in tables.items()
        ]
        others = f"; {pinned} more rows are pinned by other batches" if pinned else ""
        super().__init__(
            f"tiered table cache too small for one batch: {'; '.join(parts)}{others} (or "
            "cache_mb to match)"
        )


class RowCodec:
    """Packs rows of a table's packed buffers into store records and back: the weights' bytes
    then each optimizer state's float32 bytes (see :mod:`recsys.embedding.tiered.row_store`).

    Args:
        tensors: returns the table's tensors now, each with one row per cache row: the weight
            ``[rows, dim]`` then its optimizer states (``[rows]`` or ``[rows, dim]``). A function,
            since the collection re-binds its views (a move, a new optimizer).
    """

    def __init__(self, tensors: Callable[[], list[torch.Tensor]]) -> None:
        self.tensors = tensors
        self.widths = [_row_bytes(t) for t in tensors()]
        self.record_bytes = sum(self.widths)

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, record_bytes] uint8 records of cache ``rows``, on the CPU."""
        parts = [_as_bytes(t[rows].cpu()) for t in self.tensors()]
        return torch.cat(parts, dim=1) if parts else torch.zeros(len(rows), 0, dtype=torch.uint8)

    def unpack(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Write ``records`` [n, record_bytes] into cache ``rows``."""
        start = 0
        for tensor, width in zip(self.tensors(), self.widths, strict=True):
            part = records[:, start : start + width].contiguous()
            values = part.view(tensor.dtype).reshape((len(rows), *tensor.shape[1:]))
            tensor[rows.to(tensor.device)] = values.to(tensor.device, non_blocking=True)
            start += width

    def encode(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Records of rows given as tensors (weights, then states), as :meth:`pack` makes."""
        return torch.cat([_as_bytes(t.cpu()) for t in tensors], dim=1)


def _row_bytes(tensor: torch.Tensor) -> int:
    return (tensor[0].numel() if tensor.dim() > 1 else 1) * tensor.element_size()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(len(tensor), -1).view(torch.uint8)


class RowCache:
    """The cache rows of one tiered table (see the module docstring).

    Args:
        num_rows: cache rows.
        store: where every row lives.
        codec: moves rows between the cache's buffers and records.
        fresh: the initial records of keys (int64 [n] -> [n, record_bytes] uint8).
        policy: ``"lru"`` or ``"lfu"``: which unpinned rows are evicted first.
        device: where the cache's buffers are (its bookkeeping lives there too).
        name: the table's name, for messages.
    """

    def __init__(
        self,
        num_rows: int,
        store: RowStore,
        codec: RowCodec,
        fresh: Callable[[torch.Tensor], torch.Tensor],
        *,
        policy: str = "lru",
        device: torch.device | str = "cpu",
        name: str = "table",
    ) -> None:
        if policy not in CACHE_POLICIES:
            raise ValueError(f"table {name!r}: cache policy {policy!r}; expected 'lru' or 'lfu'")
        if codec.record_bytes != store.record_bytes:
            raise ValueError(
                f"table {name!r}: the store holds {store.record_bytes}-byte records, its rows "
                f"take {codec.record_bytes}; expected the same"
            )
        self.num_rows, self.store, self.codec, self.fresh = num_rows, store, codec, fresh
        self.policy, self.name = policy, name
        self.device = torch.device(device)
        self.next_ticket = 1
        self.oldest_live = 1
        self.stats = dict.fromkeys(
            ("lookups", "hits", "misses", "fetched", "initialized", "evicted", "written_back"), 0
        )
        self.stats["grown"] = 0  # rows added for batches larger than the cache
        self.clear()

    def clear(self) -> None:
        """Forget every cached row (without writing any back: :meth:`flush` first)."""
        self.index = SlotMap(max(self.num_rows, 1), UNCAPPED, device=self.device, name=self.name)
        self.row_of = torch.full((self.index.capacity,), -1, dtype=torch.int64, device=self.device)
        size = (self.num_rows,)
        self.row_key = torch.full(size, EMPTY_KEY, dtype=torch.int64, device=self.device)
        self.row_score = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.row_ticket = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.row_dirty = torch.zeros(size, dtype=torch.bool, device=self.device)
        # The rows holding no key (row_key == EMPTY_KEY), ascending: taken from the front.
        self.free = torch.arange(self.num_rows, dtype=torch.int64, device=self.device)

    def rows_of(self, keys: torch.Tensor) -> torch.Tensor:
        """The cache row of each key, -1 where not cached."""
        slots = self.index.find(keys)
        return torch.where(slots >= 0, self.row_of[slots.clamp(min=0)], -1)

    def prepare(
        self,
        keys: torch.Tensor,
        counts: torch.Tensor,
        *,
        train: bool,
        admit: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        grow: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Give a batch's distinct ``keys`` (int64 [U]; ``counts``: ids per key) cache rows.

        Args:
            train: the batch trains: its rows become dirty (the fused update writes them).
            admit: for keys the store lacks, which get a fresh row (bool [n]; None: all).
            grow: ``grow(n)`` adds n rows to the cache's buffers, called when the batch needs
                more rows than the cache has unpinned (then this cache is :meth:`extend`-ed by
                n); None: that is an error.

        Returns:
            (the cache row of each key, -1 for a key without a row, the batch's ticket: pass it
            to :meth:`begin` when the batch starts training).

        Raises:
            ValueError: without ``grow``, the batch needs more rows than the cache has
                unpinned (the message names the minimum ``cache_rows``).
        """
        ticket = self.next_ticket
        self.next_ticket += 1
        rows = self.rows_of(keys)
        hit = rows >= 0
        self.stats["lookups"] += len(keys)
        self.stats["hits"] += int(hit.sum())
        self._use(rows[hit], counts[hit], ticket, train)
        missing = (~hit).nonzero().squeeze(1)
        if len(missing):
            rows[missing] = self._fill(keys[missing], counts[missing], ticket, train, admit, grow)
        return rows, ticket

    def begin(self, ticket: int) -> None:
        """The batch of ``ticket`` starts training: every earlier batch is done, so their rows
        are no longer pinned."""
        self.oldest_live = ticket

    def _use(self, rows: torch.Tensor, counts: torch.Tensor, ticket: int, train: bool) -> None:
        self.row_ticket[rows] = ticket
        if self.policy == "lru":
            self.row_score[rows] = ticket
        else:
            self.row_score[rows] += counts.to(self.device)
        if train:
            self.row_dirty[rows] = True

    def _fill(self, keys, counts, ticket: int, train: bool, admit, grow) -> torch.Tensor:
        """Rows for the missing ``keys``: from the store, else fresh where admitted."""
        self.stats["misses"] += len(keys)
        records, present = self.store.read(keys)
        take = present.clone()
        absent = (~present).nonzero().squeeze(1)
        if len(absent):
            allowed = admit(keys[absent], counts[absent]) if admit is not None else None
            chosen = absent if allowed is None else absent[allowed.cpu()]
            if len(chosen):
                records[chosen] = self.fresh(keys[chosen])
                take[chosen] = True
            self.stats["initialized"] += len(chosen)
        self.stats["fetched"] += int(present.sum())
        out = torch.full((len(keys),), -1, dtype=torch.int64, device=self.device)
        wanted = take.nonzero().squeeze(1)
        if not len(wanted):
            return out
        rows = self._free_rows(len(wanted), ticket, grow)
        self.codec.unpack(rows, records[wanted])
        new_keys = keys[wanted].to(self.device)
        insertion = self.index.insert(new_keys, torch.ones_like(new_keys), 0)
        if insertion.moved is not None:
            row_of = torch.full((self.index.capacity,), -1, dtype=torch.int64, device=self.device)
            row_of[insertion.moved[1]] = self.row_of[insertion.moved[0]]
            self.row_of = row_of
        self.row_of[insertion.slots] = rows
        self.row_key[rows] = new_keys
        self.row_score[rows] = 0
        self.row_dirty[rows] = False
        self._use(rows, counts[wanted], ticket, train)
        out[wanted.to(self.device)] = rows
        return out

    def _free_rows(self, count: int, ticket: int, grow=None) -> torch.Tensor:
        """``count`` rows to fill: free ones first (lowest first), then evicted ones (lowest
        score first, never a pinned one), written back when dirty; with ``grow``, new rows
        for what neither gives."""
        free = self.free
        if len(free) >= count:
            self.free = free[count:]
            return free[:count]
        unpinned = self.row_ticket < self.oldest_live
        if len(free):  # free rows hold no key: not candidates
            unpinned &= self.row_key != EMPTY_KEY
        candidates = unpinned.nonzero().squeeze(1)
        short = count - len(free) - len(candidates)
        if short > 0:
            if grow is None:
                self._raise_full(count, ticket)
            grow(short)
            self.extend(short)
            free = self.free
        needed = count - len(free)
        if needed <= 0:
            self.free = free[count:]
            return free[:count]
        scores = self.row_score.index_select(0, candidates)
        victims = candidates[torch.topk(scores, needed, largest=False, sorted=False).indices]
        self.evict(victims)
        self.free = free[:0]  # the free rows and the victims are all filled now
        return torch.cat([free, victims])

    def extend(self, count: int) -> None:
        """``count`` more rows (free), after the owner grew its buffers by as many: the new rows
        are ``num_rows ..`` (the row past the cache moves past them)."""
        size, device = (count,), self.device
        self.row_key = torch.cat([self.row_key, torch.full(size, EMPTY_KEY, device=device)])
        zeros = torch.zeros(size, dtype=torch.int64, device=device)
        self.row_score = torch.cat([self.row_score, zeros])
        self.row_ticket = torch.cat([self.row_ticket, zeros])
        self.row_dirty = torch.cat([self.row_dirty, zeros.bool()])
        new = torch.arange(self.num_rows, self.num_rows + count, device=device)
        self.free = torch.cat([self.free, new])
        self.num_rows += count
        self.stats["grown"] += count

    def evict(self, rows: torch.Tensor) -> None:
        """Write back the dirty ones of cache ``rows`` (distinct, each holding a key) and free
        them all."""
        self.write_back(rows[self.row_dirty[rows]])
        self.index.remove(self.row_key[rows])
        self.row_key[rows] = EMPTY_KEY
        self.row_dirty[rows] = False
        self.stats["evicted"] += len(rows)
        self.free = torch.cat([self.free, rows.to(self.device)]).sort().values

    def write_back(self, rows: torch.Tensor) -> None:
        """Copy cache ``rows`` to the store; they are clean after."""
        if len(rows):
            self.store.write(self.row_key[rows].cpu(), self.codec.pack(rows))
            self.row_dirty[rows] = False
            self.stats["written_back"] += len(rows)

    def flush(self) -> None:
        """Write every dirty row back: the store then holds the whole table. Rows of pinned
        batches (prepared, or in flight) stay dirty: their update may be still to come."""
        dirty = self.row_dirty.nonzero().squeeze(1)
        self.write_back(dirty)
        self.row_dirty[dirty[self.row_ticket[dirty] >= self.oldest_live]] = True

    def pinned_rows(self) -> int:
        """Rows holding a key that a batch in flight or prepared uses."""
        return int(((self.row_ticket >= self.oldest_live) & (self.row_key != EMPTY_KEY)).sum())

    def _raise_full(self, count: int, ticket: int) -> None:
        mine = int((self.row_ticket == ticket).sum())
        others = self.pinned_rows() - mine
        raise CacheTooSmallError({self.name: (self.num_rows, count + mine)}, others)
