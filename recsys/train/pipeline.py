"""The pipelined train step (``train.pipeline``): while batch i trains, batch i+1 is already
pulled from the loader, on the device (:class:`~recsys.data.loader.BatchLoader` builds batches
ahead in worker processes, ``data.loader_workers``, and pins and copies them ahead in a
background thread, ``data.prefetch_batches``) and, under torchrun,
its ids have been through every sharded collection's input_dist: the stage TorchRec's
``TrainPipelineSparseDist`` runs ahead.

One step, in the same order on every rank (so the ranks' collectives match)::

    pull batch i+1; prefetch_input(i+1) on each sharded collection   (its counts posted)
    forward(i): compute -> output_dist (its ids arrived during step i-1), then batch i+1's
                counts are read and its ids sent, not waited for
    backward(i), optimizer step(i)                                     (batch i+1's ids travel)

Results are the plain loop's, bitwise: input_dist is a function of the batch's ids alone
(routed by the plan and a key hash; no table value is read or written: a KEY_WISE key is
inserted by compute, on its owner, and tiered shards only move rows exactly between their cache
and store) and draws no random numbers, and a batch depends only on (seed, epoch,
position). A batch pulled ahead is not consumed: the trainer counts trained batches, so a
checkpoint after step i resumes at batch i+1. Nothing is pulled past ``limit`` (max_steps) or
across the end of an epoch; a stop after step i (early stopping, a signal) leaves the input_dist
of batch i+1 done and unused, which changed nothing, and the collections forget it.

``train.pipeline = "auto"`` (the default) pipelines on CUDA where a collection exchanges ids
(torchrun with more than one rank, some table not DATA_PARALLEL). On CPU it is off: on 2 gloo
ranks of a 2-core machine there is little idle time for the exchange to run in (the pipelined
step measured 0.83x the plain one with the counts exchanged at pull time, 1.05-1.08x with
them read after forward: ``benchmarks/results/train_step.csv``). In one process there
is no input_dist to run ahead. "on" pipelines anyway (and says it is inactive where nothing runs
ahead: :attr:`TrainPipeline.note`), "off" is the plain loop.

Tiered tables (``[model.storage]``) are pipelined unless "off": pulling batch i+1 queues it on
every tiered collection
(:meth:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection.prefetch`), whose forward
of batch i starts a thread bringing batch i+1's rows into the cache while batch i trains. Results
are the plain loop's, bitwise (rows move exactly; batch i's rows are pinned).

The exchange of batch i+1 overlaps step i: ``prefetch_input`` posts the counts (a small
all-to-all, :func:`recsys.distributed.counts.start_counts`; on CUDA with its copy to the host on
a side stream, ordered by events), forward(i) computes while they travel and reads them after
its output_dist (the sync the counts need, which no longer waits for the step's kernels on
CUDA), then sends the lengths, ids and weights in one all-to-all without waiting
(:func:`recsys.distributed.comm.send_ids`); they travel during backward(i) and forward(i+1)
waits for them. A batch i+1 that fails the input check raises in forward(i+1) on every rank,
after step i trained, as in the plain loop. What the pipeline saves is measured by
``python -m benchmarks.train_step`` (``benchmarks/results/train_step.csv``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

from torch import nn

from recsys.build.tiered_tables import tiered_collections
from recsys.data.batch import Batch
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.interface import embedding_collections

PIPELINE_MODES = ("auto", "on", "off")


def sharded_collections(model: nn.Module) -> list[ShardedEmbeddingBagCollection]:
    """``model``'s sharded collections whose forward exchanges ids (an input_dist to run
    ahead): those with a table that is not DATA_PARALLEL."""
    return [
        collection
        for collection in embedding_collections(model).values()
        if isinstance(collection, ShardedEmbeddingBagCollection) and collection.routing.num_streams
    ]


def pipeline_enabled(mode: str, model: nn.Module) -> bool:
    """Whether ``train.pipeline = mode`` pipelines the steps of ``model``: "on" always, "off"
    never, "auto" when :func:`sharded_collections` finds a collection on a CUDA device.

    Raises:
        ValueError: ``mode`` is not one of :data:`PIPELINE_MODES`.
    """
    if mode not in PIPELINE_MODES:
        raise ValueError(
            f"train.pipeline = {mode!r}; expected one of {', '.join(map(repr, PIPELINE_MODES))}"
        )
    if mode == "auto":
        return any(c.device.type == "cuda" for c in sharded_collections(model))
    return mode == "on"


class TrainPipeline:
    """Batches of an epoch for the train loop, each handed out once the next one is pulled and
    its input_dist done (see the module docstring).

    Args:
        model: the model being trained (DDP-wrapped or not); its sharded collections get
            :meth:`~recsys.distributed.sharded.ShardedEmbeddingBagCollection.prefetch_input`.
        mode: ``train.pipeline``: "auto", "on" or "off".

    Raises:
        ValueError: an unknown ``mode``.

    Example::

        pipeline = TrainPipeline(model, "auto")
        for index, batch in pipeline.batches(loader, start=done, limit=total_steps - step):
            loss = step(batch)  # the model's forward is handed batch.sparse, as prefetched
    """

    def __init__(self, model: nn.Module, mode: str = "auto") -> None:
        sharded = pipeline_enabled(mode, model)
        self.collections = sharded_collections(model) if sharded else []
        # Tiered tables prepare batch i+1's rows while batch i trains, unless "off".
        # A sharded one prefetches its rows in prefetch_input when that runs.
        tiered = tiered_collections(model) if mode != "off" else []
        self.tiered = [c for c in tiered if not any(c is s for s in self.collections)]
        self.enabled = sharded or bool(self.tiered)
        self.note = None  # what a run prints when "on" has nothing to run ahead
        if mode == "on" and not self.collections and not self.tiered:
            self.note = (
                'train.pipeline = "on" is inactive here: no embedding collection exchanges ids '
                "(one process, or every table data_parallel) and none is tiered, so there is no "
                "input_dist or row prefetch to run ahead of the step"
            )

    def batches(
        self, loader: Iterable[Batch], start: int = 0, limit: int | None = None
    ) -> Iterator[tuple[int, Batch]]:
        """``(index, batch)`` pairs of ``loader`` like ``enumerate(loader, start)``, at most
        ``limit`` of them (None: all); none is pulled beyond the limit. Enabled, batch i is
        handed out after batch i+1 was pulled and went through input_dist. Closing the
        iterator early (a ``break``) makes the collections forget a batch run ahead.

        Args:
            loader: the epoch's batches (a :class:`~recsys.data.loader.BatchLoader`).
            start: the index of the first batch (batches of the epoch already trained).
            limit: the most batches to hand out (the steps left before max_steps).
        """
        source = iter(loader)
        batches = source if limit is None else islice(source, max(limit, 0))
        try:
            if not self.enabled:
                yield from enumerate(batches, start=start)
                return
            ahead = self._pull(batches)
            index = start
            while ahead is not None:
                current, ahead = ahead, self._pull(batches)
                yield index, current
                index += 1
        finally:
            for collection in [*self.collections, *self.tiered]:
                collection.drop_prefetched()
            close = getattr(source, "close", None)
            if close is not None:  # a generator (BatchLoader's) stops its background thread
                close()

    def _pull(self, batches: Iterator[Batch]) -> Batch | None:
        """The next batch with its input_dist done on every sharded collection (None: none
        left)."""
        batch = next(batches, None)
        if batch is not None:
            for collection in self.collections:
                collection.prefetch_input(batch.sparse)
            # A sequence batch has no ``sparse``: its model builds the lookup (history and
            # sampled candidates) in its forward, which prepares the rows then.
            sparse = getattr(batch, "sparse", None)
            for collection in self.tiered if sparse is not None else []:
                collection.prefetch(sparse)
        return batch
