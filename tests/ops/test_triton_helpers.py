"""The rules every op shares, from ``recsys.ops._triton``: backend selection (with the fallback
of "auto" to torch), accumulation dtype, tl.dot precision, the interpreter's dot widening, the
autocast cast and the row split of deterministic partial sums."""

import pytest
import torch
import triton.language as tl

from recsys.ops._triton import (
    HAS_TRITON,
    accumulate_dtype,
    autocast_inputs,
    dot_in_fp32,
    dot_input_precision,
    resolve_backend,
    split_rows,
    triton_dtype,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only its type is read: no CUDA device needed


def resolve(backend, device=CPU, triton_unsupported=""):
    return resolve_backend(
        backend, device, op="op", has_triton=True, triton_unsupported=triton_unsupported
    )


@pytest.fixture
def no_env_backend(monkeypatch):
    monkeypatch.delenv("RECSYS_BACKEND", raising=False)


@pytest.mark.usefixtures("no_env_backend")
def test_auto_takes_triton_on_cuda_only_when_it_can_serve_the_call():
    assert resolve("auto", CUDA) == ("triton" if HAS_TRITON else "torch")
    assert resolve("auto", CUDA, triton_unsupported="dtype torch.float64") == "torch"
    assert resolve("auto", CPU) == "torch"


@pytest.mark.usefixtures("no_env_backend")
def test_auto_keeps_the_torch_path_of_an_op_whose_kernels_measured_slower(monkeypatch):
    def slower(backend, device=CUDA):
        return resolve_backend(backend, device, op="op", has_triton=True, auto_triton=False)

    assert slower("auto") == "torch"
    assert slower("auto", CPU) == "torch"
    monkeypatch.setenv("RECSYS_BACKEND", "triton")
    assert slower("auto") == "triton"


@pytest.mark.usefixtures("no_env_backend")
def test_explicit_backends_are_kept():
    assert resolve("torch", CUDA) == "torch"
    assert resolve("triton", CPU) == "triton"  # under the interpreter (tests/conftest.py)
    # The op raises its own error for a call its kernels cannot serve.
    assert resolve("triton", CPU, triton_unsupported="dtype torch.float64") == "triton"


def test_env_backend_overrides_auto_but_not_the_fallback(monkeypatch):
    monkeypatch.setenv("RECSYS_BACKEND", "triton")
    assert resolve("auto", CPU) == "triton"
    assert resolve("auto", CPU, triton_unsupported="129 vectors") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve("auto", CPU, triton_unsupported="129 vectors") == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device or TRITON_INTERPRET=1"):
        resolve("auto", CPU)
    monkeypatch.setenv("RECSYS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="RECSYS_BACKEND='cuda'; expected one of auto"):
        resolve("auto", CPU, triton_unsupported="129 vectors")


@pytest.mark.usefixtures("no_env_backend")
def test_bad_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='gpu' for op; expected one of auto, triton"):
        resolve("gpu")
    with pytest.raises(ValueError, match="op has no Triton kernels yet"):
        resolve_backend("triton", CPU, op="op", has_triton=False)


def test_accumulate_dtype():
    assert accumulate_dtype(torch.float64) == torch.float64
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert accumulate_dtype(dtype) == torch.float32


def test_triton_dtype():
    assert triton_dtype(torch.float64) == tl.float64
    assert triton_dtype(torch.float32) == tl.float32
    assert triton_dtype(torch.bfloat16) == tl.bfloat16
    assert triton_dtype(torch.float16) == tl.float16
    with pytest.raises(ValueError, match="dtype=torch.int64 has no Triton float dtype"):
        triton_dtype(torch.int64)


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_dot_input_precision_follows_torch_for_fp32_only(allow_tf32, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", allow_tf32)
    assert dot_input_precision(torch.float32) == ("tf32" if allow_tf32 else "ieee")
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert dot_input_precision(dtype) == "ieee"


def test_dot_in_fp32_widens_only_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dot_in_fp32(torch.bfloat16)
    assert not dot_in_fp32(torch.float16)
    assert dot_in_fp32(torch.float16, (torch.bfloat16, torch.float16))
    assert not dot_in_fp32(torch.float32, (torch.bfloat16, torch.float16))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dot_in_fp32(torch.bfloat16)
    assert not dot_in_fp32(torch.float16, (torch.bfloat16, torch.float16))


def test_autocast_inputs_leaves_cpu_tensors_alone():
    x, w = torch.randn(3, 4), torch.randn(4, 4, dtype=torch.float64)
    out = autocast_inputs(x, w, None)
    assert out[0] is x and out[1] is w and out[2] is None


@pytest.mark.gpu
def test_autocast_inputs_casts_cuda_tensors_under_autocast():
    x, w = torch.randn(3, 4, device="cuda"), torch.randn(4, 4, device="cuda")
    assert autocast_inputs(x, w)[0] is x
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cast_x, cast_w, bias = autocast_inputs(x, w, None)
    assert cast_x.dtype == cast_w.dtype == torch.bfloat16 and bias is None
    torch.testing.assert_close(cast_x, x.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("num_rows", [0, 1, 31, 32, 33, 1000, 100_003])
@pytest.mark.parametrize("num_col_blocks", [1, 3, 8])
def test_split_rows_covers_every_row_once_in_whole_blocks(num_rows, num_col_blocks):
    block_rows = 16
    num_programs, rows_per_program = split_rows(num_rows, block_rows, num_col_blocks, CPU)
    assert rows_per_program % block_rows == 0
    assert num_programs * rows_per_program >= num_rows
    # No program is left without rows (one program when there are none).
    assert (num_programs - 1) * rows_per_program < max(num_rows, 1)
    # On CPU (one "SM"): about 4 programs in all, across the column blocks.
    assert num_programs <= max(1, -(-4 // num_col_blocks))


def test_split_rows_values():
    assert split_rows(1000, 16, 1, CPU) == (4, 256)
    assert split_rows(0, 16, 1, CPU) == (1, 16)
    assert split_rows(1000, 16, 8, CPU) == (1, 1008)
