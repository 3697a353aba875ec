"""Synthetic Criteo-shaped click logs with labels from a hidden teacher model.

Every sample has N_dense dense features (log(1 + count) of log-normal counts, like preprocessed
Criteo; N_dense may be 0, a categorical-only log), F categorical features with Zipf-skewed ids
(bags of 0..m ids for multi-hot features) and T labels drawn as Bernoulli(p). The click
probability p comes from a random *teacher*:

    z_f   = mean of E_f[id] over the bag of feature f          (E_f: [cardinality_f, K])
    z_0   = tanh(W_0 (x - mu))                                 (x: dense features)
    s     = sum_{0 <= i < j <= F} <z_i, z_j>                   (pairwise interactions)
    l_t   = sum_f mean of b_{t,f}[id] + w_t . (x - mu) + a_t * s
    p_t   = sigmoid(c_t + g_t * l_t)

with the gain g_t set so std(c_t + g_t * l_t) = ``teacher_logit_std`` and c_t so mean(p_t) =
``click_rate`` (both fitted once per task on a calibration sample). With no dense features
there is no dense term: no z_0 and no w_t. A model that recovers the teacher reaches the
*oracle AUC*, the AUC of p itself against the labels, which
:meth:`SyntheticDataset.click_probability` lets the trainer report beside the model's AUC.

Data is generated in chunks of ``CHUNK_SIZE`` rows; chunk i of a split is a pure function of
(seed, split, i), so any chunk can be regenerated in any order, on any rank, and the train,
valid and test splits are independent draws. The teacher depends on the seed only.

**Drift** (``drift_days`` D > 0): the samples form a stream of days 0..D in which ids are born,
peak and die (``recsys.data.synthetic_drift``); the teacher's E_f and b_{t,f} are then drawn
from hashes of (seed, feature, id) instead of tables, so an id born on any day is scored the
same way on every day. The train split is days 0..D-1 in day order (``num_train_samples``
spread evenly, each chunk from one day: :meth:`SyntheticDataset.chunk_days`), valid and test
are day D. :meth:`SyntheticDataset.day` draws any number of samples of one day, from streams of
their own. With ``drift_days = 0`` nothing of this applies and the data is bitwise what it was
before drift existed.

**Large tables**: a feature with more than ``MAX_TABLE_IDS`` = 2^20 ids has no tables: its
E_f[id] ~ N(0, 1/K) and b_{t,f}[id] ~ N(0, importance_f^2) are drawn from hashes of (seed,
feature, id), as with drift, and its Zipf ranks map to ids by the same affine bijection as
small tables (exact up to ``MAX_IDS`` = 2^40 ids). The dataset then holds O(1) memory per such
feature whatever its cardinality, so a table larger than RAM can be trained from the built-in
data; generating its ids' parameters costs hashing time instead (about 6x slower chunks when
every feature is hashed). Features up to the limit keep the tables drawn from the seed's main
stream, so data whose features are all small is bitwise what it was before; a large feature
draws no table from that stream, so beside one the small features' parameters are other draws
(same distributions).

**Raw ids** (``id_encoding = "raw"``): every id number n of feature f becomes the 64-bit key
``recsys.data.keys.synthetic_keys(f, n)`` after generation; features, teacher and labels are
those of the ``index`` encoding. :meth:`SyntheticDataset.id_numbers` maps keys back.

Tasks do not depend on how many there are: task t's teacher, probabilities and labels are the
same for every ``num_tasks`` > t. The features and task 0 come from the seed's main stream
(task 0 is the one-task dataset), task t >= 1 from a stream of its own, each task's logit is
computed and calibrated on its own, and a chunk draws its labels task by task, B uniforms each.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torchrec import KeyedJaggedTensor

from recsys.config import SyntheticConfig
from recsys.data.batch import Batch, DatasetSpec
from recsys.data.keys import synthetic_id_numbers, synthetic_keys
from recsys.data.synthetic_drift import (
    DriftingIds,
    HashedTeacherTables,
    affine_mod,
    coprime_multiplier,
    zipf_ranks,
)

CHUNK_SIZE = 8192
MAX_TABLE_IDS = 1 << 20
"""The largest feature (in ids) whose teacher parameters are tables (4 (K + T) bytes an id, 36
with the defaults); those of larger ones come from hashes of the ids, in O(1) memory."""
MAX_IDS = 1 << 40
"""The most ids one feature can have (``index``: the rank -> id map is exact up to it; ``raw``:
keys hold id numbers below it)."""
SPLITS = ("train", "valid", "test")
_CALIBRATION_STREAM = 1_000_003  # seed stream of the teacher's calibration sample
_TASK_STREAM = 1_000_033  # seed streams of the teacher's tasks t >= 1: [seed, _TASK_STREAM, t]
_DAY_STREAM = 1_000_039  # seed streams of day(d, n): [seed, _DAY_STREAM, draw, d, chunk]


class SyntheticDataset:
    """Deterministic synthetic click log.

    Args:
        config: the ``[data.synthetic]`` section.
        seed: everything (teacher, id permutations, samples) derives from it.

    Example::

        data = SyntheticDataset(SyntheticConfig(num_train_samples=10_000), seed=0)
        chunk = data.chunk("train", 0)          # Batch of up to CHUNK_SIZE rows
        p = data.click_probability(chunk)       # f32[B, T], the teacher's click probability

        # A drifting stream of raw keys: train day by day, test on the next day.
        config = SyntheticConfig(drift_days=7, new_ids_per_day=0.1, id_encoding="raw")
        data = SyntheticDataset(config, seed=0)
        for d in range(7):
            train, test = data.day(d, 100_000), data.day(d + 1, 20_000, draw=1)
    """

    def __init__(self, config: SyntheticConfig, seed: int = 0) -> None:
        _validate(config)
        self.config = config
        self.seed = seed
        num_sparse = len(config.cardinalities)
        self.bag_sizes = list(config.bag_sizes) or [1] * num_sparse
        self.drift = DriftingIds(config, seed) if config.drift_days > 0 else None
        """The id process of a drifting stream (birth days, ids per feature); None without."""
        num_ids = [
            n if self.drift is None else self.drift.num_ids(f)
            for f, n in enumerate(config.cardinalities)
        ]
        raw = config.id_encoding == "raw"
        if max(num_ids) > MAX_IDS:
            raise ValueError(
                f"data.synthetic: {max(num_ids):,} ids in one feature; expected at most 2^40 = "
                f"{MAX_IDS:,} (lower cardinalities or drift_days)"
            )
        self.spec = DatasetSpec(
            dense_names=tuple(f"int_{i}" for i in range(config.num_dense)),
            sparse_names=tuple(f"cat_{i}" for i in range(num_sparse)),
            cardinalities=(0,) * num_sparse if raw else tuple(num_ids),
            label_names=tuple(
                ["click"]
                if config.num_tasks == 1
                else [f"task_{t}" for t in range(config.num_tasks)]
            ),
            id_encoding=config.id_encoding,
        )
        # The most ids one sample has per feature (its largest bag): what a cache must hold.
        self.max_ids_per_sample = dict(zip(self.spec.sparse_names, self.bag_sizes, strict=True))
        self.num_ids = tuple(num_ids)
        """Per feature, the ids that can occur (over all days): the table sizes of ``index``."""
        self._train_days = _spread_over_days(config.num_train_samples, config.drift_days)
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
        self._dense_mu = rng.uniform(0.0, 3.0, config.num_dense)
        self._dense_sigma = rng.uniform(0.5, 1.5, config.num_dense)
        # Zipf rank r of feature f is mapped to id (r * mult_f + shift_f) mod n_f, a bijection,
        # so frequent ids are spread over the table instead of sitting at 0, 1, 2, ...
        self._id_mult = [coprime_multiplier(n, rng) for n in config.cardinalities]
        self._id_shift = [int(rng.integers(n)) for n in config.cardinalities]
        self._teacher = _Teacher(config, rng, seed)
        calibration = self._generate_features(_calibration_rng(seed), 4 * CHUNK_SIZE, day=0)
        self._teacher.calibrate(calibration)

    def num_samples(self, split: str) -> int:
        _check_split(split)
        return getattr(self.config, f"num_{split}_samples")

    def num_chunks(self, split: str) -> int:
        if split == "train" and self.drift is not None:
            return len(self._train_days)
        return math.ceil(self.num_samples(split) / CHUNK_SIZE)

    def chunk_rows(self, split: str, index: int) -> int:
        """Number of rows in chunk ``index`` of ``split`` (all but the last are CHUNK_SIZE; with
        drift, all but the last of each train day)."""
        if split == "train" and self.drift is not None:
            return self._train_days[index][1]
        return min(CHUNK_SIZE, self.num_samples(split) - index * CHUNK_SIZE)

    def chunk_days(self, split: str) -> list[int]:
        """The day of every chunk of ``split``: train 0, 0, ..., 1, ... (ascending), valid and
        test all ``drift_days`` (all 0 without drift)."""
        if split == "train" and self.drift is not None:
            return [day for day, _ in self._train_days]
        return [self.config.drift_days] * self.num_chunks(split)

    def chunk(self, split: str, index: int) -> Batch:
        """Chunk ``index`` of ``split`` (rows ``[index * CHUNK_SIZE, ...)`` without drift),
        generated from (seed, split, index)."""
        if not 0 <= index < self.num_chunks(split):
            raise IndexError(
                f"chunk {index} of split '{split}' out of [0, {self.num_chunks(split)})"
            )
        rng = np.random.default_rng(
            np.random.SeedSequence([self.seed, 1 + SPLITS.index(split), index])
        )
        day = self.chunk_days(split)[index]
        return self._sample(rng, self.chunk_rows(split, index), day)

    def day(self, day: int, num_samples: int, draw: int = 0) -> Batch:
        """``num_samples`` samples of day ``day`` in [0, drift_days] (0 without drift), from
        seed streams of their own (independent of the splits; ``draw`` picks another
        independent sample of the same day). Rows come in CHUNK_SIZE blocks, so the first n
        rows are the same for any ``num_samples`` >= n.

        Raises:
            ValueError: a day outside [0, drift_days] or num_samples < 1.
        """
        if not 0 <= day <= self.config.drift_days:
            raise ValueError(f"day {day} outside [0, drift_days = {self.config.drift_days}]")
        if num_samples < 1:
            raise ValueError(f"num_samples = {num_samples}; expected >= 1")
        pieces = []
        for block in range(math.ceil(num_samples / CHUNK_SIZE)):
            seed = np.random.SeedSequence([self.seed, _DAY_STREAM, draw, day, block])
            pieces.append(self._sample(np.random.default_rng(seed), CHUNK_SIZE, day))
        return Batch.concat(pieces).slice(0, num_samples)

    def id_numbers(self, values: torch.Tensor) -> torch.Tensor:
        """The id numbers (in [0, num_ids[f])) of a batch's KJT values: the values themselves
        for ``index``, the inverse of the key mapping for ``raw``."""
        if self.spec.id_encoding == "index":
            return values
        return torch.from_numpy(synthetic_id_numbers(values.cpu().numpy())[1])

    def click_probability(self, batch: Batch) -> torch.Tensor:
        """The teacher's click probability f32[B, T] for a batch of this dataset's features."""
        sparse = batch.sparse.to(torch.device("cpu"))
        if self.spec.id_encoding == "raw":
            sparse = _with_values(sparse, self.id_numbers(sparse.values()))
        return self._teacher.probability(batch.dense.cpu(), sparse)

    def write_criteo(
        self, path: str | Path, split: str = "train", num_rows: int | None = None
    ) -> int:
        """Write rows of ``split`` as a Criteo TSV (gzip when ``path`` ends in .gz): label, the
        dense features as integer counts, ids as hex. Needs 13 dense features and one-hot bags.

        Returns the number of lines written. Handy for trying ``recsys preprocess`` on data with
        a known oracle.
        """
        if self.config.num_dense != 13 or len(self.config.cardinalities) != 26:
            raise ValueError("Criteo lines need num_dense = 13 and 26 cardinalities")
        if any(m != 1 for m in self.bag_sizes):
            raise ValueError("Criteo lines hold one id per feature; use one-hot bag_sizes")
        total = self.num_samples(split) if num_rows is None else num_rows
        gz = str(path).endswith(".gz")
        written = 0
        with gzip.open(path, "wt", compresslevel=1) if gz else open(path, "w") as out:
            for index in range(self.num_chunks(split)):
                if written == total:
                    break
                chunk = self.chunk(split, index)
                rows = min(len(chunk), total - written)
                counts = np.rint(np.expm1(chunk.dense[:rows].numpy())).astype(np.int64)
                ids = chunk.sparse.values().view(26, -1)[:, :rows].T.numpy()
                labels = chunk.labels[:rows, 0].long().numpy()
                for label, count_row, id_row in zip(labels, counts, ids, strict=True):
                    fields = [str(label), *map(str, count_row), *(f"{i:08x}" for i in id_row)]
                    out.write("\t".join(fields) + "\n")
                written += rows
        return written

    def _sample(self, rng: np.random.Generator, num_rows: int, day: int) -> Batch:
        """Features, teacher probability and labels of ``num_rows`` samples of ``day``."""
        dense, sparse = self._generate_features(rng, num_rows, day)
        probability = self._teacher.probability(dense, sparse)  # [B, T]
        # Task-major: task t's labels are uniforms t*B .. (t+1)*B - 1, whatever T is.
        uniforms = rng.random((probability.shape[1], probability.shape[0])).T  # [B, T]
        labels = (torch.from_numpy(uniforms) < probability).float()
        if self.spec.id_encoding == "raw":
            sparse = _with_values(sparse, self._keys(sparse))
        return Batch(dense=dense, sparse=sparse, labels=labels)

    def _keys(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """The raw keys of a KJT of id numbers (feature-major values)."""
        per_feature = sparse.values().split(sparse.length_per_key())
        keys = [synthetic_keys(f, ids.numpy()) for f, ids in enumerate(per_feature)]
        return torch.from_numpy(np.concatenate(keys))

    def _generate_features(
        self, rng: np.random.Generator, num_rows: int, day: int
    ) -> tuple[torch.Tensor, KeyedJaggedTensor]:
        counts = np.floor(
            np.exp(rng.normal(self._dense_mu, self._dense_sigma, (num_rows, len(self._dense_mu))))
        )
        dense = torch.from_numpy(np.log1p(counts)).float()  # [B, N_dense]
        lengths, values = [], []
        for f, n in enumerate(self.config.cardinalities):
            m = self.bag_sizes[f]
            if m == 1 or self.config.bag_lengths == "fixed":
                bag = np.full(num_rows, m, np.int32)
            else:
                bag = rng.integers(0, m + 1, num_rows, dtype=np.int32)
            if self.drift is not None:
                values.append(self.drift.sample(rng, f, day, int(bag.sum())))
            else:
                rank = zipf_ranks(rng, n, self.config.zipf_alpha, int(bag.sum()))
                values.append(affine_mod(rank, self._id_mult[f], self._id_shift[f], n))
            lengths.append(bag)
        sparse = KeyedJaggedTensor(
            keys=list(self.spec.sparse_names),
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        )
        return dense, sparse


class _Teacher:
    """The hidden model that defines each sample's click probability (see module docstring).

    Per-task parameters are kept task by task ([n_f, 1] bias tables of the tabled features, an
    [N_dense, 1] dense weight, a [1] interaction weight) and every task's logit is computed and
    calibrated as a [B, 1] column on its own: a task's numbers are then bitwise the same for any
    number of tasks (a [B, N] @ [N, T] matmul or a reduction over [B, T] may round differently
    per T).
    """

    def __init__(self, config: SyntheticConfig, rng: np.random.Generator, seed: int) -> None:
        dim = config.teacher_dim
        # An open-ended id space (drift) or a large feature: its parameters come from hashes.
        tabled = [config.drift_days == 0 and n <= MAX_TABLE_IDS for n in config.cardinalities]
        self.embeddings = [
            torch.from_numpy(rng.normal(0.0, 1.0 / math.sqrt(dim), (n, dim))).float()
            if has_table
            else None
            for n, has_table in zip(config.cardinalities, tabled, strict=True)
        ]  # [n_f, K] each; None: hashed
        # Features differ in how much they matter, as real ones do.
        importance = rng.uniform(0.0, 1.0, len(config.cardinalities))
        self.hashed = None if all(tabled) else HashedTeacherTables(seed, importance, dim)
        # The main stream draws task 0 in the order the one-task teacher always has.
        biases = [
            rng.normal(0.0, importance[f], (n, 1)) if tabled[f] else None
            for f, n in enumerate(config.cardinalities)
        ]
        self.dense_mu = torch.zeros(config.num_dense)  # set by calibrate()
        self.dense_proj = None
        dense_weight = None
        if config.num_dense > 0:
            self.dense_proj = torch.from_numpy(
                rng.normal(0.0, 1.0 / math.sqrt(config.num_dense), (config.num_dense, dim))
            ).float()
            dense_weight = rng.normal(0.0, 0.5, (config.num_dense, 1))
        self.tasks = [_TaskTerms(biases, dense_weight, rng.uniform(0.5, 1.5, 1))]
        for t in range(1, config.num_tasks):
            task_rng = np.random.default_rng(np.random.SeedSequence([seed, _TASK_STREAM, t]))
            biases = [
                task_rng.normal(0.0, importance[f], (n, 1)) if tabled[f] else None
                for f, n in enumerate(config.cardinalities)
            ]
            if config.num_dense > 0:
                dense_weight = task_rng.normal(0.0, 0.5, (config.num_dense, 1))
            self.tasks.append(_TaskTerms(biases, dense_weight, task_rng.uniform(0.5, 1.5, 1)))
        self.click_rate = config.click_rate
        self.logit_std = config.teacher_logit_std
        self.gain = torch.ones(config.num_tasks)
        self.intercept = torch.zeros(config.num_tasks)

    def raw_logits(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> list[torch.Tensor]:
        """Each task's uncalibrated logit l_t, [B, 1] each."""
        batch_size = dense.shape[0]
        x = dense - self.dense_mu  # [B, N_dense]
        pooled = [] if self.dense_proj is None else [torch.tanh(x @ self.dense_proj)]  # [B, K]
        bags = []  # (ids, offsets, each task's bias table) per feature
        for f, jt in enumerate(sparse.split([1] * len(sparse.keys()))):
            ids, offsets = jt.values().long(), jt.offsets().long()
            if self.embeddings[f] is not None:
                table, biases = self.embeddings[f], [task.biases[f] for task in self.tasks]
            else:  # tables over the batch's distinct ids; ids index them
                ids, table, biases = self.hashed.tables(f, ids, len(self.tasks))
            bags.append((ids, offsets, biases))
            pooled.append(
                F.embedding_bag(ids, table, offsets, mode="mean", include_last_offset=True)
            )
        z = torch.stack(pooled, dim=1)  # [B, F+1, K] (F without dense features)
        total = z.sum(1)
        pairwise = 0.5 * ((total * total).sum(1) - (z * z).sum((1, 2)))  # [B]
        num_pairs = z.shape[1] * (z.shape[1] - 1) / 2
        interaction = pairwise / math.sqrt(max(num_pairs, 1))
        logits = []
        for t, task in enumerate(self.tasks):
            bias = None if task.dense_weight is None else x @ task.dense_weight  # [B, 1]
            for ids, offsets, biases in bags:
                table = biases[t]
                pooled_bias = F.embedding_bag(
                    ids, table, offsets, mode="mean", include_last_offset=True
                )
                bias = pooled_bias if bias is None else bias + pooled_bias
            logits.append(bias + task.interaction_weight * interaction.view(batch_size, 1))
        return logits

    def calibrate(self, features: tuple[torch.Tensor, KeyedJaggedTensor]) -> None:
        self.dense_mu = features[0].mean(0)
        gains, intercepts = [], []
        for raw in self.raw_logits(*features):  # [B, 1] per task
            gain = self.logit_std / raw.std(0).clamp(min=1e-6)
            centered = (raw - raw.mean(0)) * gain
            # Bisection for the intercept giving the requested mean click probability.
            lo, hi = torch.full_like(gain, -20.0), torch.full_like(gain, 20.0)
            for _ in range(60):
                mid = (lo + hi) / 2
                too_high = torch.sigmoid(centered + mid).mean(0) > self.click_rate
                hi = torch.where(too_high, mid, hi)
                lo = torch.where(too_high, lo, mid)
            gains.append(gain)
            intercepts.append((lo + hi) / 2 - raw.mean(0) * gain)
        self.gain, self.intercept = torch.cat(gains), torch.cat(intercepts)  # [T] each

    def probability(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        columns = [
            torch.sigmoid(raw * self.gain[t : t + 1] + self.intercept[t : t + 1])
            for t, raw in enumerate(self.raw_logits(dense, sparse))
        ]
        return torch.cat(columns, dim=1)  # [B, T]


class _TaskTerms:
    """One task's first-order weights (None for a hashed feature) and interaction weight
    (float32 tensors)."""

    def __init__(
        self,
        biases: list[np.ndarray | None],
        dense_weight: np.ndarray | None,
        interaction: np.ndarray,
    ) -> None:
        self.biases = [None if b is None else torch.from_numpy(b).float() for b in biases]
        self.dense_weight = None if dense_weight is None else torch.from_numpy(dense_weight).float()
        self.interaction_weight = torch.from_numpy(interaction).float()  # [1]


def _spread_over_days(num_rows: int, num_days: int) -> list[tuple[int, int]]:
    """(day, rows) of every train chunk of a drifting stream: day d gets rows
    [d N / D, (d + 1) N / D) in chunks of CHUNK_SIZE (the last of a day shorter)."""
    chunks = []
    for day in range(num_days):
        rows = (day + 1) * num_rows // num_days - day * num_rows // num_days
        chunks += [(day, min(CHUNK_SIZE, rows - first)) for first in range(0, rows, CHUNK_SIZE)]
    return chunks


def _with_values(sparse: KeyedJaggedTensor, values: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=sparse.keys(),
        values=values,
        lengths=sparse.lengths(),
        weights=sparse.weights_or_none(),
    )


def _calibration_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, _CALIBRATION_STREAM]))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; expected one of {', '.join(SPLITS)}")


