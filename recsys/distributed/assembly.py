"""Pooled vectors back in the model's order after the output dist, and their gradients out.

The output dist hands rank r one flat buffer: from each rank d a block [B, w_d] of pooled
columns (rank d's block after rank d-1's, the **blocks** layout; the same columns side by side
in one [B, sum_d w_d] matrix are the **matrix** layout). The model wants [B, N] in its own key
order: table-wise and column-wise pieces move, the partial sums of a row-wise (or key-wise)
feature's shards add up, in shard order (a feature with fewer shards than the most adds a zero
for each missing one), then divide by the bag length under mean pooling, and the replicated
tables' pooled vectors slot in.

Every move is a gather of whole **chunks**: ``c`` columns, the gcd of every piece's width, so no
piece splits one. Forward works in one **pool** of chunks::

    [received (B * sum_d w_d) | one zero chunk | row-wise sums (B * N_rw) | replicated (B * N_dp)]

the exchange writes the received part in place, the row-wise parts (strided views of it where
they lie in order) are added into theirs one after another, and one gather of chunks builds the
output (none at all where the output is one contiguous range of the pool, as when every table
is row-wise). Backward is one gather from
the output gradient (its row-wise mean columns scaled first) straight into the buffer the
exchange sends, one contiguous block per destination; no zero-filled buffer, no scatter.

Each chunk of a region sits at ``alpha * B + b * s + k`` (chunk units) for sample b, so the
index tables of a batch size are a few vector ops, built once on the host (where a gather that
is a contiguous range is found and skipped) and cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_CACHED = 8  # batch sizes whose index tables are kept


class ScratchBuffers:
    """Buffers kept from one step to the next, by name, for tensors that die within a step.

    On CPU a fresh large tensor costs its page faults (about as much as writing it once more),
    so :meth:`take` hands the same buffer out again, but only once nothing else holds its
    storage (every view given out before has died); otherwise, and on other devices (whose
    caching allocators already reuse memory), a fresh one."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized 1-D tensor of ``numel`` elements."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        buffer = self._buffers.get(name)
        free = buffer is not None and _sole_holder(buffer)
        if not free or buffer.dtype != dtype or buffer.device != device or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel]


