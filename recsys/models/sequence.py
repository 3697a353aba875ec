"""What every sequence retrieval model here shares: one unpooled item table looked up once per
step for the history and the candidates, learned absolute positions, and the user and item
vectors that full-corpus ranking scores.

Positions (``positions``) count either back from each history's most recent event
(``"from_end"``: the last event always at 0) or from its oldest (``"from_start"``: event j at j,
as SASRec's paper and RecBole number them). Under the causal loss every position of a training
row predicts the next item. With ``"from_start"`` position j of a row sees exactly the inputs a
history of j + 1 events is ranked with; with ``"from_end"`` a row's earlier positions see their
events numbered by the distance from the row's end, which no ranked history has (its last event
is at 0), so only a row's last position trains what ranking reads.

A model subclasses :class:`SequenceEncoder` and implements :meth:`SequenceEncoder.encode`, which
turns the position-aware inputs of every event (jagged, ``[sum L, D]``) into hidden states of
the same layout. ``forward(history, max_length, candidates)`` returns those and the candidates'
vectors, the contract :func:`recsys.models.next_item.next_item_loss` trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.ops.jagged.dense_add import jagged_dense_add

__all__ = ["CANDIDATES", "HISTORY", "POSITIONS", "Events", "SequenceEncoder"]

HISTORY, CANDIDATES = "history", "candidates"
POSITIONS = ("from_end", "from_start")
"""How a history's events are numbered for the learned positions (``SequenceEncoder``)."""


@dataclass
class Events:
    """The events of a batch of histories, jagged: ``x`` [sum L, D] the model's inputs
    (``input_scale * e(item) + p(position)``), ``user`` and ``column`` [sum L] each event's
    history and place in it, ``lengths`` [B] and ``offsets`` [B + 1] the histories,
    ``max_length`` the longest (host-known), and ``times`` [sum L] the events' times (None
    when the caller passed none)."""

    x: torch.Tensor
    user: torch.Tensor
    column: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    max_length: int
    times: torch.Tensor | None = None


