"""An exported CTR program compiled ahead of time with AOTInductor, for ``recsys serve
--compile aoti``: the program's graph as generated C++ (fused elementwise loops, the matmuls
through the same BLAS), called as one function.

Why: the exported program runs op by op from Python. Each op releases the GIL while it
computes and takes it back after, so in a server, where the event loop thread parses requests
while a worker thread scores the previous batch, every op boundary of the scoring thread waits
for the loop to let go of the GIL (a busy Python thread beside it made one 256-row call 200x
slower on the development CPU). The compiled program crosses from Python once per call, and
its fixed per-call cost is smaller: on the development CPU (one thread, the default recipe's
DLRM) 0.29 ms instead of 0.90 for 64 rows, 2.9 instead of 3.9 for 1,024, and about the same
for 8,192 rows, where the kernels dominate (``benchmarks/serving.py`` measures the server both
ways).

Scores match the exported program's to float rounding (generated code sums in another order),
not bitwise: ``recsys predict`` runs the exported program, so the bitwise guarantee between
``recsys serve`` and ``recsys predict`` holds without ``--compile``.

What compiles: a click model's export (``recsys export`` writes CPU programs) with its tables in
memory, fixed or dynamic, served as it is. Not: ``--deltas`` (the versions' tables are new
tensors, while the compiled program holds its own copy of the weights) or tiered tables (looked
up through caches in Python). :func:`compile_refusal` says why in one line, before anything
loads.

Compiling takes a C++ compiler and about 20 s for the default recipe on 2 cores; the package is
cached under ``$RECSYS_CACHE_DIR/aoti`` (default ``~/.cache/recsys/aoti``), keyed by the
export's bytes, the torch version and the CPU's instruction set, so a server restarted on the
same export loads it at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from recsys.serve.program_file import archive_has
from recsys.serve.tiered_export import TIERED_FILE

__all__ = ["COMPILE_CHOICES", "cache_directory", "compile_refusal", "compiled_program"]

COMPILE_CHOICES = ("off", "aoti")

logger = logging.getLogger("recsys.serve")


def cache_directory() -> Path:
    """Where compiled packages are kept: ``$RECSYS_CACHE_DIR/aoti``, else
    ``~/.cache/recsys/aoti``."""
    root = os.environ.get("RECSYS_CACHE_DIR") or Path.home() / ".cache" / "recsys"
    return Path(root) / "aoti"


def compile_refusal(path: Path | None, deltas: bool) -> str:
    """Why the export at ``path`` cannot be served compiled ("" when it can): ``--deltas`` or a
    tiered export (None: a checkpoint, exported when loaded; deltas only)."""
    if deltas:
        return (
            "--compile aoti serves the program as exported: --deltas puts new rows into its "
            "tables, which the compiled program holds as its own copy (serve without --compile "
            "to follow deltas)"
        )
    if path is not None and archive_has(path, f"extra/{TIERED_FILE}"):
        return (
            f"'{path}' keeps its tables in the host or disk tier, looked up through caches in "
            "Python: --compile aoti compiles programs whose tables are in memory"
        )
    return ""


def compiled_program(path: Path, cache: Path | None = None):
    """The export at ``path`` compiled with AOTInductor (from the cache when it is there):
    a callable ``(dense, values, lengths) -> probabilities`` like the exported program's
    module.

    Raises:
        ValueError: what :func:`compile_refusal` says (deltas aside), or a failed compile
            (no C++ compiler, or an op AOTInductor does not take), naming the cause.
    """
    path = Path(path)
    refusal = compile_refusal(path, deltas=False)
    if refusal:
        raise ValueError(refusal)
    cache = cache_directory() if cache is None else Path(cache)
    package = cache / f"{_key(path)}.pt2"
    with warnings.catch_warnings():
        # torch's own pytree deprecation, raised while it (un)pickles the program's specs
        warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
        if not package.is_file():
            _compile(path, package)
        return torch._inductor.aoti_load_package(str(package))


def _key(path: Path) -> str:
    """The export's bytes, the torch version and the CPU's instruction set (the generated
    code is compiled for it)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    digest.update(torch.__version__.encode())
    digest.update(torch.backends.cpu.get_cpu_capability().encode())
    return digest.hexdigest()[:32]


def _compile(path: Path, package: Path) -> None:
    """Compile ``path`` into ``package`` (written whole or not at all)."""
    logger.info("compiling '%s' with AOTInductor (once per export; cached in %s)", path,
                package.parent)  # fmt: skip
    started = time.perf_counter()
    package.parent.mkdir(parents=True, exist_ok=True)
    program = torch.export.load(path)
    with tempfile.TemporaryDirectory(dir=package.parent, prefix=".compiling-") as work:
        partial = Path(work) / package.name
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
        except Exception as error:  # the compiler's own message, on one line
            cause = " ".join(str(error).split())[:300]
            raise ValueError(
                f"--compile aoti could not compile '{path}' ({type(error).__name__}: {cause}); "
                "serve it without --compile"
            ) from None
        os.replace(partial, package)
    logger.info("compiled '%s' in %.0f s", path, time.perf_counter() - started)
