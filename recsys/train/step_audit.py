"""Counting what a training step makes the host wait for: device syncs, kernel-like ops and
collectives, each with the recsys ``file:line`` that issued it.

On a GPU every op that needs a device value on the host (``.item()``, ``int(t)``, ``bool(t)``,
``.tolist()``, ``nonzero``, a boolean-mask index, ``unique``, ``repeat_interleave`` without
``output_size``, a tensor built from a host list on the device, ``torch.cuda.synchronize``)
stalls the stream until it drains. :class:`StepAudit` sees them on any device, the CPU included:
a ``TorchDispatchMode`` records every aten op, plus Python-level hooks for what does not reach
the dispatcher (``Tensor.tolist``, ``Tensor.numpy``, ``torch.cuda.synchronize``).

- a **sync** is one of :data:`SYNC_OPS`, a data-dependent ``repeat_interleave`` or
  boolean-mask ``index``, a tensor made from host data (``lift_fresh``: ``torch.tensor(list)``,
  a host-to-device copy on CUDA), on a device run a copy between host and device without
  ``non_blocking``, or a hooked call;
- a **collective** is an op of the ``c10d`` namespace;
- a **kernel-like op** is every other op that is not a view, an allocation or a metadata read:
  on CUDA roughly one launch each.

On a CUDA run an op on host tensors is no sync and is not counted; on a CPU run (where every
tensor is a host tensor) the audit counts every op as if the step ran on a device, except the
creation and scalar reads of ``torch.optim``'s step counters, which torch keeps on the host on
every device (unless ``capturable`` or ``fused``).

Each record is attributed to the innermost frame in the ``recsys`` package (the code a fix
goes into), or to the innermost frame outside torch when no recsys frame is on the stack.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

_aten = torch.ops.aten

# Ops whose result the host must read before it can go on (output size or value is
# data-dependent).
SYNC_OPS = frozenset(
    {
        _aten._local_scalar_dense.default,
        _aten.nonzero.default,
        _aten.nonzero_static.default,
        _aten.argwhere.default,
        _aten.masked_select.default,
        _aten._unique.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.unique_dim_consecutive.default,
        _aten.equal.default,
        _aten.is_nonzero.default,
        _aten.allclose.default,
        _aten.lift_fresh.default,
    }
)
SYNC_OPS = SYNC_OPS - {_aten.nonzero_static.default}  # fixed size: no sync

# Ops that allocate, alias or read metadata: no kernel runs.
_FREE_OPS = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_like.default,
        _aten.empty_strided.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
        _aten.detach.default,
        _aten.alias.default,
        _aten.lift_fresh.default,
        _aten.set_.source_Storage_storage_offset,
        _aten.resize_.default,
        _aten.sym_size.int,
        _aten.sym_stride.int,
        _aten.sym_numel.default,
        _aten.sym_storage_offset.default,
        _aten.is_same_size.default,
        _aten._local_scalar_dense.default,
        _aten.scalar_tensor.default,  # a Python number wrapped for an op: a kernel argument
    }
)
# torch.optim makes (``torch.tensor(0.0)``) and reads its step counters on the host.
_OPTIM_HOST_SCALARS = frozenset({_aten._local_scalar_dense.default, _aten.lift_fresh.default})
# In-place ops that change only a tensor's sizes and strides (``x @ w`` with a 1-d ``x`` runs
# ``squeeze_`` on its result): no kernel either.
_FREE_PACKETS = frozenset(
    {
        _aten.squeeze_,
        _aten.unsqueeze_,
        _aten.transpose_,
        _aten.t_,
        _aten.as_strided_,
        _aten.swapdims_,
        _aten.swapaxes_,
    }
)


def _spellings(path: str, directory: bool = True) -> tuple[str, ...]:
    """``path`` as imported and with links resolved: a frame's ``co_filename`` is the path the
    module was found under (a virtual environment or checkout reached through a symlink keeps
    the link), a directory with its trailing separator (``torch/`` is not ``torchrec/``)."""
    tail = os.sep if directory else ""
    return tuple(dict.fromkeys(p + tail for p in (os.path.abspath(path), os.path.realpath(path))))


_PACKAGE_DIRS = _spellings(os.path.dirname(os.path.dirname(__file__)))  # .../recsys/
_THIS_FILES = _spellings(__file__, directory=False)
_OPTIM_DIRS = _spellings(os.path.dirname(torch.optim.__file__))
_TORCH_DIRS = _spellings(os.path.dirname(torch.__file__))


def _site() -> str:
    """``file:line`` of the innermost recsys frame on the stack (else the innermost frame
    outside torch and this module), the path relative to the package's parent."""
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename not in _THIS_FILES:
            for package_dir in _PACKAGE_DIRS:
                if filename.startswith(package_dir):
                    relative = Path(filename).relative_to(Path(package_dir).parent)
                    return f"{relative}:{frame.f_lineno}"
            if fallback is None and not filename.startswith(_TORCH_DIRS):
                fallback = f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "<unknown>"


