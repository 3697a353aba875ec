"""Worker processes that build a loader's batches ahead of training, off its process.

A :class:`WorkerPool` runs ``build(task)`` for tasks 0, 1, 2, ... in W forked processes (task i
on worker i mod W) and hands back the results in task order. A task's result is a list of
``(batch index, Batch)``; the batches of one task travel together, packed into one
shared-memory tensor per dtype (a few file descriptors per task, not several per batch), and
are unpacked on arrival as views of those tensors. Workers run at most ``ahead`` tasks beyond
the one being handed back, so memory stays bounded.

Processes, not threads: building a batch is Python-heavy (a loop over features, slicing), and
a thread would hold the training thread's interpreter lock. Workers are forked (the dataset
and the loader's plan are inherited, nothing is pickled but task numbers and results), run
torch with one thread each, ignore Ctrl-C (the training process handles it and stops them) and
never touch CUDA: on a GPU run, pinning and the copy to the device happen in the training
process.

A worker's error is raised in the training process with the worker's traceback as a note; a
worker that dies (killed, out of memory) raises a ``RuntimeError`` naming its exit code.
:meth:`WorkerPool.close` stops every worker, also after an early ``break`` or an exception.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Event

import torch
import torch.multiprocessing as mp
from torchrec import KeyedJaggedTensor

from recsys.data.batch import Batch

Built = list[tuple[int, Batch]]
"""What one task builds: batches (or pieces of one, when a batch spans two tasks) with the
index of the batch each belongs to."""

_POLL_S = 0.1  # how often a blocked worker or reader checks for a stop or a dead peer
_ALIGN = 64  # bytes: every packed tensor starts where torch's allocator would put it


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class WorkerPool:
    """``build(0)``, ``build(1)``, ... ``build(num_tasks - 1)`` in ``num_workers`` processes.

    Args:
        build: task index -> :data:`Built`; runs in a forked worker.
        num_tasks: how many tasks there are.
        num_workers: processes W (at most ``num_tasks`` are started).
        ahead: tasks handed to the workers beyond the one being read (at least W, so that
            every worker has one).
        pin: pin the arriving batches (for ``.to(cuda, non_blocking=True)``).

    Example::

        pool = WorkerPool(build, num_tasks=10, num_workers=2, ahead=2)
        try:
            for built in pool.results():
                ...
        finally:
            pool.close()
    """

    def __init__(
        self,
        build: Callable[[int], Built],
        num_tasks: int,
        num_workers: int,
        ahead: int,
        pin: bool = False,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_tasks = num_tasks
        self.num_workers = max(1, min(num_workers, num_tasks))
        self.ahead = max(ahead, self.num_workers)
        self.pin = pin
        self.closed = False
        context = mp.get_context("fork")
        self._stop = context.Event()
        self._tasks = [context.Queue() for _ in range(self.num_workers)]
        self._results = [context.Queue() for _ in range(self.num_workers)]
        self._processes = [
            context.Process(
                target=_work,
                args=(build, self._tasks[k], self._results[k], self._stop, os.getpid()),
                name=f"recsys-batch-worker-{k}",
                daemon=True,
            )
            for k in range(self.num_workers)
        ]
        self._submitted = 0
        for process in self._processes:
            process.start()

    def results(self) -> Iterator[Built]:
        """Every task's batches, in task order (raises a worker's error where it happened)."""
        for task in range(self.num_tasks):
            while self._submitted < min(task + 1 + self.ahead, self.num_tasks):
                self._tasks[self._submitted % self.num_workers].put(self._submitted)
                self._submitted += 1
            kind, done, payload = self._receive(task % self.num_workers)
            if kind == "error":
                raise payload
            assert done == task, f"worker sent task {done}, expected {task}"
            yield unpack_batches(payload, self.pin)

    def close(self) -> None:
        """Stop the workers (idle ones exit, busy ones are terminated) and wait for them."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        for tasks in self._tasks:
            tasks.put(None)
        for process in self._processes:
            process.join(timeout=2 * _POLL_S)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
        for results in self._results:
            results.cancel_join_thread()
            results.close()

    def _receive(self, worker: int) -> tuple[str, int, object]:
        process, results = self._processes[worker], self._results[worker]
        while True:
            if self.closed:
                raise RuntimeError("the batch loader's worker pool was closed")
            try:
                return results.get(timeout=_POLL_S)
            except queue.Empty:
                if not process.is_alive():
                    raise self._died(worker) from None
            except (OSError, EOFError) as error:  # its shared memory went with it
                process.join(timeout=1.0)
                if process.is_alive():
                    raise
                raise self._died(worker) from error

    def _died(self, worker: int) -> RuntimeError:
        process = self._processes[worker]
        return RuntimeError(
            f"batch loader worker {worker} (pid {process.pid}) exited with code "
            f"{process.exitcode} before sending its batches (killed? out of memory?)"
        )


