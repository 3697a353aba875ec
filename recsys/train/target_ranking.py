"""The target-aware ranking task (``model.name = "hstu_ranking"``; see
:mod:`recsys.train.tasks`): user histories with labelled candidates in, BCE on each candidate's
logit as the loss, AUC / logloss as the evaluation, like the CTR models.

Data: the built-in synthetic interaction log (``[data.synthetic_sequences]``) with
``model.sequence.num_candidates`` candidates per user whose click probability is known
(:mod:`recsys.data.synthetic_ranking`); users are split 80 / 10 / 10 into train / valid / test
by ``run.seed``. Histories longer than ``model.sequence.max_len`` keep their latest events.
Every evaluation also reports ``oracle_auc``: the AUC of ranking the same candidates by their
true click probability, the best achievable.

Under torchrun the item table is sharded (placed by the planner, as sasrec's) and the rest runs
under DDP: each global batch of ``train.batch_size x world_size`` users is dealt out in
``train.batch_size`` slices, one per rank, and evaluation scores users r, r + W, ... on rank r
(a rank with fewer batches than the others looks up empty ones, as every lookup is a
collective), gathering every rank's scores for the AUC.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec import KeyedJaggedTensor

from recsys.config import Config
from recsys.data.batch import DatasetSpec
from recsys.data.synthetic_ranking import RankingSamples, oracle_auc, synthetic_ranking
from recsys.data.synthetic_sequences import SyntheticSequences
from recsys.distributed.parallel import DistributedInfo
from recsys.train.metrics import eval_line

__all__ = ["RankingBatch", "TargetRankingTask"]

ITEMS = "items"
SPLITS = {"train": (0.0, 0.8), "valid": (0.8, 0.9), "test": (0.9, 1.0)}


@dataclass
class RankingBatch:
    """Users' histories (``history`` one key, lengths [B], ``max_length`` the longest) and
    candidates (``candidates`` one key, lengths [B], ``max_candidates`` the most), with
    ``labels`` [sum m] (0. / 1.) in candidate order."""

    history: KeyedJaggedTensor
    max_length: int
    candidates: KeyedJaggedTensor
    max_candidates: int
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return self.history.lengths().numel()

    def to(self, device: torch.device, non_blocking: bool = False) -> RankingBatch:
        return RankingBatch(
            self.history.to(device, non_blocking=non_blocking),
            self.max_length,
            self.candidates.to(device, non_blocking=non_blocking),
            self.max_candidates,
            self.labels.to(device, non_blocking=non_blocking),
        )


class _Epoch:
    """The batches of one epoch of a split (each the users of one batch, on this rank) from
    ``start`` on; ``len()`` is the epoch's whole length."""

    def __init__(self, task: TargetRankingTask, batches: list[np.ndarray], start: int) -> None:
        self.task, self.batches, self.start = task, batches, start

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[RankingBatch]:
        for users in self.batches[self.start :]:
            yield self.task.batch(users).to(self.task.device)

    @property
    def layout(self) -> Any:
        raise ValueError(
            "an hstu_ranking run resumes with the train.batch_size and number of processes it "
            "was saved with"
        )


