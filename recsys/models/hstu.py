"""HSTU (Zhai et al. 2024, "Actions Speak Louder than Words"): the generative recommender's
sequential transduction units over jagged item histories, for next-item retrieval.

One block, on the jagged rows x [sum L, D] of a batch (no padding anywhere):

    u, v, q, k = split(silu(W1 LayerNorm(x) + b1))         u, v: [H, Dv]   q, k: [H, Dqk]
    a = jagged_attention(q, k, v)                          silu(alpha q.k + rab) / N, causal
    x = x + Dropout(W2 (LayerNorm(a) * u) + b2)

with ``alpha = 1 / sqrt(Dqk)`` and N the model's ``max_len`` (one normalizer whatever the batch,
so a user's vector does not depend on who shares the batch). ``num_blocks`` blocks, then a final
LayerNorm. Inputs, positions and the lookup of history and candidates are
:class:`~recsys.models.sequence.SequenceEncoder`'s (learned absolute positions). The relative
attention bias of the paper (rab, shared by the heads, computed inside the kernel) comes in two
halves, each a table learned per block: with ``relative_bias`` the position half
(2 ``max_len`` - 1 entries, one per position difference) and with ``time_bias`` the time half
(:data:`TIME_BUCKETS` + 1 entries, one per bucket ``floor(log(|t_i - t_j|) / 0.301)`` of the
time between the query's event and the key's, in seconds: the research HSTU's bucketing; with
``time_convention="next"`` the query's time is that of the event after it, the one it
predicts, as in Meta's research HSTU: see ``recsys.ops.jagged.attention``).
A model with the time half needs each event's time: ``forward(history, max_length,
candidates, times)`` with ``times`` [sum L] aligned with the history's ids (a
:class:`~recsys.data.sequence_batches.SequenceBatch` carries them as ``times``), and its
exported program takes them as a third input.
The attention runs on ``recsys.ops.jagged.attention``: its Triton kernels on CUDA, the padded
torch path on CPU (``backend``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from recsys.models.sequence import CANDIDATES, HISTORY, Events, SequenceEncoder
from recsys.ops.jagged.attention import TIME_CONVENTIONS, jagged_attention

__all__ = ["CANDIDATES", "HISTORY", "HSTU", "TIME_BUCKETS", "HSTUBlock"]

TIME_BUCKETS = 128
"""Buckets of the time bias (the research HSTU's): ``log(|dt| / 1 s) / 0.301`` reaches 128 at
about 5e16 s, so no real gap is clamped into the last bucket; gaps under a second share
bucket 0."""


class HSTUBlock(nn.Module):
    """One HSTU block on jagged rows x [T, D] (the module docstring's equations); with
    ``num_targets`` [B] the last rows of each sequence are targets (see
    ``recsys.ops.jagged.attention``). ``position_bias_len``: 0 or the 2N - 1 rows of the
    relative position bias for sequences of up to N rows; ``time_bias_len``: 0 or the rows of
    the time bias (:data:`TIME_BUCKETS` + 1), which needs ``timestamps`` [T] in forward;
    ``time_convention``: its query's time (``jagged_attention``'s)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        qk_dim: int,
        v_dim: int,
        dropout: float,
        backend: str,
        position_bias_len: int,
        time_bias_len: int = 0,
        time_convention: str = "own",
    ) -> None:
        super().__init__()
        self.heads, self.qk_dim, self.v_dim, self.backend = heads, qk_dim, v_dim, backend
        self.time_convention = time_convention
        self.position_bias = self.time_bias = None
        if position_bias_len:
            # rab by position difference j - i + max_len - 1 (Meta's init)
            self.position_bias = nn.Parameter(torch.empty(position_bias_len).normal_(std=0.02))
        if time_bias_len:
            # rab by the log bucket of |t_i - t_j| (Meta's init)
            self.time_bias = nn.Parameter(torch.empty(time_bias_len).normal_(std=0.02))
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, heads * (2 * v_dim + 2 * qk_dim))
        self.out_norm = nn.LayerNorm(heads * v_dim)
        self.out = nn.Linear(heads * v_dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        num_targets: torch.Tensor | None = None,
        timestamps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total, heads = x.shape[0], self.heads
        sizes = [heads * self.v_dim] * 2 + [heads * self.qk_dim] * 2
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).split(sizes, dim=1)
        attended = jagged_attention(
            q.reshape(total, heads, self.qk_dim),
            k.reshape(total, heads, self.qk_dim),
            v.reshape(total, heads, self.v_dim),
            offsets,
            max_len,
            alpha=1.0 / math.sqrt(self.qk_dim),
            num_targets=num_targets,
            timestamps=timestamps if self.time_bias is not None else None,
            position_weights=self.position_bias,
            time_weights=self.time_bias,
            time_convention=self.time_convention,
            backend=self.backend,
            validate=False,  # the model checked the longest history against max_len
        )
        mixed = self.out_norm(attended.reshape(total, heads * self.v_dim)) * u
        return x + self.drop(self.out(mixed))


