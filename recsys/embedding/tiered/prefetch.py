"""The prefetch of a :class:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection`: a
coming batch's rows prepared in a background thread while the batch before it trains."""

from __future__ import annotations

import threading

from torchrec import KeyedJaggedTensor

from recsys.embedding.tiered.row_cache import CacheTooSmallError

__all__ = ["PrefetchBatch"]


class PrefetchBatch:
    """One queued batch whose rows a background thread prepares: ``start(work)`` runs ``work``
    (the collection's row preparation) in the thread, ``join`` waits for it, keeps its
    ``result`` and re-raises its error in the caller's thread. A batch that finds the cache
    full of the rows of the batch in flight is ``deferred``: its own forward prepares it."""

    def __init__(self, features: KeyedJaggedTensor, train: bool) -> None:
        self.features, self.train = features, train
        self.result: dict | None = None
        self.started = self.done = self.deferred = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, work) -> None:
        self.started = True
        # Not a daemon: a run that stops (or fails) with a batch in preparation waits for it
        # at exit instead of shutting the interpreter down under a thread inside torch.
        self._thread = threading.Thread(target=self._run, args=(work,))
        self._thread.start()

    def _run(self, work) -> None:
        try:
            self.result = work()
        except CacheTooSmallError:
            # The rows of the batch in flight leave no room: its own forward prepares it,
            # once that batch is done (slower, same results).
            self.deferred = True
        except BaseException as error:  # re-raised in the training thread by join
            self._error = error

    def join(self) -> None:
        self._thread.join()
        self.done = True
        if self._error is not None:
            error, self._error = self._error, None
            raise error
