"""recsys.models holds architecture only: neither it nor anything it imports reads a config, a
dataset, the trainer or the distributed layer (the registry that does is recsys.build.models)."""

import ast
from pathlib import Path

import recsys.models

ROOT = Path(recsys.models.__file__).resolve().parents[2]  # the directory holding recsys/
FORBIDDEN = ("recsys.config", "recsys.data", "recsys.train", "recsys.distributed")


def module_file(name: str) -> Path | None:
    """The source file of module ``name`` of recsys (None for a name that is not a module,
    such as a class imported with ``from package import Class``)."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(name: str) -> set[str]:
    """The recsys modules that module ``name`` imports anywhere in its file (functions too),
    with the packages that importing them runs (bar ``recsys`` itself)."""
    file = module_file(name)
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from package, level 1 = this package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(2, len(parts) + 1):  # recsys.a, recsys.a.b, ...
                if parts[0] == "recsys" and module_file(".".join(parts[:i])):
                    found.add(".".join(parts[:i]))
    return found


def test_models_import_neither_config_nor_data_nor_trainer():
    seen, todo = set(), ["recsys.models"]
    imported_by: dict[str, str] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for module in imported_modules(name) - seen:
            imported_by.setdefault(module, name)
            todo.append(module)
    assert "recsys.models.dlrm" in seen and "recsys.embedding.collection" in seen
    bad = {m: imported_by[m] for m in seen if m.startswith(FORBIDDEN)}
    assert not bad, f"recsys.models reaches (module: imported by) {bad}"


def test_the_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The walk finds relative and function-level imports (so the test above could fail)."""
    package = tmp_path / "recsys" / "fake"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("def f():\n    from ..config import sections\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "recsys" / "config").mkdir()
    (tmp_path / "recsys" / "config" / "__init__.py").write_text("")
    (tmp_path / "recsys" / "config" / "sections.py").write_text("")
    assert imported_modules("recsys.fake") == {"recsys.config", "recsys.config.sections"}
