"""Next-item training losses for retrieval models such as :class:`~recsys.models.sasrec.SASRec`:
sampled softmax (in-batch and uniform negatives, logQ-corrected) and full softmax.

Each training position p has a hidden state h_p and a target item t_p. **Full softmax**: the
cross-entropy of ``h_p . e_i`` over every candidate item (ids from ``first_item`` on). **Sampled
softmax**: the cross-entropy over the target and S shared negatives, drawn with replacement:
``in_batch`` of them are targets of random positions of the batch (so popular items are drawn
as often as they are targets) and ``uniform`` are ids uniform over the candidates. A negative j
enters with logit ``h_p . e_j - log(E[count of j among the S draws])`` (the logQ correction,
which makes the sampled loss's gradient an unbiased-in-the-limit estimate of the full softmax's
despite the popularity bias of in-batch draws), where ``E[count] = in_batch * c_j / P +
uniform / N'`` (c_j: j's count among the P targets; N': candidates); a negative equal to the
position's own target is masked (an accidental hit). Draws use the generator given, and need
no host read: counts are kept per item in a fixed-size tensor.

A **dynamic item table** (raw item keys, ``model.item_keys()`` not None) has no id range: the
candidates are the keys it holds (its corpus, reserved ids below ``first_item`` left out), so
uniform negatives are drawn from those keys (none at the first step, when it holds none), a
negative's count among the targets is counted by comparison ([P, S]), and full softmax ranks
the corpus and the batch's targets. Sharded over ranks (KEY_WISE), ``item_keys()`` gathers
every rank's keys, so each rank draws from the whole corpus.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recsys.data.sequence_batches import SequenceBatch
from recsys.models.sasrec import SASRec

__all__ = ["corpus_keys", "next_item_loss"]


def next_item_loss(
    model: SASRec,
    batch: SequenceBatch,
    *,
    in_batch: int = 128,
    uniform: int = 128,
    full_softmax: bool = False,
    first_item: int = 0,
    generator: torch.Generator | None = None,
    logq: bool = True,
) -> torch.Tensor:
    """The mean next-item loss of ``batch`` (a train batch: targets per position) under
    ``model`` (see the module docstring); ``logq=False`` leaves the sampled negatives' logits
    uncorrected.

    Raises:
        ValueError: not a train batch, no negatives asked for, or first_item past the items.
    """
    if not batch.next_item:
        raise ValueError("next_item_loss needs a train batch (a next-item target per position)")
    if not full_softmax and in_batch + uniform < 1:
        raise ValueError(f"in_batch={in_batch} + uniform={uniform}: no negatives to sample")
    inner = getattr(model, "module", model)  # through a DDP wrapper
    corpus = inner.item_keys()
    if corpus is not None:
        options = dict(in_batch=in_batch, uniform=uniform, generator=generator, logq=logq)
        if full_softmax:
            return _keyed_full_softmax(model, batch, corpus_keys(corpus, first_item))
        return _keyed_sampled_softmax(model, batch, corpus_keys(corpus, first_item), **options)
    num_items = inner.num_items
    if not 0 <= first_item < num_items:
        raise ValueError(f"first_item={first_item}; the item table has {num_items} rows")
    targets = batch.targets
    device = targets.device
    positions = targets.numel()
    if full_softmax:
        candidates = torch.arange(first_item, num_items, device=device)
        hidden, vectors = _forward(model, batch, candidates)
        logits = hidden @ vectors.t()  # [P, N']
        return F.cross_entropy(logits, targets - first_item)
    draws = [
        targets[_draw(0, max(positions, 1), in_batch, generator, device)]
        if positions
        else targets.new_zeros(0),
        _draw(first_item, num_items, uniform, generator, device),
    ]
    negatives = torch.cat(draws)
    hidden, vectors = _forward(model, batch, torch.cat([targets, negatives]))
    positive = (hidden * vectors[:positions]).sum(dim=1, keepdim=True)  # [P, 1]
    logits = hidden @ vectors[positions:].t()  # [P, S]
    if logq:
        counts = torch.zeros(num_items, device=device).index_add_(
            0, targets, torch.ones(positions, device=device)
        )
        expected = in_batch * counts[negatives] / max(positions, 1)
        expected = expected + uniform / (num_items - first_item)
        logits = logits - torch.log(expected)[None, :]
    logits = logits.masked_fill(negatives[None, :] == targets[:, None], float("-inf"))
    both = torch.cat([positive, logits], dim=1)
    return F.cross_entropy(both, torch.zeros(positions, dtype=torch.int64, device=device))


def _forward(
    model, batch: SequenceBatch, candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden state of each target's position [P, D] and the candidates' vectors: every
    position's, or with ``batch.target_positions`` (rows that count their last position only)
    those positions'."""
    hidden, vectors = model(batch.items, batch.max_length, candidates, batch.times)
    if batch.target_positions is not None:
        hidden = hidden[batch.target_positions]
    return hidden, vectors


