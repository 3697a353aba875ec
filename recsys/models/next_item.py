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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recsys.data.sequence_batches import SequenceBatch
from recsys.models.sasrec import SASRec

__all__ = ["next_item_loss"]


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
    num_items = getattr(model, "module", model).num_items  # through a DDP wrapper
    if not 0 <= first_item < num_items:
        raise ValueError(f"first_item={first_item}; the item table has {num_items} rows")
    if not full_softmax and in_batch + uniform < 1:
        raise ValueError(f"in_batch={in_batch} + uniform={uniform}: no negatives to sample")
    targets = batch.targets
    device = targets.device
    positions = targets.numel()
    if full_softmax:
        candidates = torch.arange(first_item, num_items, device=device)
        hidden, vectors = model(batch.items, batch.max_length, candidates)
        logits = hidden @ vectors.t()  # [P, N']
        return F.cross_entropy(logits, targets - first_item)
    draws = [
        targets[torch.randint(0, max(positions, 1), (in_batch,), generator=generator).to(device)]
        if positions
        else targets.new_zeros(0),
        torch.randint(first_item, num_items, (uniform,), generator=generator).to(device),
    ]
    negatives = torch.cat(draws)
    hidden, vectors = model(batch.items, batch.max_length, torch.cat([targets, negatives]))
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
