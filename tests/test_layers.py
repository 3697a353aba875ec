"""The package's shape, checked from its imports (every import statement of every module, in
functions and under ``if TYPE_CHECKING:`` too: a type is a dependency): no import circle, and a
layer imports only its own layer and the ones below it:

    _files, _suggest, config  <-  ops  <-  embedding  <-  data  <-  distributed  <-  models
    <-  build  <-  checkpoint  <-  train  <-  serve  <-  report, cli

(a package's ``__init__`` that re-exports its modules does not count as importing them for the
circle check: ``from recsys.checkpoint.io import x`` is an edge to ``recsys.checkpoint.io``
only). Library code imports neither ``tests`` nor ``benchmarks`` and reads no other module's
private (``_``) names. ``docs/architecture.md`` states the same rules; a file past 600 lines
fails too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import recsys

PACKAGE = Path(recsys.__file__).resolve().parent
LAYERS = [
    ("recsys._files", "recsys._suggest", "recsys.config"),
    ("recsys.ops",),
    ("recsys.embedding",),
    ("recsys.data",),
    ("recsys.distributed",),
    ("recsys.models",),
    ("recsys.build",),
    ("recsys.checkpoint",),
    ("recsys.train",),
    ("recsys.serve",),
    ("recsys.report", "recsys.cli", "recsys.__main__", "recsys"),
]
MAX_LINES = 600


def modules() -> dict[str, Path]:
    """Every module of recsys by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["recsys", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer(name: str) -> int:
    """The layer of module ``name``: that of the longest package prefix listed in LAYERS."""
    best, found = -1, None
    for index, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    assert found is not None, f"{name} is in no layer: add it to LAYERS"
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The recsys modules ``name`` imports (the deepest module each statement names), with the
    line of the first such import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: its module
                target = target.rpartition(".")[0]
            if target.startswith("recsys") and target != name:
                found.setdefault(target, node.lineno)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_layer_imports_a_higher_one(graph):
    wrong = [
        f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)}) at line {line}"
        for name, targets in graph.items()
        for target, line in targets.items()
        if layer(target) > layer(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_circle(graph):
    # A package's __init__ re-exporting its own modules is not a circle: drop those edges.
    edges = {
        name: {t for t in targets if not t.startswith(name + ".")}
        for name, targets in graph.items()
    }
    circles = _cycles(edges)
    assert not circles, "\n".join("modules in one import circle: " + ", ".join(c) for c in circles)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each strongly connected component of more than one module (Tarjan):
    every module of one can reach every other through imports."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_no_file_is_longer_than_the_limit():
    long = [
        f"{path.relative_to(PACKAGE.parent)}: {n} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"files over {MAX_LINES} lines (split them by responsibility):\n" + "\n".join(
        long
    )


def outside_reads(name: str, path: Path, known: dict[str, Path]) -> list[str]:
    """What module ``name`` reads that library code must not: an import of ``tests`` or
    ``benchmarks``, and another recsys module's private name (``from recsys.a import _f``, or
    ``a._f`` for a module ``a`` imported by name)."""
    tree = ast.parse(path.read_text())
    found, modules_by_alias = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("tests", "benchmarks"):
                    found.append(f"{name} imports {alias.name} at line {node.lineno}")
                elif alias.name in known and alias.asname:
                    modules_by_alias[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in ("tests", "benchmarks"):
                found.append(f"{name} imports {node.module} at line {node.lineno}")
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    modules_by_alias[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif node.module.startswith("recsys") and _private(alias.name):
                    found.append(
                        f"{name} imports {node.module}.{alias.name} (private) at line {node.lineno}"
                    )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules_by_alias
            and _private(node.attr)
        ):
            target = modules_by_alias[node.value.id]
            found.append(f"{name} reads {target}.{node.attr} (private) at line {node.lineno}")
    return found


def _private(attribute: str) -> bool:
    return attribute.startswith("_") and not attribute.startswith("__")


def test_library_code_reads_no_tests_benchmarks_or_private_names():
    known = modules()
    wrong = [line for name, path in known.items() for line in outside_reads(name, path, known)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_private_read_and_a_benchmark_import(tmp_path):
    known = {"recsys.ops.x": tmp_path / "x.py", "recsys.train.y": tmp_path / "y.py"}
    known["recsys.ops.x"].write_text("def _f():\n    pass\n")
    known["recsys.train.y"].write_text(
        "from recsys.ops import x\nfrom recsys.ops.x import _f\nimport benchmarks._harness\n"
        "x._f()\n"
    )
    assert outside_reads("recsys.train.y", known["recsys.train.y"], known) == [
        "recsys.train.y imports recsys.ops.x._f (private) at line 2",
        "recsys.train.y imports benchmarks._harness at line 3",
        "recsys.train.y reads recsys.ops.x._f (private) at line 4",
    ]


def test_the_checker_sees_a_back_import(tmp_path):
    """A deliberate back-import (ops importing train) is a layer violation and, with the
    import back, a circle: both checks would fail on it."""
    known = {"recsys.ops.x": tmp_path / "x.py", "recsys.train.y": tmp_path / "y.py"}
    known["recsys.ops.x"].write_text("from recsys.train.y import run\n")
    known["recsys.train.y"].write_text("def run():\n    from recsys.ops.x import f\n")
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph == {"recsys.ops.x": {"recsys.train.y": 1}, "recsys.train.y": {"recsys.ops.x": 2}}
    assert layer("recsys.train.y") > layer("recsys.ops.x")
    assert _cycles({k: set(v) for k, v in graph.items()}) == [["recsys.ops.x", "recsys.train.y"]]


def test_every_test_folder_is_collected():
    """tests/ mirrors recsys/, so a package named like one of pytest's skipped folders (build/)
    would silently drop its tests from the run: no folder under tests/ may match
    ``norecursedirs``."""
    import fnmatch
    import tomllib

    root = PACKAGE.parent
    options = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]
    patterns = options["ini_options"]["norecursedirs"]
    skipped = [
        str(folder.relative_to(root))
        for folder in (root / "tests").rglob("*")
        if folder.is_dir()
        and folder.name != "__pycache__"
        and any(fnmatch.fnmatch(folder.name, pattern) for pattern in patterns)
    ]
    assert not skipped, f"pytest would skip {skipped} (norecursedirs = {patterns})"
