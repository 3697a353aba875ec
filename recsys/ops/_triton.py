"""Backend selection for every recsys op, in one place.

Each public op takes ``backend: "auto" | "triton" | "torch"``. ``"auto"`` (overridable with the
environment variable ``RECSYS_BACKEND``) picks:

- CUDA tensors: the op's Triton kernels when it has them, else its torch path;
- CPU tensors: the op's measured-faster CPU path where it can serve the call, else the torch
  path. The embedding bag has one: ``"fbgemm"``, FBGEMM's C++ fused-optimizer backward
  (fbgemm-gpu-cpu) behind the torch forward, for SGD / Adagrad / RowWiseAdagrad on fp32 tables
  of one dim and one pooling (``recsys.ops.embedding_bag.fbgemm_unsupported`` says why not
  otherwise). ``scripts/bench_embedding_bag.py`` measured its fused backward several times
  faster than the torch path's sort + ``F.embedding_bag`` reduction + ``index_copy_`` update.

Triton kernels also run on CPU under the interpreter (``TRITON_INTERPRET=1``), which is how the
tests check them without a GPU; ``backend="triton"`` on CPU tensors is allowed only then.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "torch")

HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(
    backend: str,
    device: torch.device,
    *,
    op: str,
    has_triton: bool,
    cpu_paths: dict[str, str] | None = None,
) -> str:
    """Turn a requested backend into the one that runs: ``"triton"``, ``"torch"`` or one of
    the op's ``cpu_paths``.

    Args:
        backend: ``"auto"``, ``"triton"``, ``"torch"`` or a name in ``cpu_paths``.
        device: device of the op's inputs.
        op: op name, for error messages.
        has_triton: whether the op has Triton kernels.
        cpu_paths: the op's faster CPU paths, each mapped to why it cannot serve this call
            ("" when it can); "auto" on CPU takes the first that can.

    Raises:
        ValueError: unknown backend, or one that cannot run here.
    """
    cpu_paths = cpu_paths or {}
    names = (*BACKENDS, *cpu_paths)
    if backend == "auto":
        backend = os.environ.get("RECSYS_BACKEND", "auto")
        if backend not in names:
            raise ValueError(f"RECSYS_BACKEND={backend!r}; expected one of {', '.join(names)}")
    if backend not in names:
        raise ValueError(f"backend={backend!r} for {op}; expected one of {', '.join(names)}")
    if backend in cpu_paths:
        if cpu_paths[backend]:
            raise ValueError(f"backend={backend!r} cannot run this {op}: {cpu_paths[backend]}")
        return backend
    if backend == "auto":
        if has_triton and HAS_TRITON and device.type == "cuda":
            return "triton"
        usable = [name for name, why in cpu_paths.items() if not why]
        return usable[0] if device.type == "cpu" and usable else "torch"
    if backend == "triton":
        if not has_triton:
            raise ValueError(f"{op} has no Triton kernels yet; use backend='torch' or 'auto'")
        if not HAS_TRITON:
            raise ValueError(f"backend='triton' for {op}, but triton is not installed")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"backend='triton' for {op} on {device.type} tensors needs a CUDA device "
                "or TRITON_INTERPRET=1"
            )
    return backend
