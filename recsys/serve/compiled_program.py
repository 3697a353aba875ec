"""An exported CTR program compiled ahead of time with AOTInductor, for ``recsys serve
--compile aoti``: the program's graph as generated C++ (fused elementwise loops, the matmuls
through the same BLAS), called as one function.

Why: the exported program runs op by op from Python. Each op releases the GIL while it
computes and takes it back after, so in a server, where the event loop thread parses requests
while a worker thread scores the previous batch, every op boundary of the scoring thread waits
for the loop to let go of the GIL. The compiled program crosses from Python once per call, with
a smaller fixed cost per call (``benchmarks/serving.py`` measures the server both ways, and
both programs' own rates).

Scores match the exported program's to float rounding (generated code sums in another order),
not bitwise: ``recsys predict`` runs the exported program, so the bitwise guarantee between
``recsys serve`` and ``recsys predict`` holds without ``--compile``.

What compiles: a click model's export (``recsys export`` writes CPU programs) with its tables in
memory, fixed or dynamic, served as it is. Not: ``--deltas`` (the versions' tables are new
tensors, while the compiled program holds its own copy of the weights) or tiered tables (looked
up through caches in Python). :func:`compile_refusal` says why in one line.

Compiling takes a C++ compiler and tens of seconds (the log gives the time). The package is
cached under ``$RECSYS_CACHE_DIR/aoti`` (default ``~/.cache/recsys/aoti``), keyed by the
program (the archive's members, less what ``torch.export.save`` draws at random each time, so
a checkpoint exported again hits the same package), the torch version and the CPU (model and
instruction-set flags: the code is compiled for the machine it runs on), so a server restarted
on the same export loads it at once. The :data:`CACHE_PACKAGES` most recently used packages
are kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import tempfile
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from recsys.serve.aoti_library import AotiLibrary
from recsys.serve.program_file import archive_has
from recsys.serve.tiered_export import TIERED_FILE

__all__ = [
    "CACHE_PACKAGES",
    "COMPILE_CHOICES",
    "cache_directory",
    "compile_refusal",
    "compiled_program",
]

COMPILE_CHOICES = ("off", "aoti")
CACHE_PACKAGES = 8
"""Compiled packages kept in the cache (the most recently used); older ones are removed."""

logger = logging.getLogger("recsys.serve")
# torch's own pytree deprecation, raised while it (un)pickles a program's input specs
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
)


def cache_directory() -> Path:
    """Where compiled packages are kept: ``$RECSYS_CACHE_DIR/aoti``, else
    ``~/.cache/recsys/aoti``."""
    root = os.environ.get("RECSYS_CACHE_DIR") or Path.home() / ".cache" / "recsys"
    return Path(root) / "aoti"


def compile_refusal(path: Path | None, deltas: bool, shown: str | Path | None = None) -> str:
    """Why the export at ``path`` cannot be served compiled ("" when it can): ``--deltas`` or a
    tiered export (``path`` None: deltas only). ``shown``: the name the message gives the model
    (default ``path``)."""
    if deltas:
        return (
            "--compile aoti serves the program as exported: --deltas puts new rows into its "
            "tables, which the compiled program holds as its own copy (serve without --compile "
            "to follow deltas)"
        )
    if path is not None and archive_has(path, f"extra/{TIERED_FILE}"):
        return (
            f"'{shown or path}' keeps its tables in the host or disk tier, looked up through "
            "caches in Python, which --compile aoti cannot compile: serve it without --compile"
        )
    return ""


def compiled_program(path: Path, cache: Path | None = None, shown: str | Path | None = None):
    """The export at ``path`` compiled with AOTInductor (from the cache when it is there): a
    callable ``(dense, values, lengths) -> probabilities`` like the exported program's module.
    ``shown``: the name log lines and errors give the model (default ``path``).

    Raises:
        ValueError: what :func:`compile_refusal` says (deltas aside), or a compile or load that
            failed (no C++ compiler, an op AOTInductor does not take), naming the cause.
    """
    path, shown = Path(path), shown or path
    refusal = compile_refusal(path, deltas=False, shown=shown)
    if refusal:
        raise ValueError(refusal)
    cache = cache_directory() if cache is None else Path(cache)
    package = cache / f"{_key(path)}.pt2"
    if package.is_file():
        try:
            program = _load(package)
        except Exception:  # a package left broken: compiled again below
            logger.warning("the cached package %s did not load; compiling again", package)
            package.unlink(missing_ok=True)
        else:
            os.utime(package)  # most recently used
            logger.info("scoring with '%s' compiled by AOTInductor (cached: %s)", shown, package)
            return program
    _compile(path, package, shown)
    _evict(cache, keep=package)
    try:
        program = _load(package)
    except Exception as error:
        raise ValueError(
            f"--compile aoti compiled '{shown}' but could not load it ({_one_line(error)}); "
            "serve it without --compile"
        ) from None
    logger.info("scoring with '%s' compiled by AOTInductor (%s)", shown, package)
    return program


def _load(package: Path) -> Any:
    """The package's model: through its C interface with the GIL released while it runs
    (:class:`~recsys.serve.aoti_library.AotiLibrary`), or torch's loader for a package laid
    out otherwise."""
    library = AotiLibrary.load(package)
    if library is not None:
        return library
    logger.info("%s: torch's loader (it holds the GIL while the program runs)", package.name)
    return torch._inductor.aoti_load_package(str(package))


def _key(path: Path) -> str:
    """The program (its archive's members by name, size and CRC, less the serialization id
    and sample inputs ``torch.export.save`` draws anew each time), the torch version and the
    CPU the code is compiled for."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(path) as archive:
        for info in sorted(archive.infolist(), key=lambda i: i.filename):
            name = info.filename
            if name.endswith("/serialization_id") or "/sample_inputs/" in name:
                continue
            digest.update(f"{name}\0{info.file_size}\0{info.CRC}\n".encode())
    digest.update(torch.__version__.encode())
    digest.update(_machine().encode())
    return digest.hexdigest()[:32]