class SequenceEncoder(nn.Module):
    """Base of the sequence retrieval models (see the module docstring).

    Args:
        embeddings: an unpooled embedding collection with one table whose features are
            ``history`` and ``candidates`` (:data:`HISTORY`, :data:`CANDIDATES`).
        max_len: the longest history (learned positions 0 .. max_len - 1).
        positions: ``"from_end"`` or ``"from_start"`` (see the module docstring).
    """

    def __init__(
        self, embeddings: nn.Module, *, max_len: int, positions: str = "from_start"
    ) -> None:
        super().__init__()
        name = type(self).__name__
        configs = embeddings.embedding_configs()
        features = [sorted(c.feature_names) for c in configs]
        if len(configs) != 1 or features[0] != sorted([HISTORY, CANDIDATES]):
            raise ValueError(
                f"{name} needs one item table with features {[HISTORY, CANDIDATES]}; the "
                f"collection has tables {[c.name for c in configs]} with features {features}"
            )
        if max_len < 1:
            raise ValueError(f"max_len={max_len}; expected >= 1")
        if positions not in POSITIONS:
            raise ValueError(f"positions={positions!r}; expected one of {POSITIONS}")
        self.embeddings, self.max_len, self.positions_from = embeddings, max_len, positions
        self.dim = configs[0].embedding_dim
        self.item_table = configs[0].name
        # A dynamic item table: the rows it started with (its corpus is item_keys()).
        self.num_items = configs[0].num_embeddings
        self.positions = nn.Embedding(max_len, self.dim)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.input_scale = math.sqrt(self.dim)
        """The item vectors' scale in the input ``input_scale * e(item) + p(position)``."""

    def encode(self, events: Events) -> torch.Tensor:
        """Hidden states [sum L, D], aligned with ``events.x``."""
        raise NotImplementedError

    uses_times = False
    """Whether :meth:`encode` reads the events' times (a model with a time bias): then
    ``forward`` and ``user_vectors`` need ``times``."""

    def forward(
        self,
        history: KeyedJaggedTensor,
        max_length: int,
        candidates: torch.Tensor | None = None,
        times: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [sum L, D] at every position of ``history`` (one key, any name; lengths
        [B]; ``max_length`` its longest history, known on the host), and the vectors
        [C, D] of the item ids ``candidates`` [C] (None: none), from one lookup. ``times``
        [sum L]: the events' times in seconds, aligned with ``history.values()`` (read by a
        model whose ``uses_times``, ignored by the others).

        Raises:
            ValueError: a history longer than ``max_len``, or no (or misaligned) ``times``
                for a model that uses them.
        """
        lengths = history.lengths()
        ids = history.values()
        total = ids.numel()
        if self.uses_times and (times is None or times.shape != ids.shape):
            shape = None if times is None else tuple(times.shape)
            raise ValueError(
                f"this {type(self).__name__} learns a time bias: it needs the events' times "
                f"[{total}] with the history (got {shape})"
            )
        if max_length > self.max_len:
            raise ValueError(
                f"a history of {max_length} items; this {type(self).__name__} has positions for "
                f"{self.max_len}"
            )
        extra = candidates if candidates is not None else ids.new_zeros(0)
        both = KeyedJaggedTensor(
            keys=[HISTORY, CANDIDATES],
            values=torch.cat([ids, extra]),
            # [2]: no tensor built from host data (a copy to the device on a GPU)
            lengths=torch.cat([lengths.sum().view(1), lengths.new_full((1,), extra.numel())]),
            stride=1,
            length_per_key=[total, extra.numel()],
            offset_per_key=[0, total, total + extra.numel()],
        )
        looked_up = self.embeddings(both)
        items = looked_up[HISTORY].values()  # [sum L, D]
        batch = lengths.numel()
        user = torch.repeat_interleave(
            torch.arange(batch, device=ids.device), lengths, output_size=total
        )
        ends = torch.cumsum(lengths, 0)
        offsets = torch.cat([ends.new_zeros(1), ends])
        column = torch.arange(total, device=ids.device) - offsets[user]
        # s e(item) + p(position) (s = input_scale)
        x = jagged_dense_add(
            items,
            offsets,
            self.positions.weight,
            scale=self.input_scale,
            from_end=self.positions_from == "from_end",
            validate=False,  # offsets built here; max_length checked against max_len above
        )
        hidden = self.encode(Events(x, user, column, lengths, offsets, max_length, times))
        out = looked_up[CANDIDATES].values() if candidates is not None else None
        return hidden, out

    def user_vectors(
        self, history: KeyedJaggedTensor, max_length: int, times: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, D]: each user's hidden state at the most recent event (zeros for an empty
        history); ``times`` as :meth:`forward`'s."""
        hidden, _ = self.forward(history, max_length, times=times)
        lengths = history.lengths()
        last = torch.cumsum(lengths, 0) - 1
        picked = hidden[last.clamp(min=0)] if hidden.shape[0] else hidden.new_zeros(0, self.dim)
        return torch.where((lengths > 0)[:, None], picked, 0.0)

    def item_keys(self) -> torch.Tensor | None:
        """The item corpus of a dynamic item table (raw ids, a row per key): the keys it holds
        now, ascending (every item trained on and not evicted since); None for a fixed table,
        whose corpus is the ids ``0 .. num_items - 1``."""
        live_keys = getattr(self.embeddings, "live_keys", None)
        return live_keys(self.item_table) if live_keys is not None else None

    def item_vectors(self, keys: torch.Tensor | None = None) -> torch.Tensor:
        """[N, D] the vector of every item of the corpus (for full-corpus ranking): row i is
        item id i of a fixed table, else the i-th of ``keys`` (default :meth:`item_keys`)."""
        ids = keys if keys is not None else self.item_keys()
        if ids is None:
            ids = torch.arange(self.num_items, device=self.positions.weight.device)
        empty = KeyedJaggedTensor(
            keys=[HISTORY], values=ids[:0], lengths=ids.new_zeros(1), stride=1
        )
        no_times = torch.zeros(0, dtype=torch.float64, device=ids.device)
        return self.forward(empty, 0, candidates=ids, times=no_times)[1]