class HSTU(SequenceEncoder):
    """HSTU blocks over item histories (see the module docstring).

    Args:
        embeddings / max_len / positions: as :class:`~recsys.models.sequence.SequenceEncoder`.
        num_blocks / num_heads: depth and heads.
        qk_dim / v_dim: per-head widths of q, k and of u, v (default: dim // num_heads).
        dropout: on the inputs and each block's output.
        relative_bias: each block learns a relative position bias (module docstring).
        time_bias: each block learns a relative time bias (module docstring): ``forward``
            then needs the events' ``times``.
        time_convention: the time bias's query time: ``"own"`` (the query's event) or
            ``"next"`` (the event after it, Meta's research HSTU's); only with ``time_bias``.
        backend: ``jagged_attention``'s backend ("auto", "triton", "torch").

    Example:
        >>> from torchrec import EmbeddingCollection, EmbeddingConfig
        >>> table = EmbeddingConfig(name="item", num_embeddings=100, embedding_dim=16,
        ...                         feature_names=[HISTORY, CANDIDATES])
        >>> model = HSTU(EmbeddingCollection(tables=[table]), max_len=20, num_heads=2)
    """

    def __init__(
        self,
        embeddings: nn.Module,
        *,
        max_len: int,
        num_blocks: int = 2,
        num_heads: int = 1,
        qk_dim: int | None = None,
        v_dim: int | None = None,
        dropout: float = 0.2,
        relative_bias: bool = False,
        time_bias: bool = False,
        time_convention: str = "own",
        backend: str = "auto",
        positions: str = "from_start",
    ) -> None:
        super().__init__(embeddings, max_len=max_len, positions=positions)
        self.uses_times = time_bias
        if time_convention not in TIME_CONVENTIONS or (time_convention != "own" and not time_bias):
            raise ValueError(
                f"time_convention={time_convention!r} with time_bias={time_bias}: expected one "
                f"of {TIME_CONVENTIONS}, and 'own' without the time bias (the convention is "
                "its query's time)"
            )
        if num_blocks < 1 or num_heads < 1 or self.dim < num_heads:
            raise ValueError(
                f"num_blocks={num_blocks} and num_heads={num_heads} must be >= 1 and num_heads "
                f"<= the item dim {self.dim}"
            )
        qk_dim = qk_dim or self.dim // num_heads
        v_dim = v_dim or self.dim // num_heads
        self.input_dropout = nn.Dropout(dropout)
        bias_len = 2 * max_len - 1 if relative_bias else 0
        time_len = TIME_BUCKETS + 1 if time_bias else 0
        self.blocks = nn.ModuleList(
            HSTUBlock(
                self.dim,
                num_heads,
                qk_dim,
                v_dim,
                dropout,
                backend,
                bias_len,
                time_len,
                time_convention,
            )
            for _ in range(num_blocks)
        )
        self.norm = nn.LayerNorm(self.dim)

    def encode(self, events: Events) -> torch.Tensor:
        x = self.input_dropout(events.x)
        for block in self.blocks:
            x = block(x, events.offsets, self.max_len, timestamps=events.times)
        return self.norm(x)
