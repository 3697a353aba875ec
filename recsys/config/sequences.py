"""The config sections of sequence models (``model.name = "sasrec"`` or ``"hstu"``): their
architecture, the built-in synthetic interaction log, and next-item training and ranking
evaluation. Each is a table of the section that owns it: ``[model.sequence]``,
``[data.synthetic_sequences]``, ``[train.next_item]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from recsys.config.rules import AtLeast0, AtLeast1, Fraction, Range

SEQUENCE_MODELS = ("sasrec", "hstu")
"""``model.name`` values that are sequence retrieval models: trained on user histories by
next-item prediction and evaluated by full-corpus ranking, not on click logs by BCE / AUC."""

TARGET_RANKING_MODELS = ("hstu_ranking",)
"""``model.name`` values that rank candidates appended to a user's history (target-aware):
trained by BCE on clicks and evaluated by AUC / logloss, like the CTR models."""

CTR_METRICS = ("valid_auc", "valid_logloss")
"""What keep_best / early stopping may watch in a CTR run."""
RANKING_METRICS = ("valid_hr@10", "valid_ndcg@10", "valid_mrr", "valid_hr@50", "valid_ndcg@50")
"""What they may watch in a sequence model's run (higher is better for each)."""
BestMetric = Literal[
    "valid_auc",
    "valid_logloss",
    "valid_hr@10",
    "valid_ndcg@10",
    "valid_mrr",
    "valid_hr@50",
    "valid_ndcg@50",
]


@dataclass
class SequenceModelConfig:
    """sasrec and hstu: a transformer over each user's item history. Their item (and hidden)
    dimension is ``model.embedding_dim``; the one item table is an unpooled
    ``recsys.EmbeddingCollection`` (sized by the data) trained by the fused embedding
    optimizer, everything else by the dense one."""

    max_len: Annotated[int, AtLeast1] = 50
    """Longest history the model reads (learned positions); longer histories of the data are
    cut to their most recent max_len events."""
    positions: Literal["from_start", "from_end"] = "from_start"
    """sasrec, hstu: how the learned positions number a history's events. ``from_start``: from
    the oldest the model reads, as SASRec's paper and RecBole; ``from_end``: back from the most
    recent (always at 0; the default before, and how hstu_ranking, which ignores this key,
    numbers its history ahead of its candidates). Under the causal loss ``from_start`` trains
    every position of a row on the inputs a history of that length is ranked with;
    ``from_end`` numbers a row's earlier positions as no ranked history is (its last event is
    at 0), so only a row's last position trains what ranking reads."""
    num_blocks: Annotated[int, AtLeast1] = 2
    """Transformer blocks."""
    num_heads: Annotated[int, AtLeast1] = 1
    """Attention heads (sasrec: model.embedding_dim must be divisible by it)."""
    dropout: Annotated[float, Fraction] = 0.2
    """Dropout on the inputs and in each block, in training only."""
    ffn_dim: Annotated[int, AtLeast0] = 0
    """sasrec: hidden width of each block's feed-forward network (0: model.embedding_dim)."""
    layer_norm: Literal["pre", "post"] = "pre"
    """sasrec: where the LayerNorms sit. ``pre``: a LayerNorm before each sublayer, inputs
    sqrt(D) e + p, a final LayerNorm; ``post``: BERT's layout, as RecBole's SASRec (the input
    LayerNorm(e + p), each sublayer LayerNorm(h + Dropout(f(h))), linear weights from
    N(0, 0.02))."""
    qk_dim: Annotated[int, AtLeast0] = 0
    """hstu: per-head width of q and k (0: model.embedding_dim // num_heads)."""
    v_dim: Annotated[int, AtLeast0] = 0
    """hstu: per-head width of u and v (0: model.embedding_dim // num_heads)."""
    num_candidates: Annotated[int, AtLeast1] = 8
    """hstu_ranking: candidates per user, appended to the history as attention targets (the
    synthetic ranking data draws this many per user)."""
    relative_bias: bool = False
    """hstu, hstu_ranking: each block learns a relative attention bias by position difference
    (computed in the attention kernel)."""
    time_bias: bool = False
    """hstu: with relative_bias, each block also learns the time half of the relative bias,
    by the log-bucketed time between two events (``relative_bias = true`` alone: position
    bias; both: position + time). The model then reads each event's time: the histories'
    ``times`` in training and evaluation, and a ``times`` input of its export."""
    time_convention: Literal["own", "next"] = "own"
    """hstu with time_bias: the query's time in the time bias. ``own``: the query's event's;
    ``next``: the next event's (the one the query predicts), as Meta's research HSTU
    (``RelativeBucketedTimeAndPositionBasedBias``); a history's last event then uses its own
    time, having no next one (``recsys.ops.jagged_attention``'s ``time_convention``)."""


