"""Backend selection for every recsys op, in one place.

Each public op takes ``backend: "auto" | "triton" | "torch"``. ``"auto"`` (overridable with the
environment variable ``RECSYS_BACKEND``) picks:

- CUDA tensors: the op's Triton kernels when it has them, else its torch path; except the
  DCN cross layers (full-rank, low-rank and vector), whose Triton kernels measured slower than
  torch eager (a cuBLAS matmul and elementwise kernels) on an H100 in every case of
  ``benchmarks/interaction.py`` (fp32 and bf16, forward and forward + backward;
  ``benchmarks/results/interaction.csv``): "auto" takes their torch path on CUDA too, and
  ``backend="triton"`` (or ``RECSYS_BACKEND=triton``) still runs the kernels;
- CPU tensors: the op's measured-faster CPU path where it can serve the call, else the torch
  path. The embedding bag has one: ``"fbgemm"``, FBGEMM's C++ fused-optimizer backward
  (fbgemm-gpu-cpu) behind the torch forward, for SGD / Adagrad / RowWiseAdagrad on fp32 tables
  of one dim and one pooling (``recsys.ops.embedding_bag.pooled.fbgemm_unsupported`` says why not
  otherwise). ``benchmarks/embedding_bag.py`` measured its fused backward several times
  faster than the torch path's sort + ``F.embedding_bag`` reduction + ``index_copy_`` update.

Under ``torch.compile`` (``train.compile``) "auto" is always the torch path: inductor fuses it
and writes its own kernels, where the hand-written kernels would be opaque calls (or, launched
from an autograd Function, a graph break).

"auto" also takes the torch path for a call the op's Triton kernels cannot serve (a dtype or a size
they do not take), whatever the device; ``backend="triton"`` for such a call is the op's error.

Triton kernels also run on CPU under the interpreter (``TRITON_INTERPRET=1``), which is how the
tests check them without a GPU; ``backend="triton"`` on CPU tensors is allowed only then.

The helpers below hold the rules every op's launchers share, so that each lives in one place:
the accumulation dtype (:func:`accumulate_dtype`, :func:`triton_dtype`), the TF32 choice of a
``tl.dot`` (:func:`dot_input_precision`), the interpreter's bf16 ``tl.dot`` workaround
(:func:`dot_in_fp32`), the CUDA autocast cast (:func:`autocast_inputs`) and the split of rows
into programs for deterministic partial sums (:func:`split_rows`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import triton.language as tl

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
    triton_unsupported: str = "",
    auto_triton: bool = True,
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
        triton_unsupported: why the op's Triton kernels cannot serve this call ("" when they
            can, e.g. ``"dtype torch.float64"``); "auto" then takes the torch path, even where
            ``RECSYS_BACKEND`` asks for Triton. An explicit ``"triton"`` still resolves to
            ``"triton"``: the op raises its own error for it.
        auto_triton: whether "auto" picks the op's Triton kernels on CUDA (False: they measured
            slower than its torch path there; ``"triton"`` and ``RECSYS_BACKEND=triton`` still
            pick them).

    Returns:
        The backend that runs.

    Raises:
        ValueError: unknown backend, or one that cannot run here.
    """
    cpu_paths = cpu_paths or {}
    names = (*BACKENDS, *cpu_paths)
    requested = backend
    if backend == "auto" and torch.compiler.is_compiling():
        return "torch"  # under torch.compile, inductor writes the kernels of the torch path
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
        if (
            auto_triton
            and has_triton
            and HAS_TRITON
            and device.type == "cuda"
            and not triton_unsupported
        ):
            return "triton"
        usable = [name for name, why in cpu_paths.items() if not why]
        return usable[0] if device.type == "cpu" and usable else "torch"
    if backend == "triton":
        if requested == "auto" and triton_unsupported:
            return "torch"
        _check_triton_runs(op, device, has_triton)
    return backend


def _check_triton_runs(op: str, device: torch.device, has_triton: bool) -> None:
    """Raise ValueError unless ``op``'s Triton kernels can run on ``device`` tensors here."""
    if not has_triton:
        raise ValueError(f"{op} has no Triton kernels yet; use backend='torch' or 'auto'")
    if not HAS_TRITON:
        raise ValueError(f"backend='triton' for {op}, but triton is not installed")
    if device.type != "cuda" and not triton_interpreted():
        raise ValueError(
            f"backend='triton' for {op} on {device.type} tensors needs a CUDA device "
            "or TRITON_INTERPRET=1"
        )


