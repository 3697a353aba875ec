"""Every Triton kernel launch of recsys, recorded under the interpreter and compiled for real
GPUs without one.

Two halves, in two processes (the interpreter patches ``triton.language`` in the process it
runs in, so the real compiler cannot run there):

- **record**: this module is a pytest plugin. With ``RECSYS_RECORD_LAUNCHES=<file.json>`` in
  the environment of a ``TRITON_INTERPRET=1`` pytest run (``-p tests.kernel_launches``), every
  launch of a kernel defined in ``recsys`` is recorded as a *variant*: module, kernel, the
  signature Triton would specialize on (pointer dtypes, integer widths) and the constexpr values
  and launch options the launcher chose. The variants are written to the file at the end.
- **compile**: :func:`compile_variant` compiles a variant with ``triton.compile`` for a
  ``GPUTarget`` (sm_80, sm_90) into a cubin, and :func:`resource_usage` reads its registers,
  stack, shared and local memory with the ``cuobjdump`` the triton wheel ships.

Constexprs that only exist for the interpreter (``DOT_IN_FP32``: its numpy ``tl.dot`` lacks
bf16) are compiled with their GPU value.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

RECORD_ENV = "RECSYS_RECORD_LAUNCHES"
TARGETS = (80, 90)
# constexpr -> its value on a GPU, for the ones the launchers set only under the interpreter
GPU_VALUES = {"DOT_IN_FP32": False}
_POINTERS = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}
_TL_DTYPES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}
_recorded: dict[str, dict[str, Any]] = {}


def _argument_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTERS[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(value).__name__}")


def _plain(value: Any) -> Any:
    import triton.language as tl

    return {"tl_dtype": value.name} if isinstance(value, tl.dtype) else value


def variant_of(fn: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The variant a launch of kernel ``fn`` (its Python function) with ``args`` / ``kwargs``
    compiles to."""
    parameters = inspect.signature(fn).parameters
    bound = dict(zip(parameters, args, strict=False)) | kwargs
    signature, constexprs = {}, {}
    for name, parameter in parameters.items():
        value = bound.get(name, parameter.default)
        if "constexpr" in str(parameter.annotation) or value is None:
            signature[name] = "constexpr"
            constexprs[name] = _plain(value)
        else:
            signature[name] = _argument_type(value)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return {
        "module": fn.__module__,
        "kernel": fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "options": options,
    }


def pytest_configure(config) -> None:
    if not os.environ.get(RECORD_ENV):
        return
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("recsys."):
            variant = variant_of(self.fn, args, kwargs)
            _recorded.setdefault(json.dumps(variant, sort_keys=True, default=str), variant)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def pytest_sessionfinish(session, exitstatus) -> None:
    if path := os.environ.get(RECORD_ENV):
        Path(path).write_text(json.dumps(list(_recorded.values()), indent=1, default=str))


def record_launches(tests: list[str], out: Path, *pytest_args: str) -> list[dict[str, Any]]:
    """Run ``tests`` under the interpreter in a subprocess and return the variants launched."""
    env = os.environ | {"TRITON_INTERPRET": "1", RECORD_ENV: str(out)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.kernel_launches", *tests]
    done = subprocess.run(
        [*command, *pytest_args], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"recording kernel launches failed:\n{done.stdout[-3000:]}")
    return json.loads(out.read_text())


def compile_variant(variant: dict[str, Any], capability: int) -> bytes:
    """The cubin of ``variant`` for ``sm_<capability>`` (raises the compiler's error). Run in a
    process without ``TRITON_INTERPRET``."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(variant["module"]), variant["kernel"])
    constexprs = {
        name: getattr(tl, _TL_DTYPES[value["tl_dtype"]]) if isinstance(value, dict) else value
        for name, value in variant["constexprs"].items()
    }
    constexprs.update({k: v for k, v in GPU_VALUES.items() if k in constexprs})
    source = ASTSource(kernel, variant["signature"], constexprs)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target, options=variant["options"]).asm["cubin"]


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack / shared / local memory bytes of a one-kernel cubin
    (``cuobjdump -res-usage``); local memory (and stack) above 0 means spilled registers."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [str(tool), "-res-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text.split("Function", 1)[-1]))
    return {
        "registers": int(found["REG"]),
        "stack_bytes": int(found["STACK"]),
        "shared_bytes": int(found["SHARED"]),
        "local_bytes": int(found["LOCAL"]),
    }


def launched_kernels() -> set[tuple[str, str]]:
    """(module, name) of every kernel ``recsys/ops`` launches (``name[grid](...)`` in its
    source): what the recording must cover."""
    root = Path(__file__).resolve().parents[1] / "recsys" / "ops"
    found = set()
    for path in root.glob("*.py"):
        for name in set(re.findall(r"\b(_\w+_kernel)\[", path.read_text())):
            found.add((f"recsys.ops.{path.stem}", name))
    return found
