"""What a run trains on and how it is judged, the part of the loop that differs between model
families: the data, its loaders, the loss and the evaluation. The trainer
(:mod:`recsys.train.trainer`) runs the same loop, checkpoints, best-checkpoint and early
stopping rules over either task:

- :class:`CTRTask`: click logs (synthetic, parquet, Criteo), BCE on the logits, AUC / logloss
  (:func:`recsys.train.evaluate.evaluate_split`);
- :class:`~recsys.train.retrieval.NextItemTask`: user histories of a sequence model (sasrec,
  hstu), next-item softmax, full-corpus ranking (HR@k, NDCG@k, MRR);
- :class:`~recsys.train.target_ranking.TargetRankingTask`: histories with labelled candidates
  (hstu_ranking), BCE on each candidate, AUC / logloss.

A task has ``spec`` (what the model is built for and ``spec.json`` records), ``loss`` (None:
the train step's BCE; else ``loss(model, batch) -> scalar``), :meth:`loader` (the batches of a
split, with ``len()``), :meth:`steps_per_epoch`, :meth:`evaluate` and :meth:`eval_line`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from recsys.config import SEQUENCE_MODELS, TARGET_RANKING_MODELS, Config
from recsys.data import build_dataset
from recsys.data.layout import Reshard
from recsys.data.loader import MAX_AUTO_WORKERS, BatchLoader, default_prefetch, default_workers
from recsys.data.workers import usable_cpus
from recsys.distributed.parallel import DistributedInfo
from recsys.train.evaluate import evaluate_split
from recsys.train.metrics import eval_line

__all__ = ["CTRTask", "build_task"]


class CTRTask:
    """Click logs: the dataset ``[data]`` names, read by :class:`BatchLoader` (each rank its
    share of the chunks), scored by AUC / logloss.

    Args:
        config: the run's config.
        device: where batches go.
        info: this process's rank and the world size.
        say: prints a line on the first rank.
    """

    loss = None  # the train step's BCE over the logits
    rate_unit = "samples"  # what samples_per_s counts, in the printed lines

    def __init__(
        self,
        config: Config,
        device: torch.device,
        info: DistributedInfo,
        say: Callable[[str], None],
    ) -> None:
        self.config, self.device, self.info = config, device, info
        self.dataset = build_dataset(config.data, config.run.seed)
        malformed = getattr(self.dataset, "malformed", None)
        if malformed is not None and malformed.count:
            say(f"{config.data.path}: {malformed.summary()}")
        self.spec = self.dataset.spec
        self.max_ids_per_sample = getattr(self.dataset, "max_ids_per_sample", {})

    def loader(
        self, split: str, epoch: int = 0, start_batch: int = 0, reshards: tuple[Reshard, ...] = ()
    ) -> BatchLoader:
        """This rank's batches of ``split`` (train: of epoch ``epoch`` from ``start_batch``,
        shuffled, in the layout ``reshards`` left)."""
        training = split == "train"
        config = self.config
        return BatchLoader(
            self.dataset,
            split,
            config.train.batch_size if training else config.train.eval_batch_size,
            shuffle=training and config.data.shuffle,
            seed=config.run.seed,
            epoch=epoch,
            drop_last=training,
            rank=self.info.rank,
            world_size=self.info.world_size,
            prefetch=self.prefetch(),
            device=self.device,
            shuffle_buffer_chunks=config.data.shuffle_buffer_chunks,
            start_batch=start_batch,
            reshards=reshards,
            workers=config.data.loader_workers,
        )

    def batch_makers(self) -> str:
        """What makes the train batches, and the setting that changes it (for the trainer's
        input-bound line)."""
        workers = self.config.data.loader_workers
        resolved = workers if workers >= 0 else default_workers(self.info.world_size)
        if resolved == 0:
            return (
                f"the training process (data.loader_workers = {workers}; "
                f"{usable_cpus()} CPU(s) here)"
            )
        return (
            f"{resolved} worker process(es) (data.loader_workers = {workers}; -1: half a "
            f"rank's CPUs, at most {MAX_AUTO_WORKERS}; {usable_cpus()} CPU(s) here)"
        )

    def prefetch(self) -> int:
        """``data.prefetch_batches`` (>= -1: checked with the config); -1 (auto): 4 on CUDA,
        none on CPU."""
        return default_prefetch(self.config.data.prefetch_batches, self.device.type == "cuda")

    def steps_per_epoch(self) -> int:
        """Batches per epoch on each rank.

        Raises:
            ValueError: a rank would get no batch.
        """
        steps = len(self.loader("train", epoch=0))
        if steps > 0:
            return steps
        world_size, num_chunks = self.info.world_size, self.dataset.num_chunks("train")
        if num_chunks < world_size:
            raise ValueError(
                f"the train split has {num_chunks} chunk(s) (row groups) for {world_size} "
                "ranks, and each rank reads whole chunks: some rank would get no data; use "
                "fewer ranks or write the data in more chunks"
            )
        raise ValueError(
            f"train.batch_size = {self.config.train.batch_size} x {world_size} rank(s) is "
            "larger than the train split"
        )

    def evaluate(self, model: nn.Module, split: str) -> dict[str, Any]:
        """AUC / logloss over the whole split (all ranks)."""
        return evaluate_split(
            model,
            self.dataset,
            split,
            self.config.train.eval_batch_size,
            self.device,
            self.info,
            prefetch=self.prefetch(),
            filler=lambda: next(iter(self.loader("train"))),  # a rank with fewer batches
        )

    def eval_line(self, split: str, step: int, result: dict[str, Any]) -> str:
        return eval_line(split, step, result)


def build_task(
    config: Config, device: torch.device, info: DistributedInfo, say: Callable[[str], None]
) -> Any:
    """The task of ``config``'s model: :class:`~recsys.train.retrieval.NextItemTask` for a
    sequence model (``model.name`` in :data:`~recsys.config.SEQUENCE_MODELS`), else
    :class:`CTRTask`."""
    if config.model.name in SEQUENCE_MODELS:
        from recsys.train.retrieval import NextItemTask

        return NextItemTask(config, device, info, say)
    if config.model.name in TARGET_RANKING_MODELS:
        from recsys.train.target_ranking import TargetRankingTask

        return TargetRankingTask(config, device, info, say)
    return CTRTask(config, device, info, say)