def corpus_keys(keys: torch.Tensor, first_item: int) -> torch.Tensor:
    """The candidates among a dynamic item table's ``keys`` (ascending): all but the reserved
    ids ``0 .. first_item - 1`` (raw keys reserve none: ``first_item`` 0)."""
    return keys[(keys < 0) | (keys >= first_item)] if first_item > 0 else keys


def _keyed_full_softmax(model, batch: SequenceBatch, corpus: torch.Tensor) -> torch.Tensor:
    """Full softmax over a dynamic table's corpus and the batch's targets (a target new to the
    table gets its row in this forward)."""
    targets = batch.targets
    candidates = torch.unique(torch.cat([corpus, targets]))  # ascending
    hidden, vectors = _forward(model, batch, candidates)
    logits = hidden @ vectors.t()  # [P, N']
    return F.cross_entropy(logits, torch.searchsorted(candidates, targets))


def _keyed_sampled_softmax(
    model,
    batch: SequenceBatch,
    corpus: torch.Tensor,
    *,
    in_batch: int,
    uniform: int,
    generator: torch.Generator | None,
    logq: bool,
) -> torch.Tensor:
    """Sampled softmax over raw item keys: uniform negatives are drawn from the keys the
    dynamic table holds (none while it is empty, at the first step), and a negative's count
    among the targets is counted by comparison (no table indexed by key)."""
    targets = batch.targets
    device = targets.device
    positions = targets.numel()
    num_keys = corpus.numel()
    uniform = uniform if num_keys else 0
    draws = [
        targets[_draw(0, max(positions, 1), in_batch, generator, device)]
        if positions
        else targets.new_zeros(0)
    ]
    if uniform:
        picks = _draw(0, num_keys, uniform, generator, device)
        draws.append(corpus[picks])
    negatives = torch.cat(draws)
    hidden, vectors = _forward(model, batch, torch.cat([targets, negatives]))
    positive = (hidden * vectors[:positions]).sum(dim=1, keepdim=True)  # [P, 1]
    logits = hidden @ vectors[positions:].t()  # [P, S]
    hits = negatives[None, :] == targets[:, None]  # [P, S]
    if logq:
        counts = hits.sum(dim=0, dtype=torch.float32)  # [S] each negative among the targets
        expected = in_batch * counts / max(positions, 1)
        if uniform:
            expected = expected + uniform / num_keys
        logits = logits - torch.log(expected)[None, :]
    logits = logits.masked_fill(hits, float("-inf"))
    both = torch.cat([positive, logits], dim=1)
    return F.cross_entropy(both, torch.zeros(positions, dtype=torch.int64, device=device))


def _draw(
    low: int, high: int, count: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """``count`` ints uniform in [low, high), drawn on the host by ``generator`` (the same on
    every device) and copied without blocking (a copy that waits would stall the step)."""
    return torch.randint(low, high, (count,), generator=generator).to(device, non_blocking=True)