@dataclass
class SyntheticSequencesConfig:
    """The built-in synthetic interaction log of sequence models
    (``recsys.data.synthetic_sequences``): users drifting between latent interests (topics),
    items drawn by topic popularity, so the ranking an oracle that knows each user's interests
    achieves is known. Generated with run.seed and split leave-one-out like ``recsys
    preprocess --format interactions`` output (items categorified: ids 0-2 reserved; or raw
    keys, ``id_encoding``)."""

    num_users: Annotated[int, AtLeast1] = 2000
    """Users (one history each)."""
    num_items: Annotated[int, AtLeast1] = 1000
    """Items, at least num_topics."""
    num_topics: Annotated[int, AtLeast1] = 20
    """Latent interests; item i belongs to topic i mod num_topics."""
    alpha: Annotated[float, Range(min=1e-6)] = 0.1
    """Dirichlet concentration of a user's interests over the topics (small: few topics each)."""
    stay: Annotated[float, Range(min=0, max=1)] = 0.8
    """Probability that the next event keeps the topic of the previous one."""
    zipf: Annotated[float, AtLeast0] = 1.0
    """Skew of item popularity within a topic."""
    min_events: Annotated[int, AtLeast1] = 5
    """Fewest events of a user."""
    mean_events: Annotated[float, AtLeast1] = 30.0
    """Mean events of a user (geometric above min_events)."""
    max_events: Annotated[int, AtLeast1] = 200
    """Most events of a user."""
    id_encoding: Literal["index", "raw"] = "index"
    """``index``: items categorified (ids from 3, a fixed item table). ``raw``: items keep
    their raw 64-bit keys (as ``recsys preprocess --preprocess.encoding=raw`` writes them),
    so the item table is dynamic (``[model.dynamic]``): a key gets its row when training first
    brings it, and the ranking corpus is the keys the table holds."""


@dataclass
class NextItemConfig:
    """Next-item training and ranking evaluation of sequence models (``recsys.models.
    next_item``, ``recsys.train.ranking_metrics``). Every position of a train history predicts
    the item after it; valid and test rank each user's held-out item against every item."""

    loss: Literal["sampled", "full"] = "sampled"
    """``sampled``: softmax over the target and shared negatives (in-batch + uniform);
    ``full``: softmax over every item (exact, costs a [positions, items] product: small
    catalogs)."""
    in_batch_negatives: Annotated[int, AtLeast0] = 128
    """sampled: negatives drawn from the batch's targets (so popular items are drawn as often
    as they are targets)."""
    uniform_negatives: Annotated[int, AtLeast0] = 128
    """sampled: negatives drawn uniformly over the items."""
    logq_correction: bool = True
    """sampled: subtract log(expected count of each negative among the draws) from its logit,
    which removes the popularity bias of in-batch negatives."""
    train_rows: Literal["windows", "prefixes", "last"] = "windows"
    """How a train history longer than ``model.sequence.max_len`` becomes rows. ``windows``:
    cut from its end into windows of max_len + 1 events (consecutive windows share one event),
    each predicting every position with the causal loss, so every event after the first is a
    target once per epoch at about (events + windows) positions of attention. ``prefixes``
    (RecBole's augmentation): a row per target, its max_len events before it, the loss at the
    last position only: the same targets, each with the longest context, at up to max_len
    times the cost of ``windows``. ``last``: only the last max_len + 1 events of each user
    (older events are never targets; a row per user)."""
    window_stride: Annotated[int, AtLeast0] = 0
    """``windows``: events between the ends of a user's consecutive rows (0: max_len, rows that
    share one event). Each row counts only its last window_stride targets, so every target is
    still counted once per epoch, with at least max_len - window_stride events before it (when
    the history has them), at about max_len / window_stride times the cost; at most max_len."""
    exclude_history: bool = False
    """Ranking: leave every item of a user's history before the target (the whole history the
    data holds, not only the max_len events the model reads; for test, the train events and
    the valid target) out of its ranking; the target itself is never excluded."""
    eval_chunk_items: Annotated[int, AtLeast1] = 65536
    """Ranking: items scored at a time (memory is eval_batch_size x this)."""
