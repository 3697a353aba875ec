"""Target-aware ranking with HSTU (Zhai et al. 2024, section 3: "ranking"): each user's
candidates are appended to the history as *targets* of the attention (they see the history
and themselves, not each other: ``jagged_attention``'s ``num_targets``), and a head scores
each candidate's final state, trained with BCE like the CTR models.

Per user b with history items h_1 .. h_n (oldest first) and candidates c_1 .. c_m, one
jagged sequence of n + m rows, no padding anywhere:

    x = sqrt(D) e(h_i) + p(n - i)  (history, positions counted back from the latest event)
        sqrt(D) e(c_j) + t          (candidates: one learned "target" vector; the relative
                                     position bias puts every target just after the history)
    x = HSTUBlock(x, num_targets = m) ...   then LayerNorm
    logit_j = MLP([x_{n + j} | e(c_j)])     [sum m, num_tasks]

Because targets do not see each other, a candidate's score does not depend on the other
candidates it was scored with (tested), so a user's candidates may be split over requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.models.hstu import HSTUBlock
from recsys.models.sequence import CANDIDATES, HISTORY
from recsys.ops.jagged.concat import jagged_concat, jagged_split
from recsys.ops.jagged.dense_add import jagged_dense_add

__all__ = ["HSTURanking"]


class HSTURanking(nn.Module):
    """HSTU blocks over history + candidates, a head on the candidates (module docstring).

    Args:
        embeddings: an unpooled embedding collection with one item table whose features are
            ``history`` and ``candidates``.
        max_len: the longest history.
        max_candidates: the most candidates of one user (the sequences' length is at most
            ``max_len + max_candidates``).
        num_blocks / num_heads / qk_dim / v_dim / dropout: as :class:`~recsys.models.HSTU`.
        relative_bias: each block learns a relative position bias.
        head_layer_sizes: hidden widths of the scoring MLP.
        num_tasks: logits per candidate.
        backend: ``jagged_attention``'s backend.

    Example:
        >>> from torchrec import EmbeddingCollection, EmbeddingConfig
        >>> table = EmbeddingConfig(name="item", num_embeddings=100, embedding_dim=16,
        ...                         feature_names=[HISTORY, CANDIDATES])
        >>> model = HSTURanking(EmbeddingCollection(tables=[table]), max_len=20,
        ...                     max_candidates=8, num_heads=2)
    """

    def __init__(
        self,
        embeddings: nn.Module,
        *,
        max_len: int,
        max_candidates: int,
        num_blocks: int = 2,
        num_heads: int = 1,
        qk_dim: int | None = None,
        v_dim: int | None = None,
        dropout: float = 0.2,
        relative_bias: bool = True,
        head_layer_sizes: Sequence[int] = (64,),
        num_tasks: int = 1,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        configs = embeddings.embedding_configs()
        features = [sorted(c.feature_names) for c in configs]
        if len(configs) != 1 or features[0] != sorted([HISTORY, CANDIDATES]):
            raise ValueError(
                f"HSTURanking needs one item table with features {[HISTORY, CANDIDATES]}; the "
                f"collection has tables {[c.name for c in configs]} with features {features}"
            )
        dim = configs[0].embedding_dim
        if max_len < 1 or max_candidates < 1 or num_tasks < 1:
            raise ValueError(
                f"max_len={max_len}, max_candidates={max_candidates}, num_tasks={num_tasks}: "
                "expected >= 1"
            )
        if num_blocks < 1 or num_heads < 1 or dim < num_heads:
            raise ValueError(
                f"num_blocks={num_blocks} and num_heads={num_heads} must be >= 1 and num_heads "
                f"<= the item dim {dim}"
            )
        self.embeddings, self.dim = embeddings, dim
        self.max_len, self.max_candidates = max_len, max_candidates
        self.positions = nn.Embedding(max_len, dim)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.target = nn.Parameter(torch.empty(dim).normal_(std=0.02))
        self.input_dropout = nn.Dropout(dropout)
        span = max_len + max_candidates
        qk_dim = qk_dim or dim // num_heads
        v_dim = v_dim or dim // num_heads
        bias_len = 2 * span - 1 if relative_bias else 0
        self.blocks = nn.ModuleList(
            HSTUBlock(dim, num_heads, qk_dim, v_dim, dropout, backend, bias_len)
            for _ in range(num_blocks)
        )
        self.norm = nn.LayerNorm(dim)
        layers: list[nn.Module] = []
        width = 2 * dim
        for size in head_layer_sizes:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        self.head = nn.Sequential(*layers, nn.Linear(width, num_tasks))

    def forward(
        self,
        history: KeyedJaggedTensor,
        max_length: int,
        candidates: KeyedJaggedTensor,
        max_num_candidates: int,
    ) -> torch.Tensor:
        """Logits [sum m, num_tasks] of every user's candidates, in ``candidates``' order.

        Args:
            history: one key, lengths [B]: each user's items, oldest first.
            max_length: the longest history (host-known, <= ``max_len``).
            candidates: one key, lengths [B]: each user's candidates.
            max_num_candidates: the most candidates of one user (host-known, <=
                ``max_candidates``).
        """
        if max_length > self.max_len or max_num_candidates > self.max_candidates:
            raise ValueError(
                f"a history of {max_length} items and {max_num_candidates} candidates; this "
                f"HSTURanking reads at most {self.max_len} and {self.max_candidates}"
            )
        history_lengths, candidate_lengths = history.lengths(), candidates.lengths()
        if history_lengths.numel() != candidate_lengths.numel():
            raise ValueError(
                f"{history_lengths.numel()} histories and {candidate_lengths.numel()} candidate "
                "lists: expected one list per history"
            )
        history_ids, candidate_ids = history.values(), candidates.values()
        num_history, num_candidates = history_ids.numel(), candidate_ids.numel()
        both = KeyedJaggedTensor(
            keys=[HISTORY, CANDIDATES],
            values=torch.cat([history_ids, candidate_ids]),
            lengths=torch.stack([history_lengths.sum(), candidate_lengths.sum()]),
            stride=1,
            length_per_key=[num_history, num_candidates],
            offset_per_key=[0, num_history, num_history + num_candidates],
        )
        looked_up = self.embeddings(both)
        history_items = looked_up[HISTORY].values()  # [n, D]
        candidate_items = looked_up[CANDIDATES].values()  # [m, D]

        history_offsets = torch.cat([history_lengths.new_zeros(1), history_lengths.cumsum(0)])
        candidate_offsets = torch.cat(
            [candidate_lengths.new_zeros(1), candidate_lengths.cumsum(0)]
        )  # [B + 1] each
        scale = math.sqrt(self.dim)
        # history: positions counted back from the latest event; candidates: the target vector
        history_x = jagged_dense_add(
            history_items,
            history_offsets,
            self.positions.weight,
            scale=scale,
            from_end=True,
            validate=False,  # offsets built here; max_length checked above
        )
        candidate_x = candidate_items * scale + self.target
        x, offsets = jagged_concat(
            history_x, history_offsets, candidate_x, candidate_offsets, validate=False
        )  # [n + m, D], each user's history then candidates
        x = self.input_dropout(x)
        # one normalizer N whatever the batch, so a score does not depend on the batch
        span = self.max_len + self.max_candidates
        for block in self.blocks:
            x = block(x, offsets, span, num_targets=candidate_lengths)
        x = self.norm(x)
        _, candidate_states = jagged_split(
            x, history_offsets, candidate_offsets, num_history, validate=False
        )  # [m, D] in candidates' order
        scored = torch.cat([candidate_states, candidate_items], dim=1)  # [sum m, 2D]
        return self.head(scored)