def _machine() -> str:
    """The CPU the generated code is compiled for (``-march=native``): its model and flags
    where Linux says them, else what Python knows, and torch's instruction-set level."""
    identity = [platform.machine(), platform.processor()]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "flags", "Features", "CPU part"):
                identity.append(line)
            if not line.strip() and len(identity) > 2:
                break  # the first processor's lines are enough
    identity.append(torch.backends.cpu.get_cpu_capability())
    return "\n".join(identity)


def _compile(path: Path, package: Path, shown: str | Path) -> None:
    """Compile ``path`` into ``package`` (written whole or not at all)."""
    logger.info(
        "compiling '%s' with AOTInductor (once per program; cached in %s)", shown, package.parent
    )
    started = time.perf_counter()
    package.parent.mkdir(parents=True, exist_ok=True)
    program = torch.export.load(path)
    with tempfile.TemporaryDirectory(dir=package.parent, prefix=".compiling-") as work:
        partial = Path(work) / package.name
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
        except Exception as error:
            logger.debug("AOTInductor's error in full", exc_info=True)
            raise ValueError(
                f"--compile aoti could not compile '{shown}' ({_one_line(error)}); serve it "
                "without --compile"
            ) from None
        os.replace(partial, package)
    logger.info("compiled '%s' in %.0f s", shown, time.perf_counter() - started)


def _evict(cache: Path, keep: Path) -> None:
    """Remove all but the :data:`CACHE_PACKAGES` most recently used packages (never ``keep``)."""
    packages = sorted(cache.glob("*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in packages[CACHE_PACKAGES:]:
        if old != keep:
            old.unlink(missing_ok=True)


def _one_line(error: Exception) -> str:
    """An error's type and its last non-empty line (a compiler's message ends with the
    cause; its command line comes first)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:300] if lines else ''}"
