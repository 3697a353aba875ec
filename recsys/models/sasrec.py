"""SASRec (Kang & McAuley, "Self-Attentive Sequential Recommendation", 2018): causal
self-attention over each user's item history, scored against the same item embeddings.

The model reads histories as a jagged ``KeyedJaggedTensor`` (no padding in its interface) and
looks items up through an unpooled embedding collection (``recsys.EmbeddingCollection``, or
``torchrec.EmbeddingCollection``): one table, shared by two features, ``history`` (the ids read)
and ``candidates`` (the ids scored: targets and sampled negatives), so one lookup per step
serves both and a fused optimizer updates each row once.

For a history x_1 .. x_L (oldest first) position j's learned position vector is
``p(j - 1)`` (``positions="from_start"``, as the paper and RecBole) or ``p(L - j)``
(``"from_end"``: the last event always at 0). ``num_blocks`` blocks of
causal multi-head attention (position j sees 1..j) and a feed-forward network follow, with
the LayerNorms where ``layer_norm`` says:

- ``"pre"`` (default): input ``Dropout(sqrt(D) e(x_j) + p)``, per block
  ``h = h + Dropout(Attn(LN(h)))`` and ``h = h + Dropout(FFN(LN(h)))`` (dropout inside the FFN
  too), a final LayerNorm, PyTorch's default initialization;
- ``"post"`` (BERT's layout, as RecBole's SASRec): input ``Dropout(LN(e(x_j) + p))``,
  then per block ``h = LN(h + Dropout(Attn(h)))`` and ``h = LN(h + Dropout(FFN(h)))``; the
  blocks' linear weights start from N(0, 0.02), their biases at 0.

The hidden state at position j predicts x_(j+1); the score of item i is ``h_j . e(i)``.

Internally the batch is padded to its longest history (``max_length``, which the batch carries
from the host) for ``torch.nn.functional.scaled_dot_product_attention``; outputs are jagged
again, aligned with the input ids.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from recsys.models.sequence import CANDIDATES, HISTORY, Events, SequenceEncoder

__all__ = ["CANDIDATES", "HISTORY", "SASRec"]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn_dim: int, dropout: float, post: bool) -> None:
        super().__init__()
        self.heads, self.dropout, self.post = heads, dropout, post
        eps = 1e-12 if post else 1e-5  # BERT's / RecBole's, PyTorch's
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        inner_dropout = nn.Identity() if post else nn.Dropout(dropout)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_dim), nn.GELU(), inner_dropout, nn.Linear(ffn_dim, dim)
        )
        self.drop = nn.Dropout(dropout)
        if post:
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
                    nn.init.zeros_(module.bias)

    def _attend(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
        )  # [B, H, L, D / H]
        return self.drop(self.out(attended.transpose(1, 2).reshape(batch, length, dim)))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.post:
            h = self.norm1(h + self._attend(h, mask))
            return self.norm2(h + self.drop(self.ffn(h)))
        h = h + self._attend(self.norm1(h), mask)
        return h + self.drop(self.ffn(self.norm2(h)))


class SASRec(SequenceEncoder):
    """Causal self-attention over item histories (see the module docstring).

    Args:
        embeddings / max_len / positions: as :class:`~recsys.models.sequence.SequenceEncoder`.
        num_blocks / num_heads: the transformer's depth and heads (dim % num_heads == 0).
        dropout: on the inputs, attention weights, block outputs (and, ``"pre"``, inside the
            FFN).
        ffn_dim: the FFN's hidden width (default: the item dim).
        layer_norm: ``"post"`` or ``"pre"`` (see the module docstring).

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
        layer_norm: str = "pre",
        positions: str = "from_start",
    ) -> None:
        super().__init__(embeddings, max_len=max_len, positions=positions)
        dim = self.dim
        if layer_norm not in ("post", "pre"):
            raise ValueError(f"layer_norm={layer_norm!r}; expected 'post' or 'pre'")
        self.layer_norm = layer_norm
        post = layer_norm == "post"
        # post: LayerNorm(e + p) of unscaled embeddings; pre: sqrt(D) e + p, no norm
        self.input_scale = 1.0 if post else math.sqrt(dim)
        if num_blocks < 1 or num_heads < 1 or dim % num_heads:
            raise ValueError(
                f"num_blocks={num_blocks} and num_heads={num_heads} must be >= 1, and the item "
                f"dim {dim} divisible by num_heads"
            )
        self.input_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            _Block(dim, num_heads, ffn_dim or dim, dropout, post) for _ in range(num_blocks)
        )
        # post: the input's LayerNorm; pre: the final one
        self.norm = nn.LayerNorm(dim, eps=1e-12 if post else 1e-5)

    def encode(self, events: Events) -> torch.Tensor:
        user, column, lengths = events.user, events.column, events.lengths
        device = events.x.device
        padded = events.x.new_zeros(lengths.numel(), max(events.max_length, 1), self.dim)
        x = self.norm(events.x) if self.layer_norm == "post" else events.x
        padded = padded.index_put((user, column), self.input_dropout(x))
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
        if self.layer_norm == "pre":
            h = self.norm(h)
        return h[user, column]  # [sum L, D], aligned with the ids
