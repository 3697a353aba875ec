"""Full-corpus next-item ranking metrics: HR@k, NDCG@k and MRR of a retrieval model.

For a user with query vector q and target item t, every item i of the corpus gets the score
``q . e_i``; the target's rank r (0 = first) is the number of other candidate items scoring at
least as high as it. Ties count against the target, so a model that scores every item alike
ranks each target last, not first. Candidates are every item id from ``first_item`` on (ids
below it are reserved: padding, missing, rare), minus, with ``exclude``, the items of the
user's history other than the target. A target that is not a candidate (a reserved id, e.g. an
item unseen in training) is a miss. Then, per user,

    HR@k = [r < k],   NDCG@k = [r < k] / log2(r + 2),   MRR = 1 / (r + 1)

averaged over users. With ``keys`` (a dynamic item table's corpus: the ids it holds a row
for), row i of the items is id ``keys[i]``, every row is a candidate and a target it lacks is a
miss. Scores are computed in float64 in chunks of ``chunk_items`` items
([B, chunk] at a time, never [B, N]), so a corpus of millions of items fits. Under
torch.distributed, :meth:`RankingMetrics.compute` sums over the ranks, so each rank evaluates
its own users and every rank gets the metrics of all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["RankingMetrics", "target_ranks"]


def target_ranks(
    queries: torch.Tensor,
    items: torch.Tensor,
    targets: torch.Tensor,
    *,
    first_item: int = 0,
    exclude: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_items: int = 65536,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each user's target rank among the candidates (see the module docstring); -1 where the
    target is not a candidate.

    Args:
        queries: [B, D] one query vector per user.
        items: [N, D] the item table (row i: item id i), or with ``keys`` the corpus.
        targets: [B] int64 target item ids.
        first_item: the first candidate id (ids below are reserved).
        exclude: (values [L], offsets [B + 1]) int64: each user's items not to rank (their
            history); the target itself is never excluded.
        chunk_items: items scored at a time.
        keys: [N] int64 ascending: the item id of each row of ``items`` (a dynamic item
            table's corpus: the keys it holds). Every row is a candidate; a target outside
            ``keys`` is a miss, and ids of ``exclude`` outside it are ignored.

    Raises:
        ValueError: mismatched shapes, a target outside [0, N), or chunk_items < 1.
    """
    batch, num_items = queries.shape[0], items.shape[0]
    if queries.dim() != 2 or items.dim() != 2 or queries.shape[1] != items.shape[1]:
        raise ValueError(
            f"queries {tuple(queries.shape)} and items {tuple(items.shape)} must be [B, D] and "
            "[N, D] with the same D"
        )
    if targets.shape != (batch,):
        raise ValueError(f"targets {tuple(targets.shape)}: expected one per query, ({batch},)")
    if chunk_items < 1:
        raise ValueError(f"chunk_items = {chunk_items}; expected >= 1")
    known = None
    if keys is not None:
        if keys.shape != (num_items,):
            raise ValueError(f"keys {tuple(keys.shape)}: expected one per item, ({num_items},)")
        targets, known = _rows_of(keys, targets)
        if exclude is not None:
            rows, found = _rows_of(keys, exclude[0])
            # an unknown excluded id excludes the target's own row: a no-op (never excluded)
            target_of = torch.repeat_interleave(targets, exclude[1].diff(), output_size=len(rows))
            exclude = (torch.where(found, rows, target_of), exclude[1])
        first_item = 0
        if not num_items:  # an empty corpus: every target a miss
            return torch.full_like(targets, -1)
    if batch and (targets.min() < 0 or targets.max() >= num_items):
        raise ValueError(
            f"target ids span [{int(targets.min())}, {int(targets.max())}]; the item table has "
            f"{num_items} rows (ids 0..{num_items - 1})"
        )
    q = queries.detach().double()
    rows = torch.arange(batch, device=q.device)
    target_scores = (q * items.detach()[targets].double()).sum(dim=1)  # [B]
    ahead = torch.zeros(batch, dtype=torch.int64, device=q.device)
    pairs = None
    if exclude is not None:
        values, offsets = exclude
        user = torch.repeat_interleave(rows, offsets.diff(), output_size=values.numel())
        keep = values != targets[user]  # the target is ranked even when in the history
        pairs = (user[keep], values[keep])
    for start in range(first_item, num_items, chunk_items):
        stop = min(start + chunk_items, num_items)
        scores = q @ items.detach()[start:stop].double().t()  # [B, C]
        if pairs is not None:
            inside = (pairs[1] >= start) & (pairs[1] < stop)
            scores[pairs[0][inside], pairs[1][inside] - start] = -math.inf
        mine = (targets >= start) & (targets < stop)
        scores[rows[mine], targets[mine] - start] = -math.inf  # not counted against itself
        ahead += (scores >= target_scores[:, None]).sum(dim=1)
    candidate = targets >= first_item if known is None else known
    return torch.where(candidate, ahead, -1)