def _add_parts(parts: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = ``parts`` [P, M] added one after another in order, ((p0 + p1) + p2) + ...,
    with no pass to zero ``out`` first. (torch.sum over P gives the same for P <= 4; past
    that its order depends on M.)"""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for p in range(2, len(parts)):
        out.add_(parts[p])


def _sole_holder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the only holder of its storage (``untyped_storage()`` adds one)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) == 2


@dataclass(frozen=True)
class Chunks:
    """Chunk addresses ``alpha * B + b * s + k`` for b < B, one (alpha, s, k) per column."""

    alpha: torch.Tensor  # int64 [...]
    s: torch.Tensor
    k: torch.Tensor

    def at(self, batch: int) -> torch.Tensor:
        """[B, ...] positions in the pool (int64, on the host)."""
        b = torch.arange(batch).view(batch, *[1] * self.alpha.dim())
        return self.alpha * batch + self.k + b * self.s


@dataclass(frozen=True)
class Gather:
    """A gather of chunks: ``index`` (on the device) or, where it is the contiguous range from
    chunk ``start``, nothing (``index`` None)."""

    index: torch.Tensor | None
    start: int
    count: int

    @classmethod
    def of(cls, positions: torch.Tensor, device: torch.device) -> Gather:
        flat = positions.reshape(-1)
        start = int(flat[0]) if flat.numel() else 0
        if torch.equal(flat, torch.arange(start, start + flat.numel())):
            return cls(None, start, flat.numel())
        return cls(flat.to(device), start, flat.numel())

    def __call__(self, chunks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The gathered chunks of ``chunks`` [M, c]: [count, c] (a view where contiguous, else
        written into ``out`` when given)."""
        if self.index is None:
            return chunks[self.start : self.start + self.count]
        if out is None:
            return chunks.index_select(0, self.index)
        return torch.index_select(chunks, 0, self.index, out=out)


@dataclass(frozen=True)
class BatchIndex:
    """The gathers of one batch size: forward (``parts`` [P, B, N_rw], ``output`` [B, N]),
    backward (``send`` per destination block, ``rw_grad`` the row-wise output columns,
    ``dp_grad`` the replicated ones)."""

    batch: int
    pool_chunks: int
    parts: Gather | None
    output: Gather
    send: list[Gather]
    rw_grad: Gather | None
    dp_grad: Gather | None


class PooledAssembly:
    """The column maps of one rank's output dist, from the pieces every rank sends.

    Args:
        widths: columns of each rank's block (rank d sends [B, widths[d]]).
        features: per output feature, in the model's order, one of
            ``("direct", [(rank, first column in its block, columns), ...])`` (pieces in output
            order), ``("sum", dim, [(rank, first column in its block), ...], mean)`` (partial
            sums in the order they add up) or ``("replicated", dim)`` (the next ``dim`` columns
            of the replicated tables' pooled vectors).
        device: where the index tables live.
    """

    def __init__(self, widths: list[int], features: list[tuple], device: torch.device) -> None:
        self.widths, self.device = list(widths), device
        sizes = [w for w in widths if w]
        for feature in features:
            if feature[0] not in ("direct", "sum", "replicated"):
                raise ValueError(
                    f"feature {feature!r}: expected 'direct', 'sum' or 'replicated' first"
                )
            if feature[0] == "direct":
                for _, start, num_cols in feature[1]:
                    sizes += [start, num_cols]
            else:
                sizes.append(feature[1])
                if feature[0] == "sum":
                    sizes += [start for _, start in feature[2]]
        self.chunk = c = math.gcd(*sizes) or 1
        self.block_chunks = [w // c for w in widths]  # wc_d
        self.received_chunks = sum(self.block_chunks)
        self.num_parts = max((len(f[2]) for f in features if f[0] == "sum"), default=0)
        # Output chunks: (region, value) with region "recv" (rank, chunk in block), "sum" (row-
        # wise chunk q) or "dp" (replicated chunk i); and the row-wise chunks' parts.
        out: list[tuple[str, object]] = []
        parts: list[list[tuple[int, int] | None]] = []  # [N_rw chunks][P]: (rank, chunk) | zero
        sum_feature, sum_mean = [], []
        num_dp = 0
        for f, feature in enumerate(features):
            if feature[0] == "direct":
                for rank, start, n in feature[1]:
                    out += [("recv", (rank, start // c + i)) for i in range(n // c)]
            elif feature[0] == "sum":
                _, dim, pieces, mean = feature
                for i in range(dim // c):
                    out.append(("sum", len(parts)))
                    part = [(rank, start // c + i) for rank, start in pieces]
                    parts.append(part + [None] * (self.num_parts - len(part)))
                    sum_feature.append(f)
                    sum_mean.append(bool(mean))
            else:
                out += [("dp", num_dp + i) for i in range(feature[1] // c)]
                num_dp += feature[1] // c
        self.output_chunks, self.sum_chunks, self.dp_chunks = len(out), len(parts), num_dp
        self.missing_parts = any(None in chunk_parts for chunk_parts in parts)
        self.width = len(out) * c
        self._out, self._parts = out, parts
        self.sum_feature = torch.tensor(sum_feature, dtype=torch.int64, device=device)
        self.sum_mean = torch.tensor(sum_mean, dtype=torch.bool, device=device)
        self.any_mean = any(sum_mean)
        self._cache: dict[tuple[int, str], BatchIndex] = {}
        self.scratch = ScratchBuffers()

    @classmethod
    def exchange_order(cls, widths: list[int], device: torch.device) -> PooledAssembly:
        """The identity: rank d's columns after rank d-1's."""
        features = [("direct", [(d, 0, w)]) for d, w in enumerate(widths) if w]
        return cls(widths, features, device)

    # -----------------------------------------------------------------------------------------
    # Addresses

    def _recv(self, rank: int, chunk: int, layout: str) -> tuple[int, int, int]:
        before = sum(self.block_chunks[:rank])
        if layout == "blocks":
            return before, self.block_chunks[rank], chunk
        return 0, self.received_chunks, before + chunk

    def _address(self, where: tuple[str, object] | None, layout: str) -> tuple[int, int, int]:
        """(alpha, s, k) of a pool chunk; None: the zero chunk."""
        rc = self.received_chunks
        if where is None:
            return rc, 0, 0
        region, value = where
        if region == "recv":
            return self._recv(*value, layout)
        if region == "sum":
            return rc, self.sum_chunks, 1 + value
        return rc + self.sum_chunks, self.dp_chunks, 1 + value

    @staticmethod
    def _chunks(addresses: list[tuple[int, int, int]], shape: tuple[int, ...]) -> Chunks:
        table = torch.tensor(addresses, dtype=torch.int64).view(*shape, 3)
        return Chunks(table[..., 0], table[..., 1], table[..., 2])

    def index(self, batch: int, layout: str = "blocks") -> BatchIndex:
        """The gathers of a batch of ``batch`` samples whose received columns come in
        ``layout`` ("blocks" or "matrix"); cached."""
        key = (batch, layout)
        if key not in self._cache:
            if len(self._cache) >= MAX_CACHED:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = self._build(batch, layout)
        return self._cache[key]

    def _build(self, batch: int, layout: str) -> BatchIndex:
        device, num_out = self.device, self.output_chunks
        pool = (self.received_chunks + self.sum_chunks + self.dp_chunks) * batch + 1
        output = self._chunks([self._address(w, layout) for w in self._out], (num_out,))
        parts = None
        if self.sum_chunks:
            by_part = [
                [self._address(None if p is None else ("recv", p), layout) for p in chunk_parts]
                for chunk_parts in self._parts
            ]  # [N_rw][P]
            table = self._chunks(
                [a for row in zip(*by_part, strict=True) for a in row], (self.num_parts, -1)
            )
            parts = Gather.of(table.at(batch).transpose(0, 1), device)  # [P, B, N_rw]
        # Backward: each received chunk's gradient is one chunk of [grad (B * N) | row-wise
        # mean-scaled (B * N_rw)]: which one, per block.
        feeds: dict[tuple[int, int], tuple[int, int, int]] = {}
        for j, (region, value) in enumerate(self._out):
            if region == "recv":
                feeds[value] = (0, num_out, j)
            elif region == "sum":
                source = (num_out, self.sum_chunks, value) if self.any_mean else (0, num_out, j)
                for part in self._parts[value]:
                    if part is not None:
                        feeds[part] = source
        send = []
        for rank, wc in enumerate(self.block_chunks):
            table = self._chunks([feeds[(rank, i)] for i in range(wc)], (wc,))
            send.append(Gather.of(table.at(batch), device))

        def columns(region: str) -> Gather | None:
            picked = [(0, num_out, j) for j, (r, _) in enumerate(self._out) if r == region]
            return Gather.of(self._chunks(picked, (-1,)).at(batch), device) if picked else None

        return BatchIndex(
            batch=batch,
            pool_chunks=pool,
            parts=parts,
            output=Gather.of(output.at(batch), device),
            send=send,
            rw_grad=columns("sum"),
            dp_grad=columns("dp"),
        )

    # -----------------------------------------------------------------------------------------
    # Forward and backward

    def new_pool(self, index: BatchIndex, device: torch.device) -> torch.Tensor:
        """An uninitialized pool [pool chunks, c] (a scratch buffer); its first B * sum_d w_d
        values are where the received columns go (:meth:`forward` writes the rest)."""
        numel = index.pool_chunks * self.chunk
        return self.scratch.take("pool", numel, torch.float32, device).view(-1, self.chunk)

    def mean_scale(self, lengths: torch.Tensor, batch: int) -> torch.Tensor | None:
        """[B, N_rw / c, 1] the factor of each row-wise chunk: 1 / bag length (at least 1)
        under mean pooling, else 1; None where no row-wise feature pools by mean."""
        if not self.any_mean:
            return None
        bag_sizes = lengths.index_select(0, self.sum_feature).clamp(min=1).float()  # [N_rw, B]
        scale = torch.where(self.sum_mean.unsqueeze(1), 1.0 / bag_sizes, 1.0)
        return scale.t().unsqueeze(2)

    def forward(
        self,
        pool: torch.Tensor,
        pooled_dp: torch.Tensor | None,
        scale: torch.Tensor | None,
        index: BatchIndex,
    ) -> torch.Tensor:
        """[B, N] in the model's order from a pool whose received part is filled; ``scale``
        from :meth:`mean_scale`."""
        batch, rc = index.batch, self.received_chunks * index.batch
        if self.missing_parts:
            pool[rc].zero_()
        if index.parts is not None:
            sums = pool[rc + 1 : rc + 1 + batch * self.sum_chunks]
            parts = index.parts(pool).view(self.num_parts, sums.numel())
            _add_parts(parts, sums.view(-1))
            if scale is not None:
                sums.view(batch, self.sum_chunks, self.chunk).mul_(scale)
        if self.dp_chunks:
            start = rc + 1 + batch * self.sum_chunks
            pool[start:].view(batch, self.dp_chunks * self.chunk).copy_(pooled_dp)
        out = None  # a scratch buffer too: a new one while the last step's output lives
        if index.output.index is not None:
            numel = index.output.count * self.chunk
            out = self.scratch.take("output", numel, torch.float32, pool.device)
            out = out.view(-1, self.chunk)
        return index.output(pool, out=out).view(batch, self.width)

    def backward(
        self, grad: torch.Tensor, scale: torch.Tensor | None, grad_scale: float, index: BatchIndex
    ) -> torch.Tensor:
        """The gradient of the received blocks, flat in the blocks layout (what the exchange
        sends back), times ``grad_scale``: each row-wise part gets its sum's gradient (times
        ``scale`` first under mean pooling)."""
        batch, c = index.batch, self.chunk
        grad = grad.float().contiguous().view(-1, c)  # [B * N / c, c]
        source = grad
        if scale is not None:
            scaled = index.rw_grad(grad).view(batch, self.sum_chunks, c) * scale
            source = torch.cat([grad, scaled.view(-1, c)])
        widths = [g.count for g in index.send]
        send = self.scratch.take("send", sum(widths) * c, torch.float32, grad.device).view(-1, c)
        blocks = send.split(widths)
        if all(g.index is None for g in index.send):  # row ranges of the gradient: scaled once
            for gather, block in zip(index.send, blocks, strict=True):
                torch.mul(gather(source), grad_scale, out=block)
            return send.view(-1)
        for gather, block in zip(index.send, blocks, strict=True):
            if gather.index is None:
                block.copy_(gather(source))
            else:
                gather(source, out=block)
        if grad_scale != 1.0:
            send.mul_(grad_scale)
        return send.view(-1)

    def dp_grad(self, grad: torch.Tensor, index: BatchIndex) -> torch.Tensor | None:
        """The replicated tables' columns of ``grad`` [B, N]: [B, N_dp]."""
        if index.dp_grad is None:
            return None
        chunks = grad.float().contiguous().view(-1, self.chunk)
        return index.dp_grad(chunks).view(index.batch, self.dp_chunks * self.chunk)
