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


Packed = tuple[list[torch.Tensor], list[tuple]]
"""One task's batches, packed: shared-memory byte buffers, and per batch its tensors' places
in them (buffer, dtype, element offset, shape, stride) and its KJT's host-side fields (keys,
stride, ids per key, key offsets)."""


def pack_batches(built: Built) -> Packed:
    """``built``'s batches as a few shared-memory buffers, so that a task crosses to another
    process as a few file descriptors: a tensor already in shared memory (as
    :meth:`BatchLoader.build_task <recsys.data.loader.BatchLoader.build_task>` gathers them in
    a worker) is sent as the place in its buffer, any other is copied into one new buffer (at
    a 64-byte boundary); :func:`unpack_batches` gives the batches back."""
    buffers: list[torch.Tensor] = []
    known: dict[int, int] = {}  # storage address -> index in buffers
    copies: list[tuple[torch.Tensor, int]] = []  # (tensor, byte offset in the copy buffer)
    copy_bytes = 0

    def place(tensor: torch.Tensor | None) -> tuple | None:
        nonlocal copy_bytes
        if tensor is None:
            return None
        storage = tensor.untyped_storage()
        if storage.is_shared():
            if storage.data_ptr() not in known:
                known[storage.data_ptr()] = len(buffers)
                buffers.append(torch.empty(0, dtype=torch.uint8).set_(storage))
            where = known[storage.data_ptr()]
            return (
                where,
                tensor.dtype,
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
            )
        start = -(-copy_bytes // _ALIGN) * _ALIGN
        copies.append((tensor, start))
        copy_bytes = start + tensor.numel() * tensor.element_size()
        contiguous = tuple(torch.empty(tensor.shape, device="meta").stride())
        return (None, tensor.dtype, start // tensor.element_size(), tuple(tensor.shape), contiguous)

    layout = []
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
    if copies:
        target = shared_empty(copy_bytes, torch.uint8)
        for tensor, start in copies:
            size = tensor.numel() * tensor.element_size()
            target[start : start + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        layout = [_in_buffer(entry, len(buffers)) for entry in layout]
        buffers.append(target)
    return buffers, layout


def _in_buffer(entry: tuple, copy_buffer: int) -> tuple:
    """``entry`` with its copied tensors' places pointing at buffer ``copy_buffer``."""
    index, *groups, kjt = entry

    def fix(where: tuple | None) -> tuple | None:
        return where if where is None or where[0] is not None else (copy_buffer, *where[1:])

    return (index, *[[fix(w) for w in group] for group in groups], kjt)


def shared_empty(size: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized [size] tensor in shared memory. ``share_memory_()`` of a fresh tensor
    would copy its garbage into the new segment: a second pass over the memory (measured 1.8x
    slower for 48 MB), hence the storage constructor torch's own DataLoader workers collate
    into."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:  # not in this torch: the copying way
        return torch.empty(size, dtype=dtype).share_memory_()
    return torch.empty(0, dtype=dtype).set_(new_shared(size * itemsize))


def unpack_batches(packed: Packed, pin: bool = False) -> Built:
    """The batches of :func:`pack_batches`, as views of its buffers (pinned first with
    ``pin``), their KJTs carrying offsets, ids per key and key offsets."""
    buffers, layout = packed
    if pin:
        buffers = [buffer.pin_memory() for buffer in buffers]

    def view(where: tuple | None) -> torch.Tensor | None:
        if where is None:
            return None
        buffer, dtype, offset, shape, stride = where
        storage = buffers[buffer].untyped_storage()
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)

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
