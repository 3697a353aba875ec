"""SASRec (Kang & McAuley, "Self-Attentive Sequential Recommendation", 2018): causal
self-attention over each user's item history, scored against the same item embeddings.

The model reads histories as a jagged ``KeyedJaggedTensor`` (no padding in its interface) and
looks items up through an unpooled embedding collection (``recsys.EmbeddingCollection``, or
``torchrec.EmbeddingCollection``): one table, shared by two features, ``history`` (the ids read)
and ``candidates`` (the ids scored: targets and sampled negatives), so one lookup per step
serves both and a fused optimizer updates each row once.

For a history x_1 .. x_L (oldest first) the input at position j is
``sqrt(D) * e(x_j) + p(L - 1 - j)``: positions count back from the most recent event, so the
last event always has position 0 and a history longer than training's still lines up. Then
``num_blocks`` pre-LayerNorm blocks, ``h = h + Dropout(Attn(LN(h)))`` then
``h = h + Dropout(FFN(LN(h)))``, with causal multi-head attention (position j sees 1..j), and a
final LayerNorm. The hidden
state at position j predicts x_(j+1); the score of item i is ``h_j . e(i)``.

Internally the batch is padded to its longest history (``max_length``, which the batch carries
from the host) for ``torch.nn.functional.scaled_dot_product_attention``; outputs are jagged
again, aligned with the input ids.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import KeyedJaggedTensor

__all__ = ["CANDIDATES", "HISTORY", "SASRec"]

HISTORY, CANDIDATES = "history", "candidates"


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(ffn_dim, dim)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, dim = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(batch, length, 3, self.heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
        )  # [B, H, L, D / H]
        h = h + self.drop(self.out(attended.transpose(1, 2).reshape(batch, length, dim)))
        return h + self.drop(self.ffn(self.norm2(h)))


class SASRec(nn.Module):
    """Causal self-attention over item histories (see the module docstring).

    Args:
        embeddings: an unpooled embedding collection with one table whose features are
            ``history`` and ``candidates`` (:data:`HISTORY`, :data:`CANDIDATES`).
        max_len: the longest history (learned positions 0 .. max_len - 1).
        num_blocks / num_heads: the transformer's depth and heads (dim % num_heads == 0).
        dropout: on the inputs, attention weights, block outputs and inside the FFN.
        ffn_dim: the FFN's hidden width (default: the item dim).

    Example:
        >>> from torchrec import EmbeddingCollection, EmbeddingConfig
        >>> table = EmbeddingConfig(name="item", num_embeddings=100, embedding_dim=16,
        ...                         feature_names=[HISTORY, CANDIDATES])
        >>> model = SASRec(EmbeddingCollection(tables=[table]), max_len=20)
    """

    def __init__(
        self,
        embeddings: nn.Module,
        *,
        max_len: int,
        num_blocks: int = 2,
        num_heads: int = 1,
        dropout: float = 0.2,
        ffn_dim: int | None = None,
    ) -> None:
        super().__init__()
        configs = embeddings.embedding_configs()
        features = [sorted(c.feature_names) for c in configs]
        if len(configs) != 1 or features[0] != sorted([HISTORY, CANDIDATES]):
            raise ValueError(
                f"SASRec needs one item table with features {[HISTORY, CANDIDATES]}; the "
                f"collection has tables {[c.name for c in configs]} with features {features}"
            )
        dim = configs[0].embedding_dim
        if max_len < 1 or num_blocks < 1 or num_heads < 1 or dim % num_heads:
            raise ValueError(
                f"max_len={max_len}, num_blocks={num_blocks} and num_heads={num_heads} must be "
                f">= 1, and the item dim {dim} divisible by num_heads"
            )
        self.embeddings, self.dim, self.max_len = embeddings, dim, max_len
        self.num_items = configs[0].num_embeddings
        self.positions = nn.Embedding(max_len, dim)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.input_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            _Block(dim, num_heads, ffn_dim or dim, dropout) for _ in range(num_blocks)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(
        self, history: KeyedJaggedTensor, max_length: int, candidates: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [sum L, D] at every position of ``history`` (one key, any name; lengths
        [B]; ``max_length`` its longest history, known on the host), and the vectors
        [C, D] of the item ids ``candidates`` [C] (None: none), from one lookup."""
        lengths = history.lengths()
        ids = history.values()
        total = ids.numel()
        if max_length > self.max_len:
            raise ValueError(
                f"a history of {max_length} items; this SASRec has positions for {self.max_len}"
            )
        extra = candidates if candidates is not None else ids.new_zeros(0)
        both = KeyedJaggedTensor(
            keys=[HISTORY, CANDIDATES],
            values=torch.cat([ids, extra]),
            lengths=torch.stack([lengths.sum(), lengths.new_tensor(extra.numel())]),
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
        starts = torch.cumsum(lengths, 0) - lengths
        column = torch.arange(total, device=ids.device) - starts[user]
        position = lengths[user] - 1 - column  # 0 for the most recent event
        x = items * math.sqrt(self.dim) + self.positions(position)
        padded = x.new_zeros(batch, max(max_length, 1), self.dim)
        padded = padded.index_put((user, column), self.input_dropout(x))
        length = padded.shape[1]
        steps = torch.arange(length, device=ids.device)
        valid = steps[None, :] < lengths[:, None]  # [B, L]
        causal = steps[None, :] <= steps[:, None]  # [L, L]: query j sees keys <= j
        # Padded queries see themselves, so no row of the mask is empty (their outputs are
        # dropped).
        mask = (causal[None] & valid[:, None, :]) | torch.eye(
            length, dtype=torch.bool, device=ids.device
        )[None]
        h = padded
        for block in self.blocks:
            h = block(h, mask[:, None])  # [B, 1, L, L] broadcast over heads
        hidden = self.norm(h)[user, column]  # [sum L, D], aligned with the ids
        out = looked_up[CANDIDATES].values() if candidates is not None else None
        return hidden, out

    def user_vectors(self, history: KeyedJaggedTensor, max_length: int) -> torch.Tensor:
        """[B, D]: each user's hidden state at the most recent event (zeros for an empty
        history)."""
        hidden, _ = self.forward(history, max_length)
        lengths = history.lengths()
        last = torch.cumsum(lengths, 0) - 1
        picked = hidden[last.clamp(min=0)] if hidden.shape[0] else hidden.new_zeros(0, self.dim)
        return torch.where((lengths > 0)[:, None], picked, 0.0)

    def item_vectors(self) -> torch.Tensor:
        """[N, D] every item's vector (for full-corpus ranking): row i is item id i."""
        ids = torch.arange(self.num_items, device=self.positions.weight.device)
        empty = KeyedJaggedTensor(
            keys=[HISTORY],
            values=ids[:0],
            lengths=ids.new_zeros(1),
            stride=1,
        )
        return self.forward(empty, 0, candidates=ids)[1]
