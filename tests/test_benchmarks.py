"""The benchmarks package (benchmarks/): every module imports as ``benchmarks.<name>``, so
``make bench`` and ``scripts/gpu_check.sh`` (``python -m benchmarks.<topic>``) find them and a
moved recsys module that a benchmark imports fails here, not on the next GPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A subprocess: some benchmark modules quiet torchrec's loggers and warnings when imported, which
# must not leak into the other tests of this process.
_IMPORT_ALL = """
import importlib, json, sys
print(json.dumps([importlib.import_module(name).__name__ for name in sys.argv[1:]]))
"""


def test_every_benchmark_module_imports_and_every_topic_runs_as_main():
    paths = sorted((REPO / "benchmarks").glob("*.py"))
    names = [f"benchmarks.{path.stem}" for path in paths if path.stem != "__init__"]
    topics = {f"benchmarks.{path.stem}" for path in paths if not path.stem.startswith("_")}
    assert "benchmarks._harness" in names and "benchmarks.embedding_bag" in topics
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *names],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == names
    not_runnable = [
        path.name
        for path in paths
        if f"benchmarks.{path.stem}" in topics
        and 'if __name__ == "__main__":' not in path.read_text()
    ]
    assert not_runnable == [], "a benchmark without _ runs as python -m benchmarks.<topic>"


def test_scripts_holds_no_benchmark():
    """scripts/ keeps gpu_check.sh, the kernel table and one-off tools; benchmarks live in
    benchmarks/ (a bench script left in scripts/ would run from neither make bench nor
    gpu_check.sh)."""
    assert sorted((REPO / "scripts").glob("bench_*.py")) == []
    assert sorted((REPO / "scripts").glob("_*.py")) == []