# --------------------------------------------------------------------------- dtypes


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels accumulate (and keep partial sums) in for inputs of ``dtype``: fp64
    for fp64, fp32 for everything else (fp32, bf16, fp16).

    Example::

        accumulate_dtype(torch.bfloat16)  # torch.float32
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype of a floating-point torch dtype, for a kernel's dtype constexpr.

    Example::

        triton_dtype(accumulate_dtype(x.dtype))  # tl.float32 or tl.float64, as ACC=
    """
    import triton.language as tl

    dtypes = {
        torch.float64: tl.float64,
        torch.float32: tl.float32,
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
    }
    if dtype not in dtypes:
        raise ValueError(f"dtype={dtype} has no Triton float dtype; expected one of {list(dtypes)}")
    return dtypes[dtype]


# --------------------------------------------------------------------------- tl.dot


def dot_input_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of a ``tl.dot`` whose inputs are ``dtype`` tensors: for fp32, torch's
    own fp32 matmul rule, ``"tf32"`` only when ``torch.backends.cuda.matmul.allow_tf32`` is on
    and exact fp32 (``"ieee"``) otherwise; ``"ieee"`` for any other dtype, whose ``tl.dot``
    ignores the option (Triton: it only says how to run f32 x f32 on tensor cores).
    """
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def dot_in_fp32(dtype: torch.dtype, widened: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> bool:
    """Whether a kernel widens its ``tl.dot`` operands to fp32 (its ``DOT_IN_FP32``
    constexpr): only under the CPU interpreter, whose ``tl.dot`` multiplies the raw bits of
    bf16 operands (triton 3.9), and only for a ``dtype`` in ``widened``. A product of two bf16
    or fp16 values is exact in fp32, so the widened dot computes what a GPU's fp32-accumulating
    dot does; compiled kernels never widen.

    Args:
        dtype: dtype of the tensors the kernel feeds to ``tl.dot``.
        widened: the dtypes to widen: bf16, which the interpreter gets wrong, and any other
            the op's interpreter runs have always widened (``dot_interaction`` widens fp16
            too: the interpreter's fp16 dot is right, but widening sums in another order).

    Returns:
        True when the kernel must cast its dot operands to fp32.
    """
    return dtype in widened and triton_interpreted()


# --------------------------------------------------------------------------- launchers


def autocast_inputs(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """A Triton path's inputs under CUDA autocast: every tensor cast to the autocast dtype when
    ``torch.autocast("cuda")`` is on and the first tensor is on a CUDA device, else unchanged
    (None stays None). The caller then runs its kernels with autocast disabled, so the op
    computes in the autocast dtype and gradients reach the original tensors through the cast.

    Example::

        x, weight, bias = autocast_inputs(x, weight, bias)
        with torch.autocast("cuda", enabled=False):
            return _Function.apply(x, weight, bias)
    """
    if not (tensors[0].is_cuda and torch.is_autocast_enabled("cuda")):
        return tensors
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dtype) if t is not None else None for t in tensors)


@functools.lru_cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for the CPU interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_rows(
    num_rows: int, block_rows: int, num_col_blocks: int, device: torch.device
) -> tuple[int, int]:
    """Cut ``num_rows`` rows into P programs of a whole number of ``block_rows``-row blocks,
    about 4 programs per SM with ``num_col_blocks`` column tiles each. A kernel that sums over
    rows writes one partial sum per program to row p of a [P, ...] buffer, and the launcher
    sums over P: no atomics, and P depends only on the sizes and the device, so two runs on
    one device are bitwise equal.

    Returns:
        (P, rows per program).
    """
    num_row_blocks = max(1, _cdiv(num_rows, block_rows))
    target = _cdiv(4 * num_sms(device), num_col_blocks)
    blocks_per_program = _cdiv(num_row_blocks, min(num_row_blocks, target))
    return _cdiv(num_row_blocks, blocks_per_program), blocks_per_program * block_rows


def _cdiv(numerator: int, denominator: int) -> int:
    """``triton.cdiv`` (ceil of the quotient), without importing triton."""
    return (numerator + denominator - 1) // denominator
