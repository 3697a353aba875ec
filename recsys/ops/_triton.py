"""Backend selection for every recsys op, in one place.

Each public op takes ``backend: "auto" | "triton" | "torch"``. ``"auto"`` (overridable with the
environment variable ``RECSYS_BACKEND``) picks:

- CUDA tensors: the op's Triton kernels when it has them, else its torch path;
- CPU tensors: the torch path. For the embedding bag that is ``torch.nn.functional.
  embedding_bag`` per feature (ATen's vectorized CPU kernel); ``scripts/bench_embedding_bag.py``
  measures it against torchrec's EmbeddingBagCollection on the same inputs.

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


def resolve_backend(backend: str, device: torch.device, *, op: str, has_triton: bool) -> str:
    """Turn a requested backend into the one that runs: ``"triton"`` or ``"torch"``.

    Args:
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        device: device of the op's inputs.
        op: op name, for error messages.
        has_triton: whether the op has Triton kernels.

    Raises:
        ValueError: unknown backend, or ``"triton"`` where it cannot run.
    """
    if backend == "auto":
        backend = os.environ.get("RECSYS_BACKEND", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"RECSYS_BACKEND={backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} for {op}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if has_triton and HAS_TRITON and device.type == "cuda" else "torch"
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