@dataclass
class AuditReport:
    """What the audited region did: each sync, kernel-like op and collective, with where."""

    syncs: list[tuple[str, str]] = field(default_factory=list)  # (what, site)
    ops: Counter[str] = field(default_factory=Counter)  # site -> kernel-like ops
    op_names: Counter[str] = field(default_factory=Counter)  # aten op -> count
    collectives: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_syncs(self) -> int:
        return len(self.syncs)

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_collectives(self) -> int:
        return len(self.collectives)

    def ops_by_file(self) -> Counter[str]:
        """Kernel-like ops per source file (the ``file`` of each ``file:line`` site)."""
        by_file: Counter[str] = Counter()
        for site, count in self.ops.items():
            by_file[site.rsplit(":", 1)[0]] += count
        return by_file

    def scaled(self, steps: int) -> AuditReport:
        """Per-step counts of a report over ``steps`` steps (ops divided, rounded)."""
        if steps == 1:
            return self
        return AuditReport(
            self.syncs[: len(self.syncs) // steps],
            Counter({k: round(v / steps) for k, v in self.ops.items()}),
            Counter({k: round(v / steps) for k, v in self.op_names.items()}),
            self.collectives[: len(self.collectives) // steps],
        )

    def describe(self) -> str:
        """Syncs with their sites, collectives, and the op count (by file)."""
        lines = [
            f"{self.num_syncs} sync(s), {self.num_ops} kernel-like op(s), "
            f"{self.num_collectives} collective(s)"
        ]
        lines += [f"  sync {what} at {site}" for what, site in self.syncs]
        lines += [f"  collective {what} at {site}" for what, site in self.collectives]
        lines += [f"  {count:5d} ops in {path}" for path, count in self.ops_by_file().most_common()]
        return "\n".join(lines)


def _called_from(directories: tuple[str, ...]) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(directories):
            return True
        frame = frame.f_back
    return False


def _host_only(args: tuple) -> bool:
    """Every tensor argument is a host tensor."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


class _Dispatch(TorchDispatchMode):
    def __init__(self, report: AuditReport, on_device: bool) -> None:
        super().__init__()
        self.report = report
        self.on_device = on_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(func, args, kwargs)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        report = self.report
        name = str(func.overloadpacket.__name__)
        if func.namespace == "c10d":
            report.collectives.append((name, _site()))
            return
        if self.on_device and _blocking_copy(func, args, kwargs):
            report.syncs.append((name, _site()))  # the host waits for the stream to drain
            return
        if _is_sync(func, args, kwargs):
            if self.on_device and _host_only(args):
                return  # a host op on a device run: nothing to wait for
            if func in _OPTIM_HOST_SCALARS and _called_from(_OPTIM_DIRS):
                return  # torch.optim's step counter: a host tensor on every device
            report.syncs.append((name, _site()))
            return
        if func in _FREE_OPS or func.is_view or func.overloadpacket in _FREE_PACKETS:
            return
        if func.namespace not in ("aten", "fbgemm"):
            return
        report.ops[_site()] += 1
        report.op_names[name] += 1


def _blocking_copy(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy between host and device memory without ``non_blocking``: torch synchronizes the
    stream after it (``.to(device)``, ``.cpu()``, ``copy_`` across devices)."""
    if func is _aten._to_copy.default:
        target = kwargs.get("device")
        return (
            target is not None
            and torch.device(target).type != args[0].device.type
            and not kwargs.get("non_blocking", False)
        )
    if func is _aten.copy_.default:
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return args[0].device.type != args[1].device.type and not non_blocking
    return False


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in SYNC_OPS:
        return True
    packet = func.overloadpacket
    if packet is _aten.repeat_interleave and isinstance(args[0], torch.Tensor):
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if packet is _aten.index or packet is _aten.index_put or packet is _aten.index_put_:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


_HOOKED: list[tuple[Any, str]] = [
    (torch.Tensor, "tolist"),
    (torch.Tensor, "numpy"),
    (torch.cuda, "synchronize"),
]
_LOCK = threading.Lock()


@contextmanager
def StepAudit(device: torch.device | str = "cpu") -> Iterator[AuditReport]:
    """Record the syncs, kernel-like ops and collectives of the code run inside (this thread's
    ops, and those of the autograd threads its backward runs on; work of another thread is
    not counted). ``device``: where the step runs; on a CUDA device host-only ops are not syncs.

    Example::

        with StepAudit() as report:
            step(batch)
        assert report.num_syncs == 0, report.describe()
    """
    report = AuditReport()
    originals = [(owner, name, getattr(owner, name)) for owner, name in _HOOKED]
    on_device = torch.device(device).type != "cpu"
    mode = _Dispatch(report, on_device)

    def hooked(original: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            host = args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
            # The mode is on the stack of the audited thread and of the autograd threads that
            # run its backward (they inherit it), not on another thread's.
            audited = any(m is mode for m in _get_current_dispatch_mode_stack())
            if audited and not (on_device and host):
                report.syncs.append((name, _site()))
            return original(*args, **kwargs)

        return call

    with _LOCK:
        for owner, name, original in originals:
            setattr(owner, name, hooked(original, name))
        try:
            with mode:
                yield report
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)


def audit_training(config: Any, warmup: int = 3, steps: int = 1) -> AuditReport:
    """Audit ``steps`` steady-state steps of ``config``'s run (a :class:`recsys.config.Config`)
    after ``warmup`` steps; the counts per step. The steps include what the loop does around
    the model (the schedule, the loss window, the checks after a step), not the loader's work
    in its background thread. Pick a config whose audited steps log, evaluate and save nothing
    (their syncs are allowed)."""
    from recsys.distributed.parallel import resolve_device
    from recsys.train.trainer import train_steps

    run = train_steps(config)
    try:
        for _ in range(warmup):
            next(run)
        with StepAudit(resolve_device(config.run.device, 0)) as report:
            for _ in range(steps):
                next(run)
    finally:
        run.close()
    return report.scaled(steps)
