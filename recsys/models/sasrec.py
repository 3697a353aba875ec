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

import torch
import torch.nn.functional as F
from torch import nn

from recsys.models.sequence import CANDIDATES, HISTORY, Events, SequenceEncoder

__all__ = ["CANDIDATES", "HISTORY", "SASRec"]


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


class SASRec(SequenceEncoder):
    """Causal self-attention over item histories (see the module docstring).

    Args:
        embeddings / max_len: as :class:`~recsys.models.sequence.SequenceEncoder`.
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
        super().__init__(embeddings, max_len=max_len)
        dim = self.dim
        if num_blocks < 1 or num_heads < 1 or dim % num_heads:
            raise ValueError(
                f"num_blocks={num_blocks} and num_heads={num_heads} must be >= 1, and the item "
                f"dim {dim} divisible by num_heads"
            )
        self.input_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            _Block(dim, num_heads, ffn_dim or dim, dropout) for _ in range(num_blocks)
        )
        self.norm = nn.LayerNorm(dim)

    def encode(self, events: Events) -> torch.Tensor:
        user, column, lengths = events.user, events.column, events.lengths
        device = events.x.device
        padded = events.x.new_zeros(lengths.numel(), max(events.max_length, 1), self.dim)
        padded = padded.index_put((user, column), self.input_dropout(events.x))
        length = padded.shape[1]
        steps = torch.arange(length, device=device)
        valid = steps[None, :] < lengths[:, None]  # [B, L]
        causal = steps[None, :] <= steps[:, None]  # [L, L]: query j sees keys <= j
        # Padded queries see themselves, so no row of the mask is empty (their outputs are
        # dropped).
        itself = torch.eye(length, dtype=torch.bool, device=device)
        mask = (causal[None] & valid[:, None, :]) | itself[None]
        h = padded
        for block in self.blocks:
            h = block(h, mask[:, None])  # [B, 1, L, L] broadcast over heads
        return self.norm(h)[user, column]  # [sum L, D], aligned with the ids