def _rows_of(keys: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row of each of ``ids`` in ascending ``keys``, 0 where absent; whether present)."""
    if not keys.numel():
        return torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    at = torch.searchsorted(keys, ids).clamp(max=keys.numel() - 1)
    found = keys[at] == ids
    return torch.where(found, at, 0), found


class RankingMetrics:
    """Accumulates HR@k and NDCG@k for each k in ``ks``, and MRR, over batches of users (see
    the module docstring).

    Args:
        ks: the cut-offs (default 10 and 50).
        first_item / chunk_items: as :func:`target_ranks`.
    """

    def __init__(
        self, ks: Sequence[int] = (10, 50), *, first_item: int = 0, chunk_items: int = 65536
    ) -> None:
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"ks = {list(ks)}; expected cut-offs >= 1")
        self.ks = tuple(sorted(set(ks)))
        self.first_item = first_item
        self.chunk_items = chunk_items
        self.reset()

    def reset(self) -> None:
        self._sums: torch.Tensor | None = None  # [2 * len(ks) + 2]: hr, ndcg per k, mrr, users

    def update(
        self,
        queries: torch.Tensor,
        items: torch.Tensor,
        targets: torch.Tensor,
        exclude: tuple[torch.Tensor, torch.Tensor] | None = None,
        keys: torch.Tensor | None = None,
    ) -> None:
        """Add a batch of users (arguments as :func:`target_ranks`)."""
        rank = target_ranks(
            queries,
            items,
            targets,
            first_item=self.first_item,
            exclude=exclude,
            chunk_items=self.chunk_items,
            keys=keys,
        )
        hit = rank >= 0
        r = rank.clamp(min=0).double()
        parts = []
        for k in self.ks:
            top = hit & (rank < k)
            parts.append(top.double().sum())
            parts.append(torch.where(top, 1.0 / torch.log2(r + 2), 0.0).sum())
        parts.append(torch.where(hit, 1.0 / (r + 1), 0.0).sum())
        parts.append(torch.tensor(float(len(rank)), dtype=torch.float64, device=rank.device))
        sums = torch.stack(parts)
        self._sums = sums if self._sums is None else self._sums + sums

    def compute(self) -> dict[str, float]:
        """The metrics over every user added (on every rank, under torch.distributed)."""
        sums = self._sums
        if sums is None:
            sums = torch.zeros(2 * len(self.ks) + 2, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            sums = sums.clone()
            dist.all_reduce(sums)
        values = sums.tolist()
        users = values[-1]
        if not users:
            raise ValueError("no users were added: nothing to compute")
        out = {}
        for i, k in enumerate(self.ks):
            out[f"hr@{k}"] = values[2 * i] / users
            out[f"ndcg@{k}"] = values[2 * i + 1] / users
        out["mrr"] = values[-2] / users
        return out
