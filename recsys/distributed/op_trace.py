"""What the dense part of a training step executes, op by op, for the step cost model: each op's
flops and the bytes it reads and writes, traced on the ``meta`` device (shapes only, nothing
computed or allocated), so a model of any size is traced in well under a second.

:func:`trace_ops` runs a callable (a model's forward, loss, backward and dense optimizer step)
under a ``TorchDispatchMode`` and records every op that is not a view or a metadata read: its
flops from torch's flop formulas (``torch.utils.flop_counter``: matrix products, convolutions,
attention; 0 for the rest) and the bytes of its tensor arguments and results. The modules
given as ``skip`` (the embedding collections, whose lookups, updates and exchanges the cost
model charges from the plan) are left out: their ops are not recorded, and their outputs are
handed on as fresh leaves, so the backward does not enter them either.

:func:`~recsys.distributed.step_cost.predict_step` charges each op the larger of the cluster's
per-op floor (``Topology.op_us``: a kernel's launch on a GPU, an op's dispatch on a CPU) and its
roofline time (flops over the dense rate plus bytes over the memory bandwidth).

Example::

    trace = trace_ops(lambda: step(model, batch), skip=[model.sparse_arch])
    trace.ops, trace.flops.sum(), trace.bytes.sum()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

__all__ = ["OpTrace", "trace_ops"]

_aten = torch.ops.aten
# aten ops that move no data: allocations, reshapes without a copy and metadata reads (views are
# left out by their schema, ops of other namespaces, such as the profiler's, by theirs).
_FREE = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
        _aten._unsafe_view.default,
        _aten.promote_types.default,
        _aten.result_type.Tensor,
        _aten.result_type.Scalar,
        _aten.detach.default,
        _aten.lift_fresh.default,
        _aten._local_scalar_dense.default,
        _aten.sym_size.int,
        _aten.sym_stride.int,
        _aten.sym_numel.default,
        _aten.is_same_size.default,
    }
)


@dataclass(frozen=True, eq=False)
class OpTrace:
    """The ops a traced step executed, in order.

    Attributes:
        flops: [N] each op's floating-point operations.
        bytes: [N] the bytes each op reads and writes: its tensor arguments, and its results
            or, for an in-place op that returns none, the arguments it writes.
        batch_size: the samples of the traced step (0: not a training step).
    """

    flops: np.ndarray
    bytes: np.ndarray
    batch_size: int = 0

    @property
    def ops(self) -> int:
        return len(self.flops)

    def seconds(self, floor_s: float, flops_per_s: float, bytes_per_s: float) -> float:
        """The ops one after another, each the larger of ``floor_s`` and its roofline time."""
        roofline = self.flops / flops_per_s + self.bytes / bytes_per_s
        return float(np.maximum(roofline, floor_s).sum())


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops: list[float] = []
        self.bytes: list[float] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or func.namespace != "aten" or func.is_view or func in _FREE:
            return out
        written = _tensors(out) or _tensors(_written_arguments(func, args, kwargs))
        formula = flop_registry.get(func._overloadpacket)
        self.flops.append(float(formula(*args, **kwargs, out_val=out)) if formula else 0.0)
        self.bytes.append(float(sum(_size(t) for t in _tensors((args, kwargs)) + written)))
        return out


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _size(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _written_arguments(func, args: tuple, kwargs: dict) -> list:
    """The arguments ``func``'s schema says it writes (an in-place foreach op's lists)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        written.append(args[index] if index < len(args) else kwargs.get(argument.name))
    return written


def _fresh(value):
    """``value`` (a tensor, a KeyedTensor, or a structure of them) as new leaves that need a
    gradient where a float tensor would, cut from whatever computed it."""

    def leaf(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().requires_grad_(t.is_floating_point())

    return tree_map(leaf, value)  # torchrec registers KeyedTensor with pytree


def trace_ops(
    run: Callable[[], object], skip: Iterable[nn.Module] = (), batch_size: int = 0
) -> OpTrace:
    """Run ``run()`` and record its ops, less those of the modules in ``skip`` (see the module
    docstring).

    Args:
        run: what to trace, on ``meta`` tensors to trace shapes only (any device works).
        skip: modules whose forward (and so backward) is left out.
        batch_size: the samples ``run`` steps, kept with the trace.
    """
    recorder = _Recorder()

    def pause(module, args):
        recorder.paused += 1

    def resume(module, args, output):
        recorder.paused -= 1
        return _fresh(output)

    handles = []
    for module in skip:
        handles.append(module.register_forward_pre_hook(pause))
        handles.append(module.register_forward_hook(resume))
    try:
        with recorder:
            run()
    finally:
        for handle in handles:
            handle.remove()
    return OpTrace(np.array(recorder.flops), np.array(recorder.bytes), batch_size)
