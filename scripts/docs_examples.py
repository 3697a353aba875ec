"""The docs' examples, executed: every ``bash`` and ``python`` block of README.md and docs/ is
either run by ``make docs-test`` or says why not, so an example cannot rot unseen.

The line right above a block's opening fence is its marker:

- ``<!-- example: run -->``: run as written;
- ``<!-- example: run with ARGS -->``: run with ARGS appended to each of its ``recsys train``
  commands (short settings: fewer steps, smaller splits); the docs site shows the note;
- ``<!-- example: not run: REASON -->``: not run, and why (needs a GPU, a download, a server
  left running, ...).

A block without a marker is an error (``python scripts/docs_examples.py --check``, and a test).
Runnable blocks run in order, pages in :data:`PAGES` order, all in one scratch directory that
links ``configs/``, ``examples/`` and ``.venv`` from the repository (``.venv/bin`` first on PATH),
so a page may use what an earlier one wrote (``data/raw/day_0.txt`` of the data guide). A bash
block runs under ``bash -euo pipefail`` (a background job it starts is stopped when it ends); a
python block is executed in one namespace per page, so a later block continues an earlier one.
The first failing block stops the run with its page, line and output.

    python scripts/docs_examples.py --check            # every block has a marker
    python scripts/docs_examples.py [--workdir DIR] [PAGE ...]   # run them (make docs-test)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = (  # the README, then the manual in the site's order
    "README.md",
    "docs/index.md",
    "docs/getting-started.md",
    "docs/features.md",
    "docs/guides/data.md",
    "docs/guides/models.md",
    "docs/guides/configuration.md",
    "docs/guides/runs.md",
    "docs/guides/dynamic-tables.md",
    "docs/guides/tiered-tables.md",
    "docs/guides/distributed.md",
    "docs/guides/checkpoints.md",
    "docs/guides/serving.md",
    "docs/guides/sequence-models.md",
    "docs/guides/performance.md",
    "docs/guides/gpus.md",
    "docs/guides/python.md",
    "docs/serving.md",
    "docs/reference/api.md",
    "docs/architecture.md",
    "docs/benchmarks/index.md",
    "docs/development.md",
)
LANGUAGES = ("bash", "python")
MARKER = re.compile(r"^<!-- example: (run with (?P<args>.+)|run|not run: (?P<reason>.+)) -->$")
LINKED = ("configs", "examples", ".venv")
BLOCK_TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    language: str
    source: str
    run: bool
    args: str  # appended to each `recsys train`
    reason: str  # why not run

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str, text: str | None = None) -> tuple[list[Block], list[str]]:
    """The bash and python blocks of ``page`` and the errors of their markers."""
    lines = (REPO / page).read_text().splitlines() if text is None else text.splitlines()
    found, errors = [], []
    index = 0
    while index < len(lines):
        fence = re.match(r"^```(\w*)", lines[index])
        if not fence:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].startswith("```")), None)
        if end is None:
            errors.append(f"{page}:{index + 1}: a code block is not closed")
            break
        language = fence.group(1)
        if language in LANGUAGES:
            above = lines[index - 1] if index else ""
            marker = MARKER.match(above)
            if marker is None:
                errors.append(
                    f"{page}:{index + 1}: a {language} block without a marker on the line above "
                    "(<!-- example: run -->, <!-- example: run with ARGS --> or "
                    "<!-- example: not run: REASON -->)"
                )
            else:
                found.append(
                    Block(
                        page,
                        index + 1,
                        language,
                        "\n".join(lines[index + 1 : end]) + "\n",
                        run=marker.group("reason") is None,
                        args=marker.group("args") or "",
                        reason=marker.group("reason") or "",
                    )
                )
        index = end + 1
    return found, errors


TRAIN = re.compile(r"(?:^|[\s/])(?:recsys|-m recsys) train\b")


def with_args(source: str, args: str) -> str:
    """``source`` with ``args`` appended to each command that runs ``recsys train`` (before its
    trailing comment or ``&``)."""
    if not args:
        return source
    logical = source.replace("\\\n", " ").splitlines()
    out = []
    for line in logical:
        if TRAIN.search(line):
            code, hash_, comment = line.partition(" #")
            code = code.rstrip()
            background = code.endswith("&") and not code.endswith("&&")
            code = code.removesuffix("&").rstrip() if background else code
            line = f"{code} {args}{' &' if background else ''}"
            if hash_:
                line += f"  #{comment}"
        out.append(line)
    return "\n".join(out) + "\n"


def _bash(block: Block, workdir: Path, env: dict[str, str]) -> tuple[bool, str]:
    script = "set -euo pipefail\n" "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + with_args(
        block.source, block.args
    )
    try:
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {BLOCK_TIMEOUT_S} s"
    return done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _python(block: Block, namespace: dict) -> tuple[bool, str]:
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            exec(compile(block.source, block.where, "exec"), namespace)
    except Exception as error:
        return False, f"{output.getvalue()[-3000:]}{type(error).__name__}: {error}"
    return True, output.getvalue()[-4000:]


def scratch(workdir: Path) -> dict[str, str]:
    """Link the repository's configs, examples and venv into ``workdir``; the environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link = workdir / name
        if not link.exists() and (REPO / name).exists():
            link.symlink_to(REPO / name)
    env = dict(os.environ)
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TRITON_INTERPRET", None)  # as a user runs them (no GPU: the torch paths)
    return env


def run(pages: list[str], workdir: Path, say=print) -> list[str]:
    """Run the runnable blocks of ``pages`` in order in ``workdir``; the failures (the first
    stops the run: later blocks may need what it should have written)."""
    env = scratch(workdir)
    home = os.getcwd()
    for page in pages:
        found, errors = blocks(page)
        if errors:
            return errors
        namespace: dict = {"__name__": "__docs_example__"}
        for block in found:
            if not block.run:
                continue
            start = time.perf_counter()
            if block.language == "bash":
                ok, output = _bash(block, workdir, env)
            else:
                os.chdir(workdir)
                try:
                    ok, output = _python(block, namespace)
                finally:
                    os.chdir(home)
            say(f"{'ok  ' if ok else 'FAIL'} {block.where} ({time.perf_counter() - start:.0f} s)")
            if not ok:
                return [f"{block.where}: the example failed:\n{output}"]
    return []


def check(pages: list[str]) -> list[str]:
    """The marker errors of ``pages``."""
    return [error for page in pages for error in blocks(page)[1]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help="pages to run (default: all, in order)")
    parser.add_argument("--check", action="store_true", help="only check the markers")
    parser.add_argument("--workdir", help="the scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    pages = args.pages or list(PAGES)
    errors = check(pages)
    if not errors and not args.check:
        if args.workdir:
            errors = run(pages, Path(args.workdir).resolve())
        else:
            with tempfile.TemporaryDirectory(prefix="recsys-docs-") as workdir:
                errors = run(pages, Path(workdir))
    for error in errors:
        print(error, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
