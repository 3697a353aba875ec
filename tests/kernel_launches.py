"""Every Triton kernel launch of recsys, recorded under the interpreter and compiled for real
GPUs without one.

Two halves, in two processes (the interpreter patches ``triton.language`` in the process it
runs in, so the real compiler cannot run there):

- **record**: this module is a pytest plugin. With ``RECSYS_RECORD_LAUNCHES=<file.json>`` in
  the environment of a ``TRITON_INTERPRET=1`` pytest run (``-p tests.kernel_launches``), every
  launch of a kernel defined in ``recsys`` is recorded as a *variant*: module, kernel, the
  signature Triton would specialize on (pointer dtypes, integer widths, and as a GPU launch
  does, integers equal to 1 as constexprs and the 16-divisible integers and pointers), and the
  constexpr values and launch options the launcher chose. The variants are written to the file
  at the end.
  ``tests.kernel_variants`` turns them into what a GPU launch compiles (autotune configs, TF32).
- **compile**: :func:`compile_variant` compiles a variant with ``triton.compile`` for a
  ``GPUTarget`` (sm_80, sm_90) into a cubin; :func:`measure_variant` adds its registers, stack,
  shared and local memory (the ``cuobjdump`` the triton wheel ships), the spill stores ptxas
  reports and the compile time. :func:`compile_in_subprocess` runs that in fresh processes
  (``python -m tests.kernel_launches``) and :func:`compile_failures` words what failed.

Constexprs that only exist for the interpreter (``DOT_IN_FP32``: its numpy ``tl.dot`` lacks
bf16) are compiled with their GPU value.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RECORD_ENV = "RECSYS_RECORD_LAUNCHES"
TARGETS = (80, 90)
# constexpr -> its value on a GPU, for the ones the launchers set only under the interpreter
GPU_VALUES = {"DOT_IN_FP32": False}
# Shared memory one block may use (opt-in maximum): A100 (sm_80) and H100 (sm_90). A config
# asking for more compiles, but a GPU refuses to launch it (the autotuner skips it).
MAX_SHARED_BYTES = {80: 166912, 90: 232448}
_ROOT = Path(__file__).resolve().parents[1]
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


def _divisible_by_16(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def variant_of(
    fn: Any, args: tuple, kwargs: dict[str, Any], do_not_specialize: tuple = ()
) -> dict[str, Any]:
    """The variant a launch of kernel ``fn`` (its Python function) with ``args`` / ``kwargs``
    compiles to, specialized as a GPU launch specializes it (``BaseBackend`` in
    ``triton.backends.compiler``): an integer argument equal to 1 becomes a constexpr, and the
    integers and pointers divisible by 16 are listed in ``aligned`` (the compiler assumes that
    divisibility, which lets it vectorize). ``do_not_specialize``: the kernel's
    ``triton.jit(do_not_specialize=...)`` names."""
    parameters = inspect.signature(fn).parameters
    bound = dict(zip(parameters, args, strict=False)) | kwargs
    signature, constexprs, aligned = {}, {}, []
    for name, parameter in parameters.items():
        value = bound.get(name, parameter.default)
        specialize = name not in do_not_specialize
        if "constexpr" in str(parameter.annotation) or value is None:
            signature[name] = "constexpr"
            constexprs[name] = _plain(value)
        elif specialize and type(value) is int and value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = _argument_type(value)
            if (specialize or isinstance(value, torch.Tensor)) and _divisible_by_16(value):
                aligned.append(name)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return {
        "module": fn.__module__,
        "kernel": fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "aligned": aligned,
        "options": options,
    }


def record_into(store: dict[str, dict[str, Any]], prefix: str = "recsys.") -> Callable[[], None]:
    """Record every interpreted launch of a kernel whose module starts with ``prefix`` into
    ``store`` (keyed by the variant's JSON, so each variant once); returns the undo."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith(prefix):
            dns = tuple(self.kwargs.get("do_not_specialize") or ())
            variant = variant_of(self.fn, args, kwargs, dns)
            store.setdefault(json.dumps(variant, sort_keys=True, default=str), variant)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    return lambda: setattr(InterpretedFunction, "run", run)


def pytest_configure(config) -> None:
    if os.environ.get(RECORD_ENV):
        record_into(_recorded)


def pytest_sessionfinish(session, exitstatus) -> None:
    if path := os.environ.get(RECORD_ENV):
        Path(path).write_text(json.dumps(list(_recorded.values()), indent=1, default=str))


def record_launches(
    tests: list[str], out: Path, *pytest_args: str, jobs: int = 1
) -> list[dict[str, Any]]:
    """Run ``tests`` under the interpreter and return the variants launched, each once, in the
    order they were first launched. With ``jobs`` > 1 the tests run in that many processes at
    once, each on a contiguous slice of ``tests``, and their records are joined in the order of
    the slices: what one process running them in turn records, a test file's launches
    depending on nothing an earlier file ran."""
    num_jobs = max(1, min(jobs, len(tests)))
    bounds = [len(tests) * job // num_jobs for job in range(num_jobs + 1)]
    children = []
    try:
        for job in range(num_jobs):
            path = out.with_name(f"{out.stem}.recorded_{job}{out.suffix}")
            env = os.environ | {"TRITON_INTERPRET": "1", RECORD_ENV: str(path)}
            command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.kernel_launches"]
            command += [*tests[bounds[job] : bounds[job + 1]], *pytest_args]
            child = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            children.append((child, path))
        variants: dict[str, dict[str, Any]] = {}
        failures = []
        for child, path in children:
            output, _ = child.communicate()
            # 5: the slice has no test the arguments select (the caller checks the coverage)
            if child.returncode not in (0, 5) or not path.exists():
                failures.append(output[-3000:])
                continue
            for variant in json.loads(path.read_text()):
                variants.setdefault(json.dumps(variant, sort_keys=True, default=str), variant)
    finally:
        for child, _ in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    if failures:
        raise RuntimeError("recording kernel launches failed:\n" + "\n".join(failures))
    out.write_text(json.dumps(list(variants.values()), indent=1, default=str))
    return list(variants.values())


def variant_label(variant: dict[str, Any]) -> str:
    """The constexprs, launch options and 16-divisible arguments (``"aligned"``) of
    ``variant`` as one line of JSON (sorted keys)."""
    fields = variant["constexprs"] | variant["options"]
    if variant.get("aligned"):
        fields["aligned"] = " ".join(variant["aligned"])
    return json.dumps(fields, sort_keys=True, default=str)


def compile_variant(variant: dict[str, Any], capability: int) -> Any:
    """``variant`` compiled by ``triton.compile`` for ``sm_<capability>``: the compiled kernel
    (``.asm["cubin"]``, ``.metadata.shared``). Raises the compiler's error. Run in a process
    without ``TRITON_INTERPRET``."""
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
    names = list(variant["signature"])
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in variant.get("aligned", ())}
    source = ASTSource(kernel, variant["signature"], constexprs, attrs)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target, options=variant["options"])


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack / static shared / local memory bytes of a one-kernel
    cubin (``cuobjdump -res-usage``); local memory (and stack) above 0 means spilled registers."""
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


def measure_variant(variant: dict[str, Any], capability: int) -> dict[str, Any]:
    """Compile ``variant`` for ``sm_<capability>`` and measure it: :func:`resource_usage` with
    ``shared_bytes`` the static plus the dynamic shared memory a launch asks for, the spill
    stores / loads of ptxas's report, and ``compile_s`` (the seconds a GPU's first launch
    spends compiling it). Needs ``TRITON_DUMP_PTXAS_LOG=1`` and an empty Triton cache for the
    spill report (else those are -1)."""
    report = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(report):  # triton prints the ptxas -v log
        compiled = compile_variant(variant, capability)
    seconds = time.perf_counter() - start
    usage = resource_usage(compiled.asm["cubin"])
    usage["shared_bytes"] += compiled.metadata.shared
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report.getvalue())
    usage["spill_store_bytes"] = int(spills[1]) if spills else -1
    usage["spill_load_bytes"] = int(spills[2]) if spills else -1
    usage["compile_s"] = round(seconds, 2)
    return usage


def compile_report(variants: list[dict[str, Any]], targets: tuple[int, ...]) -> list[dict]:
    """Measure every variant for every target: one dict per pair, ``index`` (into
    ``variants``), ``target`` and either ``usage`` (:func:`measure_variant`) or ``error`` (the
    compiler's message). Run in a process without ``TRITON_INTERPRET``."""
    rows = []
    for index, variant in enumerate(variants):
        for capability in targets:
            row: dict[str, Any] = {"index": index, "target": capability}
            try:
                row["usage"] = measure_variant(variant, capability)
            except Exception as error:  # the compiler's message is the result
                row["error"] = f"{type(error).__name__}: {error}"
            rows.append(row)
    return rows


def compile_in_subprocess(
    variants: list[dict[str, Any]], targets: tuple[int, ...], workdir: Path, jobs: int = 1
) -> list[dict]:
    """:func:`compile_report` in ``jobs`` fresh processes without the interpreter (each with
    an empty Triton cache under ``workdir``, so every variant is really compiled); rows in the
    order of ``variants``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DUMP_PTXAS_LOG"] = "1"
    num_jobs = max(1, min(jobs, len(variants)))
    children = []
    for job in range(num_jobs):
        shard = workdir / f"variants_{job}.json"
        shard.write_text(json.dumps(variants[job::num_jobs], default=str))
        command = [sys.executable, "-m", "tests.kernel_launches", str(shard), json.dumps(targets)]
        job_env = env | {"TRITON_CACHE_DIR": str(workdir / f"triton_cache_{job}")}
        children.append(
            subprocess.Popen(
                command,
                cwd=_ROOT,
                env=job_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    rows = []
    for job, child in enumerate(children):
        out, err = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"compiling kernel variants failed:\n{err[-3000:]}")
        for row in json.loads(out.strip().splitlines()[-1]):
            rows.append(row | {"index": row["index"] * num_jobs + job})
    return sorted(rows, key=lambda row: (row["index"], row["target"]))


def compile_failures(variants: list[dict[str, Any]], rows: list[dict]) -> list[str]:
    """One message per row of :func:`compile_report` that failed: the kernel, the target, the
    variant and the compiler's message (its first line and its last five)."""
    failures = []
    for row in rows:
        if "error" not in row:
            continue
        variant = variants[row["index"]]
        lines = [line.strip() for line in row["error"].strip().splitlines() if line.strip()]
        shown = lines if len(lines) <= 6 else [lines[0], "...", *lines[-5:]]
        failures.append(
            f"{variant['module']}.{variant['kernel']} sm_{row['target']} "
            f"{variant_label(variant)}: " + " | ".join(shown)
        )
    return failures


def launched_kernels() -> set[tuple[str, str]]:
    """(module, name) of every kernel ``recsys/ops`` launches (``name[grid](...)`` in its
    source): what the recording must cover."""
    found = set()
    for path in (_ROOT / "recsys" / "ops").rglob("*.py"):
        module = ".".join(path.relative_to(_ROOT).with_suffix("").parts)
        for name in set(re.findall(r"\b(_\w+_kernel)\[", path.read_text())):
            found.add((module, name))
    return found


if __name__ == "__main__":  # python -m tests.kernel_launches VARIANTS.json '[80, 90]'
    sys.path.insert(0, str(_ROOT))
    _variants = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(compile_report(_variants, tuple(json.loads(sys.argv[2])))))