def _validate(config: SyntheticConfig) -> None:
    if not config.cardinalities:
        raise ValueError(
            "data.synthetic.cardinalities is empty; give one size per categorical feature"
        )
    for i, n in enumerate(config.cardinalities):
        if n < 1:
            raise ValueError(
                f"data.synthetic.cardinalities[{i}] = {n}; every cardinality must be >= 1"
            )
    if config.bag_sizes and len(config.bag_sizes) != len(config.cardinalities):
        raise ValueError(
            f"data.synthetic.bag_sizes has {len(config.bag_sizes)} entries but there are "
            f"{len(config.cardinalities)} categorical features (or leave it empty for one-hot)"
        )
    for i, m in enumerate(config.bag_sizes):
        if m < 1:
            raise ValueError(f"data.synthetic.bag_sizes[{i}] = {m}; every bag size must be >= 1")
    if config.num_dense < 0:
        raise ValueError(
            f"data.synthetic.num_dense = {config.num_dense}; expected >= 0 (0: categorical only)"
        )
    if config.num_tasks < 1:
        raise ValueError(f"data.synthetic.num_tasks = {config.num_tasks}; expected >= 1")
    if not 0.0 < config.click_rate < 1.0:
        raise ValueError(f"data.synthetic.click_rate = {config.click_rate}; expected in (0, 1)")
    if config.zipf_alpha <= 0:
        raise ValueError(f"data.synthetic.zipf_alpha = {config.zipf_alpha}; expected > 0")
    for split in SPLITS:
        n = getattr(config, f"num_{split}_samples")
        if n < 1:
            raise ValueError(f"data.synthetic.num_{split}_samples = {n}; expected >= 1")
    _validate_drift(config)


def _validate_drift(config: SyntheticConfig) -> None:
    if config.id_encoding not in ("index", "raw"):
        raise ValueError(
            f"data.synthetic.id_encoding = {config.id_encoding!r}; expected 'index' or 'raw'"
        )
    if config.drift_days < 0:
        raise ValueError(f"data.synthetic.drift_days = {config.drift_days}; expected >= 0")
    if config.drift_days == 0:
        return
    if not 0.0 < config.new_ids_per_day <= 1.0:
        raise ValueError(
            f"data.synthetic.new_ids_per_day = {config.new_ids_per_day}; expected in (0, 1]"
        )
    if not 0.0 <= config.popularity_drift < 1.0:
        raise ValueError(
            f"data.synthetic.popularity_drift = {config.popularity_drift}; expected in [0, 1)"
        )
    if config.num_train_samples < config.drift_days:
        raise ValueError(
            f"data.synthetic.num_train_samples = {config.num_train_samples} is less than "
            f"drift_days = {config.drift_days}; every train day needs samples"
        )