class TargetRankingTask:
    """Histories with labelled candidates, BCE, AUC (see the module docstring).

    Args:
        config: the run's config (``[data.synthetic_sequences]``, ``[model.sequence]``).
        device: where batches go.
        info: this process's rank and the world size.
        say: prints a line on the first rank.

    Raises:
        ValueError: data other than the built-in synthetic log.
    """

    rate_unit = "samples"

    def __init__(
        self,
        config: Config,
        device: torch.device,
        info: DistributedInfo,
        say: Callable[[str], None],
    ) -> None:
        if config.data.path or config.data.source not in ("auto", "synthetic_sequences"):
            raise ValueError(
                f"model.name = 'hstu_ranking' trains on the built-in synthetic ranking data "
                f"only (data.source = 'auto' or 'synthetic_sequences', no data.path); got "
                f"data.source = {config.data.source!r}, data.path = {config.data.path!r}"
            )
        self.config, self.device, self.info = config, device, info
        sequence = config.model.sequence
        self.max_len = sequence.max_len
        options = asdict(config.data.synthetic_sequences)
        if options.pop("id_encoding") != "index":
            raise ValueError(
                "model.name = 'hstu_ranking' trains on item indices; data.synthetic_sequences."
                "id_encoding = 'raw' (dynamic item tables) is for sasrec / hstu"
            )
        try:
            params = SyntheticSequences(**options, seed=config.run.seed)
        except ValueError as error:
            raise ValueError(f"[data.synthetic_sequences]: {error}") from None
        self.samples: RankingSamples = synthetic_ranking(params, sequence.num_candidates)
        order = np.random.default_rng(config.run.seed).permutation(self.samples.num_users)
        self.users = {
            split: order[int(low * len(order)) : int(high * len(order))]
            for split, (low, high) in SPLITS.items()
        }
        for split, users in self.users.items():
            if len(users) == 0:
                raise ValueError(
                    f"the {split} split has no user: data.synthetic_sequences.num_users = "
                    f"{params.num_users} is too few for an 80 / 10 / 10 split"
                )
        self.spec = DatasetSpec(
            dense_names=(),
            sparse_names=(ITEMS,),
            cardinalities=(params.num_items,),
            label_names=("click",),
            fingerprint="",
            id_encoding="index",
        )
        self.max_ids_per_sample: dict[str, int] = {}
        self.oracle = {
            split: oracle_auc(self.samples, users) for split, users in self.users.items()
        }
        longest = int(np.diff(self.samples.offsets).max())
        if longest > self.max_len:
            say(
                f"histories of up to {longest} events are cut to their last {self.max_len} "
                "(model.sequence.max_len)"
            )

    def batch(self, users: np.ndarray) -> RankingBatch:
        """The batch of ``users`` (their latest ``max_len`` events and all candidates)."""
        samples = self.samples
        starts = np.maximum(samples.offsets[users + 1] - self.max_len, samples.offsets[users])
        ends = samples.offsets[users + 1]
        lengths = ends - starts
        pieces = [samples.items[a:b] for a, b in zip(starts, ends, strict=True)]
        history = np.concatenate([samples.items[:0], *pieces])  # no users: an empty batch
        candidates = samples.candidates[users]  # [B, C]
        count = candidates.shape[1]
        return RankingBatch(
            KeyedJaggedTensor(
                keys=[ITEMS],
                values=torch.from_numpy(history.astype(np.int64)),
                lengths=torch.from_numpy(lengths.astype(np.int64)),
                stride=len(users),
            ),
            int(lengths.max(initial=0)),
            KeyedJaggedTensor(
                keys=[ITEMS],
                values=torch.from_numpy(candidates.ravel().astype(np.int64)),
                lengths=torch.full((len(users),), count, dtype=torch.int64),
                stride=len(users),
            ),
            count,
            torch.from_numpy(samples.labels[users].ravel()),
        )

    def logits(self, model: nn.Module, batch: RankingBatch) -> torch.Tensor:
        """[sum m] the first task's logit of each candidate."""
        return model(batch.history, batch.max_length, batch.candidates, batch.max_candidates)[:, 0]

    def loss(self, model: nn.Module, batch: RankingBatch) -> torch.Tensor:
        """BCE of the candidates' clicks."""
        return F.binary_cross_entropy_with_logits(self.logits(model, batch).float(), batch.labels)

    def loader(
        self, split: str, epoch: int = 0, start_batch: int = 0, reshards: tuple = ()
    ) -> _Epoch:
        """This rank's batches of ``split`` from ``start_batch`` on (train: epoch ``epoch``
        shuffled by run.seed, whole global batches only, this rank's slice of each; valid /
        test: users rank, rank + W, ... in order)."""
        train = self.config.train
        rank, world = self.info.rank, self.info.world_size
        users = self.users[split]
        if split == "train":
            generator = np.random.default_rng([self.config.run.seed, epoch])
            users = users[generator.permutation(len(users))]
            size, step = train.batch_size, train.batch_size * world
            starts = range(rank * size, len(users) // step * step, step)
            return _Epoch(self, [users[a : a + size] for a in starts], start_batch)
        mine, size = users[rank::world], train.eval_batch_size
        return _Epoch(self, [mine[a : a + size] for a in range(0, len(mine), size)], start_batch)

    def batch_makers(self) -> str:
        """What makes the train batches (for the trainer's input-bound line)."""
        return "the training process (sequence batches have no worker processes)"

    def steps_per_epoch(self) -> int:
        steps = len(self.loader("train"))
        if steps == 0:
            raise ValueError(
                f"train.batch_size = {self.config.train.batch_size} x {self.info.world_size} "
                f"processes is larger than the {len(self.users['train'])} train users"
            )
        return steps

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, Any]:
        """AUC and logloss of the candidates of ``split``'s users (every rank's), and the
        oracle's AUC."""
        model = getattr(model, "module", model)  # no gradients: around a DDP wrapper
        was_training = model.training
        model.eval()
        logits, labels = [], []
        batches = self.loader(split)
        world, size = self.info.world_size, self.config.train.eval_batch_size
        most = -(-len(self.users[split][::world]) // size)  # rank 0's batches, the most
        for batch in batches:
            logits.append(self.logits(model, batch).float())
            labels.append(batch.labels)
        for _ in range(most - len(batches)):  # as many lookups as rank 0 (collectives)
            self.logits(model, self.batch(np.zeros(0, dtype=np.int64)).to(self.device))
        model.train(was_training)
        scores = torch.cat([torch.zeros(0), *(x.cpu() for x in logits)])
        truth = torch.cat([torch.zeros(0), *(x.cpu() for x in labels)])
        if world > 1:
            parts: list[Any] = [None] * world
            dist.all_gather_object(parts, (scores, truth))
            scores = torch.cat([p[0] for p in parts])
            truth = torch.cat([p[1] for p in parts])
        return {
            "auc": float(binary_auroc(scores, truth.long())),
            "logloss": float(F.binary_cross_entropy_with_logits(scores, truth)),
            "oracle_auc": self.oracle[split],
            "num_users": len(self.users[split]),
        }

    def eval_line(self, split: str, step: int, result: dict[str, Any]) -> str:
        return eval_line(split, step, result)
