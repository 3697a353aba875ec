"""The next-item task of a sequence model's run (``model.name = "sasrec"`` or ``"hstu"``; see
:mod:`recsys.train.tasks`): user histories in, next-item softmax as the loss
(:func:`recsys.models.next_item.next_item_loss`, ``[train.next_item]``), and every evaluation
a full-corpus ranking of each user's held-out item (:class:`RankingMetrics`).

An eval event holds ``hr@10``, ``ndcg@10``, ``hr@50``, ``ndcg@50``, ``mrr`` and
``num_users``, with two references measured on the same users and candidates:
``popularity_hr@10`` / ``popularity_ndcg@10`` (every user gets the items ranked by their count
in the train histories) and, on the synthetic log's test split, ``oracle_hr@10`` /
``oracle_ndcg@10`` (expected of the ranking by the true next-item distribution:
:func:`recsys.data.synthetic_sequences.oracle_metrics`).

With a dynamic item table (raw item keys, or ``model.dynamic.tables``) the ranking corpus is the
keys the table holds at the evaluation (every item trained on and not evicted since, reserved
ids left out): a held-out item the table lacks is a miss, as an item unseen in training is with
categorified ids. The popularity reference ranks the train histories' distinct items.

Under torchrun the item table is sharded (:class:`recsys.distributed.ShardedEmbeddingCollection`,
placed by the planner) and the dense layers run under DDP: each rank trains on its share of
every global batch of ``train.batch_size x world_size`` rows (its own in-batch negatives) and
evaluates users r, r + W, ...; the ranking sums are added over ranks. Every lookup is a
collective, so a rank with fewer evaluation batches than rank 0 looks up empty ones. A dynamic
item table is sharded KEY_WISE; its ranking corpus and the uniform negatives of each step are
the keys of every rank, all-gathered (``model.item_keys()``, a collective every rank makes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.config import Config
from recsys.data import resolve_source
from recsys.data.layout import EpochLayout, Reshard
from recsys.data.loader import background, default_prefetch
from recsys.data.sequence_batches import ITEMS, SequenceBatch, SequenceLoader
from recsys.data.sequence_source import SequenceDataset, build_sequence_dataset
from recsys.distributed.parallel import DistributedInfo
from recsys.models.next_item import corpus_keys, next_item_loss
from recsys.train.ranking_metrics import RankingMetrics

__all__ = ["NextItemTask", "ranking_line"]

KS = (10, 50)


class _Epoch:
    """The batches of one epoch of a split from ``start_batch`` on, moved to ``device``;
    ``len()`` is the epoch's whole length (the trainer counts from 0). With ``prefetch`` > 0
    they are cut in a background thread that many ahead (on CUDA in pinned memory, copied
    without blocking), so the training step never waits for the host to build one."""

    def __init__(
        self,
        loader: SequenceLoader,
        epoch: int,
        start_batch: int,
        device: torch.device,
        prefetch: int = 0,
    ) -> None:
        self.loader, self.epoch, self.start_batch, self.device = loader, epoch, start_batch, device
        self.prefetch = prefetch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[SequenceBatch]:
        pin = self.device.type == "cuda"
        built = self.loader.epoch(self.epoch, self.start_batch)
        batches = (batch.pin_memory() if pin else batch for batch in built)
        if self.prefetch > 0:
            batches = background(batches, self.prefetch)
        try:
            for batch in batches:
                yield batch.to(self.device, non_blocking=pin)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:  # stops the background thread
                close()

    @property
    def layout(self) -> EpochLayout:
        raise ValueError(
            "a sequence model's run resumes with the train.batch_size and number of processes "
            "it was saved with"
        )


class NextItemTask:
    """User histories and next-item ranking (see the module docstring).

    Args:
        config: the run's config (``[data]``, ``[model.sequence]``, ``[train.next_item]``).
        device: where batches go.
        info: this process's rank and the world size.
        say: prints a line on the first rank.

    Raises:
        ValueError: data that is not user histories, or loss options that draw no negative.
    """

    rate_unit = "users"  # a batch row is one user's history

    def __init__(
        self,
        config: Config,
        device: torch.device,
        info: DistributedInfo,
        say: Callable[[str], None],
    ) -> None:
        options = config.train.next_item
        if options.loss == "sampled" and options.in_batch_negatives + options.uniform_negatives < 1:
            raise ValueError(
                "train.next_item.loss = 'sampled' with train.next_item.in_batch_negatives = 0 and "
                "uniform_negatives = 0: no negatives to sample (set one >= 1, or loss = 'full')"
            )
        stride, max_len = options.window_stride, config.model.sequence.max_len
        if stride > max_len:
            raise ValueError(
                f"train.next_item.window_stride = {stride}; expected 0 (model.sequence.max_len) "
                f"to model.sequence.max_len = {max_len}"
            )
        source = resolve_source(config.data, sequences=True)
        if source not in ("sequences", "synthetic_sequences"):
            where = f"data.path '{config.data.path}'" if config.data.path else "no data.path"
            raise ValueError(
                f"model.name = {config.model.name!r} trains on user histories, but data.source "
                f"= {config.data.source!r} ({where}) is {source!r} click-log data; give "
                "`recsys preprocess --format interactions` output as data.path, or data.source = "
                "'synthetic_sequences'"
            )
        self.config, self.device, self.info = config, device, info
        self.max_len = config.model.sequence.max_len
        self.data: SequenceDataset = build_sequence_dataset(config.data, source, config.run.seed)
        self.spec = self.data.spec
        self.max_ids_per_sample: dict[str, int] = {}
        for split in ("valid", "test"):
            if not self.data.splits[split].users:
                raise ValueError(
                    f"the {split} split of the histories has no user (a user needs 3 events or "
                    "more for a valid and a test target)"
                )
        if self.data.raw_ids:  # raw item keys: counted by key
            keys, counts = (torch.from_numpy(a) for a in self.data.train_key_counts())
            self.popularity = {
                split: self._popularity(counts.double(), split, keys.to(device))
                for split in ("valid", "test")
            }
        else:
            counts = torch.from_numpy(self.data.train_item_counts()).double()
            self.popularity = {
                split: self._popularity(counts, split) for split in ("valid", "test")
            }
        longest = max(int(np.diff(h.offsets).max(initial=0)) for h in self.data.splits.values())
        if longest > self.max_len:
            rows = config.train.next_item.train_rows
            say(
                f"histories of up to {longest} events: the model reads the last {self.max_len} "
                f"(model.sequence.max_len) before each target; training cuts them into "
                f"{rows!r} rows (train.next_item.train_rows)"
            )

    def loss(self, model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
        """The next-item loss of a train batch (``[train.next_item]``)."""
        options = self.config.train.next_item
        return next_item_loss(
            model,
            batch,
            in_batch=options.in_batch_negatives,
            uniform=options.uniform_negatives,
            full_softmax=options.loss == "full",
            first_item=self.data.first_item,
            logq=options.logq_correction,
        )

    def loader(
        self, split: str, epoch: int = 0, start_batch: int = 0, reshards: tuple[Reshard, ...] = ()
    ) -> _Epoch:
        """The batches of ``split`` (train: epoch ``epoch``, shuffled, from ``start_batch``)."""
        train = self.config.train
        batch_size = train.batch_size if split == "train" else train.eval_batch_size
        loader = self.data.loader(
            split,
            batch_size,
            seed=self.config.run.seed,
            max_len=self.max_len,
            rank=self.info.rank,
            world_size=self.info.world_size,
            train_rows=self.config.train.next_item.train_rows,
            window_stride=self.config.train.next_item.window_stride,
        )
        prefetch = default_prefetch(self.config.data.prefetch_batches, self.device.type == "cuda")
        return _Epoch(loader, epoch, start_batch, self.device, prefetch)

    def _eval_batches(self, split: str) -> Iterator[SequenceBatch | None]:
        """This rank's batches of ``split``, then None until it has given as many as rank 0
        (the one with the most): every rank looks up as often."""
        epoch = self.loader(split)
        yield from epoch
        users = self.data.splits[split].users
        most = math.ceil(len(range(0, users, self.info.world_size)) / epoch.loader.batch_size)
        for _ in range(most - len(epoch)):
            yield None

    def batch_makers(self) -> str:
        """What makes the train batches (for the trainer's input-bound line)."""
        return "the training process (sequence batches have no worker processes)"

    def steps_per_epoch(self) -> int:
        """Train batches per epoch.

        Raises:
            ValueError: train.batch_size is larger than the number of train histories.
        """
        steps = len(self.loader("train"))
        if steps == 0:
            raise ValueError(
                f"train.batch_size = {self.config.train.batch_size} is larger than the "
                f"{self.loader('train').loader.rows} train rows"
            )
        return steps

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, Any]:
        """HR@k, NDCG@k (k = 10, 50), MRR of ranking every item for each user of ``split``,
        with the popularity (and oracle) references."""
        model = getattr(model, "module", model)  # no gradients: around a DDP wrapper
        was_training = model.training
        model.eval()
        metrics = self._metrics()
        keys = model.item_keys()  # a dynamic item table's corpus: the keys it holds
        if keys is not None:
            keys = corpus_keys(keys, self.data.first_item)
        items = model.item_vectors(keys)  # [N, D]
        users = 0
        for batch in self._eval_batches(split):
            if batch is None:  # this rank has no users left: an empty lookup, as collective
                model.user_vectors(self._no_users(), 0, self._no_times())
                continue
            queries = model.user_vectors(batch.items, batch.max_length, batch.times)  # [B, D]
            metrics.update(queries, items, batch.targets, self._exclude(batch), keys)
            users += batch.size
        model.train(was_training)
        result: dict[str, Any] = {**metrics.compute(), "num_users": self._summed(users)}
        for name in ("hr@10", "ndcg@10"):
            result[f"popularity_{name}"] = self.popularity[split][name]
        if split == "test" and self.data.oracle is not None:
            for name in ("hr@10", "ndcg@10"):
                result[f"oracle_{name}"] = self.data.oracle[name]
        return result

    def _no_users(self) -> KeyedJaggedTensor:
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return KeyedJaggedTensor(keys=[ITEMS], values=empty, lengths=empty, stride=0)

    def _no_times(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64, device=self.device)

    def _summed(self, count: int) -> int:
        """``count`` added over the ranks."""
        if self.info.world_size == 1:
            return count
        total = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(total)
        return int(total)

    def eval_line(self, split: str, step: int, result: dict[str, Any]) -> str:
        return ranking_line(split, step, result)

    def _metrics(self) -> RankingMetrics:
        chunk = self.config.train.next_item.eval_chunk_items
        return RankingMetrics(KS, first_item=self.data.first_item, chunk_items=chunk)

    def _exclude(self, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.config.train.next_item.exclude_history:
            return None
        assert batch.seen_items is not None and batch.seen_offsets is not None
        return batch.seen_items, batch.seen_offsets

    def _popularity(
        self, counts: torch.Tensor, split: str, keys: torch.Tensor | None = None
    ) -> dict[str, float]:
        """The metrics of ranking items by their train count: a query of 1 against one-dim item
        "vectors" holding the counts, so ties, candidates and exclusions are the model's (raw
        item keys: ``keys`` [N] ascending, the items counted)."""
        metrics = self._metrics()
        items = counts[:, None].to(self.device)  # [N, 1]
        for batch in self.loader(split):
            queries = torch.ones(batch.size, 1, dtype=torch.float64, device=self.device)
            metrics.update(queries, items, batch.targets, self._exclude(batch), keys)
        return metrics.compute()


def ranking_line(split: str, step: int, result: dict[str, Any]) -> str:
    """The line a ranking evaluation prints: ``eval valid step 200: hr@10 0.4123 ndcg@10
    0.2301 mrr 0.2010 hr@50 0.7012 (popularity hr@10 0.2034, oracle hr@10 0.5712)``."""
    line = f"eval {split} step {step}: " + " ".join(
        f"{name} {result[name]:.4f}" for name in ("hr@10", "ndcg@10", "mrr", "hr@50")
    )
    references = [f"popularity hr@10 {result['popularity_hr@10']:.4f}"]
    if "oracle_hr@10" in result:
        references.append(f"oracle hr@10 {result['oracle_hr@10']:.4f}")
    return f"{line} ({', '.join(references)})"
