"""The synthetic click log of ``benchmarks/tiered.py``: Zipf ids over large tables, labels
from a planted model, and the AUC that scores a model on it.

A batch holds one id per table and sample (one-hot, as Criteo). Ids are Zipf(``zipf``) ranks
over a table's N rows, drawn by the inverse CDF of the continuous power law on [1, N+1) (no
N-entry probability vector), then scrambled rank -> row by ``(rank * a + c) mod N`` (a coprime to
N, per table) so the hot rows are spread over the table's file. Labels come from a planted model:
``logit = 1.5 * z_ids + 0.75 * z_dense``, ``z_ids`` the sum over tables of a per-id effect
``h(table, id)`` (a hash of the id mapped to [-1, 1]) scaled to unit variance, ``z_dense`` a fixed
unit direction of the 13 N(0, 1) dense features; label ~ Bernoulli(sigmoid(logit)).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

__all__ = ["NUM_DENSE", "Batch", "LogSpec", "auc", "make_batches"]

NUM_DENSE = 13
ID_WEIGHT, DENSE_WEIGHT = 1.5, 0.75
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def zipf_ranks(num: int, num_rows: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """``num`` int64 ranks in [0, num_rows), P(rank r) ~ (r + 1) ** -exponent: the inverse CDF of
    the continuous power law on [1, num_rows + 1), floored."""
    u = torch.rand(num, generator=gen, dtype=torch.float64)
    if abs(exponent - 1.0) < 1e-9:
        x = torch.pow(num_rows + 1.0, u)
    else:
        a = 1.0 - exponent
        x = torch.pow(1.0 + u * ((num_rows + 1.0) ** a - 1.0), 1.0 / a)
    return (x.floor().long() - 1).clamp_(0, num_rows - 1)


def scramble(ranks: torch.Tensor, num_rows: int, table: int) -> torch.Tensor:
    """Rank -> row, a bijection of [0, num_rows): ``(rank * a + c) mod num_rows``, ``a`` coprime
    to ``num_rows``; hot ranks land all over the table."""
    a = (0x9E3779B1 + 2 * table * 0x632BE5AB) % num_rows or 1
    while math.gcd(a, num_rows) != 1:
        a += 1
    c = (table * 0x5851F42D) % num_rows
    return (ranks * a + c) % num_rows  # ranks, a < num_rows < 2**31: no int64 overflow


def id_effect(ids: torch.Tensor, table: int) -> torch.Tensor:
    """The planted effect of each id of ``table`` in [-1, 1] (splitmix64 of table and id)."""
    with np.errstate(over="ignore"):
        x = ids.numpy().astype(np.uint64) + np.uint64((table + 1) * 0x9E3779B97F4A7C15 & MASK64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    unit = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return torch.from_numpy(unit * 2.0 - 1.0)


@dataclasses.dataclass
class Batch:
    """One batch of the log, with the planted model's logits."""

    dense: torch.Tensor  # [B, 13]
    sparse: KeyedJaggedTensor  # one id per table and sample
    labels: torch.Tensor  # [B, 1]
    logits: torch.Tensor  # [B] the planted model's


@dataclasses.dataclass(frozen=True)
class LogSpec:
    """The shape of a synthetic log: ``num_tables`` tables of ``rows`` rows, ``batch`` samples a
    batch, ids Zipf(``zipf``), and ``seed``, which fixes the planted dense direction."""

    num_tables: int
    rows: int
    batch: int
    zipf: float
    seed: int


def make_batches(spec: LogSpec, num: int, seed: int) -> list[Batch]:
    """``num`` batches of the log ``spec`` describes, drawn from ``seed`` (the same batches for
    the same spec and seed)."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(NUM_DENSE, generator=torch.Generator().manual_seed(spec.seed))
    direction /= direction.norm()
    keys = [f"f{t}" for t in range(spec.num_tables)]
    lengths = torch.ones(spec.num_tables * spec.batch, dtype=torch.int64)
    batches = []
    for _ in range(num):
        ids = [
            scramble(zipf_ranks(spec.batch, spec.rows, spec.zipf, gen), spec.rows, t)
            for t in range(spec.num_tables)
        ]
        effects = torch.stack([id_effect(v, t) for t, v in enumerate(ids)]).sum(0)
        z_ids = effects / math.sqrt(spec.num_tables / 3.0)  # each effect has variance 1/3
        dense = torch.randn(spec.batch, NUM_DENSE, generator=gen)
        logits = ID_WEIGHT * z_ids.float() + DENSE_WEIGHT * (dense @ direction)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=gen).unsqueeze(1)
        sparse = KeyedJaggedTensor(keys=keys, values=torch.cat(ids), lengths=lengths)
        batches.append(Batch(dense, sparse, labels, logits))
    return batches


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the rank formula (ties get their average rank)."""
    scores, labels = scores.double().flatten(), labels.flatten() > 0.5
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    _, inverse, counts = torch.unique_consecutive(
        sorted_scores, return_inverse=True, return_counts=True
    )
    ends = torch.cumsum(counts, 0).double()
    average = (ends - (counts.double() - 1) / 2)[inverse]  # 1-based average rank of each tie
    ranks = torch.empty_like(average)
    ranks[order] = average
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if not positives or not negatives:
        return float("nan")
    total = float(ranks[labels].sum()) - positives * (positives + 1) / 2
    return total / (positives * negatives)