def _work(
    build: Callable[[int], Built],
    tasks: mp.Queue,
    results: mp.Queue,
    stop: Event,
    parent: int,
) -> None:
    """A worker's loop: build the tasks it is given, send each result (or the error); return
    when told to stop or when the training process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process handles Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # inherited handlers would keep it alive
    torch.set_num_threads(1)

    def stopped() -> bool:
        return stop.is_set() or os.getppid() != parent

    failed = False
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if stopped():
                return
            continue
        if task is None or stopped():
            return
        if failed:  # stay alive: the batches sent before are received from this process
            continue
        try:
            message = ("ok", task, pack_batches(build(task)))
        except BaseException as error:
            message = ("error", task, _portable(error, task))
            failed = True
        results.put(message)


def _portable(error: BaseException, task: int) -> BaseException:
    """``error`` with the worker's traceback as a note, as it can cross to the training
    process (else a RuntimeError carrying its text)."""
    where = f"in batch loader worker pid {os.getpid()}, task {task}:\n"
    text = where + "".join(traceback.format_exception(error))
    try:
        error.add_note(text)
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}\n{text}")


Packed = tuple[dict[torch.dtype, torch.Tensor], list[tuple]]
"""One task's batches, packed: per dtype one flat shared-memory tensor; per batch its tensors'
(dtype, start, shape) in those and its KJT's host-side fields (keys, stride, ids per key, key
offsets)."""


def pack_batches(built: Built) -> Packed:
    """``built``'s tensors copied into one shared-memory tensor per dtype (each tensor at a
    64-byte boundary), so that the task crosses to another process as a few file descriptors;
    :func:`unpack_batches` gives the batches back."""
    layout: list[tuple] = []
    sizes: dict[torch.dtype, int] = {}
    tensors: list[torch.Tensor] = []

    def place(tensor: torch.Tensor | None) -> tuple | None:
        if tensor is None:
            return None
        step = _ALIGN // tensor.element_size()
        start = -(-sizes.get(tensor.dtype, 0) // step) * step
        sizes[tensor.dtype] = start + tensor.numel()
        tensors.append(tensor)
        return (tensor.dtype, start, tuple(tensor.shape))

    for index, batch in built:
        kjt = batch.sparse
        layout.append(
            (
                index,
                [place(t) for t in (batch.dense, batch.labels)],
                [place(t) for t in (kjt.values(), kjt.weights_or_none())],
                [place(t) for t in (kjt.lengths(), kjt.offsets())],
                (kjt.keys(), kjt.stride(), kjt.length_per_key(), kjt.offset_per_key()),
            )
        )
    flat = {dtype: torch.empty(size, dtype=dtype).share_memory_() for dtype, size in sizes.items()}
    places = (p for entry in layout for group in entry[1:4] for p in group if p is not None)
    for tensor, (dtype, start, _) in zip(tensors, places, strict=True):
        flat[dtype][start : start + tensor.numel()].view(tensor.shape).copy_(tensor)
    return flat, layout


def unpack_batches(packed: Packed, pin: bool = False) -> Built:
    """The batches of :func:`pack_batches`, as views of its tensors (pinned first with
    ``pin``), their KJTs carrying offsets, ids per key and key offsets."""
    flat, layout = packed
    if pin:
        flat = {dtype: tensor.pin_memory() for dtype, tensor in flat.items()}

    def view(place: tuple | None) -> torch.Tensor | None:
        if place is None:
            return None
        dtype, start, shape = place
        numel = 1
        for size in shape:
            numel *= size
        return flat[dtype][start : start + numel].view(shape)

    built = []
    for index, (dense, labels), (values, weights), (lengths, offsets), kjt in layout:
        keys, stride, length_per_key, offset_per_key = kjt
        sparse = KeyedJaggedTensor(
            keys=keys,
            values=view(values),
            weights=view(weights),
            lengths=view(lengths),
            offsets=view(offsets),
            stride=stride,
            length_per_key=length_per_key,
            offset_per_key=offset_per_key,
        )
        built.append((index, Batch(dense=view(dense), sparse=sparse, labels=view(labels))))
    return built
