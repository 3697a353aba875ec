"""Loading configs (defaults < TOML recipe < ``--section.key=value`` overrides, every value
checked against its field's type and range), writing them back as TOML, and the key reference
(``recsys config --reference``, the docs' configuration page)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import itertools
import textwrap
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from recsys.config.sections import Config
from recsys.config.sequences import SEQUENCE_MODELS

# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Build a :class:`Config` from defaults, an optional TOML recipe and command-line overrides.

    Args:
        path: TOML recipe file, or None for the defaults.
        overrides: ``--section.key=value`` strings (``--`` optional); values are parsed as TOML
            (``64``, ``1e-3``, ``true``, ``[64, 32, 1]``), else taken as a plain string. A list
            may also be written ``64,32,1``.

    Returns:
        The resolved config. ``run.name`` defaults to the recipe's file stem.

    Raises:
        FileNotFoundError: the recipe file does not exist.
        ValueError: a key is unknown, a value has the wrong type, or the TOML is malformed.
    """
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: '{path}'")
        try:
            table = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"config file '{path}' is not valid TOML: {err}") from None
        source = f"config file '{path}'"
        _apply_table(config, _move_renamed_keys(table, source), prefix="", source=source)
        if not config.run.name:
            config.run.name = path.stem
    for override in overrides:
        key, value = _parse_override(override)
        key = RENAMED_KEYS.get(key, key)
        _set_key(config, key, value, source=f"command line '{override}'")
    if not config.run.name:
        config.run.name = "recsys"
    if not config.run.dir:
        config.run.dir = str(Path("runs") / config.run.name)
    return config


def names_its_run(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> bool:
    """Whether the recipe's ``[run]`` table or the overrides set ``run.name`` or ``run.dir``:
    a named run keeps its directory (and is refused when that holds another run); an unnamed
    one may be written to the next free directory (``recsys train``)."""
    if any(_parse_override(o)[0] in ("run.name", "run.dir") for o in overrides):
        return True
    if path is None or not Path(path).is_file():
        return False
    run = tomllib.loads(Path(path).read_text()).get("run", {})
    return isinstance(run, dict) and bool(run.get("name") or run.get("dir"))


RENAMED_KEYS = {
    "model.cin_layer_sizes": "model.xdeepfm.cin_layer_sizes",
    "model.pnn_product": "model.pnn.product",
}
"""Keys of earlier versions -> their name now. Every run directory and checkpoint holds a
``config.toml`` listing every key, so the old names are still read, in TOML and on the command
line, and mean the new ones (written back under the new name)."""


EARLIER_DEFAULTS = {"model.sequence.positions": "from_end"}
"""Keys added with a default that differs from what configs saved before them meant -> that
meaning. A saved ``config.toml`` (a run directory's, a checkpoint's) lists every key of the
version that wrote it, so one without such a key was written before it and is read with this
value (:func:`load_saved_config`); a recipe without it gets today's default."""


def load_saved_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
    """:func:`load_config` of a ``config.toml`` that recsys wrote (a run directory's or a
    checkpoint's): a key of :data:`EARLIER_DEFAULTS` it lacks means its earlier value (for the
    models that read it: ``model.sequence.positions``, sasrec and hstu)."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text()) if path.is_file() else {}
    except tomllib.TOMLDecodeError:
        table = {}  # load_config names the file and the error
    model = table.get("model", {}) if isinstance(table.get("model"), dict) else {}
    implied = []
    if model.get("name") in SEQUENCE_MODELS:
        for key, value in EARLIER_DEFAULTS.items():
            holder: Any = table
            for name in key.split("."):
                holder = holder.get(name) if isinstance(holder, dict) else None
            if holder is None:
                implied.append(f"--{key}={value}")
    return load_config(path, [*implied, *overrides])


def _move_renamed_keys(table: dict[str, Any], source: str) -> dict[str, Any]:
    """``table`` (a parsed TOML file) with the keys of :data:`RENAMED_KEYS` moved to their new
    place; a file that sets both a key's old and new name is an error."""
    for old, new in RENAMED_KEYS.items():
        *old_sections, old_name = old.split(".")
        *new_sections, new_name = new.split(".")
        holder: Any = table
        for name in old_sections:
            holder = holder.get(name) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or old_name not in holder:
            continue
        target: Any = table
        for name in new_sections:
            target = target.setdefault(name, {})
        if not isinstance(target, dict):
            continue  # a value where the section belongs: _apply_table names it
        if new_name in target:
            raise ValueError(f"{source}: sets both '{old}' (its earlier name) and '{new}'")
        target[new_name] = holder.pop(old_name)
    return table


def _parse_override(override: str) -> tuple[str, Any]:
    text = override.removeprefix("--")
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"override '{override}' must look like --section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def _apply_table(obj: Any, table: dict[str, Any], prefix: str, source: str) -> None:
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and not _is_table_field(obj, name):
            child = _resolve(obj, name, key, source)
            if not dataclasses.is_dataclass(child):
                raise ValueError(f"{source}: '{key}' is a value, not a section [{key}]")
            _apply_table(child, value, prefix=f"{key}.", source=source)
        else:
            _set_key(obj, name, value, source, prefix=prefix)


def config_differences(old: Config, new: Config) -> list[str]:
    """``"section.key: old -> new"`` for every key whose value differs between two configs."""
    lines = []
    for key in _all_keys(old):
        path = key.split(".")
        before, after = functools.reduce(getattr, path, old), functools.reduce(getattr, path, new)
        if before != after:
            lines.append(f"{key}: {_toml_value(before)} -> {_toml_value(after)}")
    return lines


def _is_table_field(obj: Any, name: str) -> bool:
    """Whether ``name`` is a field of section ``obj`` holding a free-form table
    (``dict[str, Any]``, such as ``model.args``): its keys are the user's, not the config's."""
    if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
        return False
    return typing.get_origin(typing.get_type_hints(type(obj))[name]) is dict


def _set_key(root: Any, key: str, value: Any, source: str, prefix: str = "") -> None:
    *parents, name = key.split(".")
    obj = root
    walked = prefix
    for index, part in enumerate(parents):
        if _is_table_field(obj, part):  # --model.args.gate_hidden=32: one key of the table
            table = copy.deepcopy(getattr(obj, part))
            inner = table
            for level in parents[index + 1 :]:
                inner = inner.setdefault(level, {})
                if not isinstance(inner, dict):
                    raise ValueError(f"{source}: '{walked}{part}.{level}' is a value, not a table")
            inner[name] = value
            setattr(obj, part, _coerce(table, dict, f"{walked}{part}", source))
            return
        obj = _resolve(obj, part, f"{walked}{part}", source)
        if not dataclasses.is_dataclass(obj):
            raise ValueError(f"{source}: '{walked}{part}' is a value, not a section")
        walked = f"{walked}{part}."
    full_key = f"{walked}{name}"
    current = _resolve(obj, name, full_key, source)
    if dataclasses.is_dataclass(current):
        raise ValueError(f"{source}: '{full_key}' is a section; set one of its keys instead")
    hint = typing.get_type_hints(type(obj), include_extras=True)[name]
    setattr(obj, name, _coerce(value, hint, full_key, source))


def _resolve(obj: Any, name: str, key: str, source: str) -> Any:
    names = [f.name for f in dataclasses.fields(obj)]
    if name not in names:
        parent = key.rpartition(".")[0]
        valid = [f"{parent}.{n}" if parent else n for n in names]
        close = difflib.get_close_matches(key, valid + _all_keys(), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
        raise ValueError(f"{source}: unknown config key '{key}'{hint}")
    return getattr(obj, name)


def _all_keys(obj: Any = None, prefix: str = "") -> list[str]:
    obj = Config() if obj is None else obj
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += _all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    def fail() -> ValueError:
        return ValueError(
            f"{source}: config key '{key}' expects {_type_name(hint)}, "
            f"got {type(value).__name__} {value!r}"
        )

    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *rules = typing.get_args(hint)
        value = _coerce(value, base, key, source)
        for rule in rules:
            if (problem := rule.problem(value)) is not None:
                raise ValueError(f"{source}: config key '{key}' {problem}, got {value!r}")
        return value
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            extra = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{source}: config key '{key}' must be one of "
                f"{', '.join(repr(c) for c in choices)}, got {value!r}{extra}"
            )
        return value
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if isinstance(value, str):
            parts = [p.strip() for p in value.split(",") if p.strip()]
            value = [_parse_scalar(p) for p in parts]
        if not isinstance(value, list):
            raise fail()
        return [_coerce(v, item_hint, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise fail()
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise fail()
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail()
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail()
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise fail()
        return value
    raise TypeError(f"config key '{key}' has an unsupported annotation {hint!r}")


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Annotated:
        base, *rules = typing.get_args(hint)
        return " ".join([_type_name(base), *(str(rule) for rule in rules)])
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(hint))
    if hint is dict or typing.get_origin(hint) is dict:
        return "a table"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint)


# ---------------------------------------------------------------------------------------------
# Writing and documenting


def to_toml(config: Any) -> str:
    """Render a config (or any section of it) as TOML that :func:`load_config` reads back."""
    lines: list[str] = []
    _write_section(config, [], lines)
    return "\n".join(lines).strip() + "\n"


def _split_fields(obj: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(values, sub-sections) of a config section, each as (field name, value) pairs."""
    items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return (
        [(n, v) for n, v in items if not dataclasses.is_dataclass(v)],
        [(n, v) for n, v in items if dataclasses.is_dataclass(v)],
    )


def _write_section(obj: Any, path: list[str], lines: list[str]) -> None:
    values, sections = _split_fields(obj)
    if path and values:
        lines.append(f"[{'.'.join(path)}]")
    lines.extend(f"{name} = {_toml_value(value)}" for name, value in values)
    if values:
        lines.append("")
    for name, value in sections:
        _write_section(value, [*path, name], lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key)
    return key if bare else _toml_value(key)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def config_reference() -> str:
    """Markdown reference of every config key: type, default and docstring."""
    out = [
        "# Configuration reference",
        "",
        "Generated by `recsys config --reference` from the docstrings in",
        "`recsys/config/sections.py`, `recsys/config/models.py` (the `[model]` sections) and",
        "`recsys/config/sequences.py` (the sections of sequence models). Set any key in a TOML",
        "recipe (`[train]` / `batch_size = 2048`) or on the command line",
        "(`--train.batch_size=2048`); the command line wins over the recipe, the recipe over",
        "these defaults.",
        "",
    ]
    _reference_section(Config(), [], out)
    out += [
        "## Renamed keys",
        "",
        "Configs written by earlier versions (every run directory's and checkpoint's",
        "`config.toml`) still load: these old names are read as the new ones, in TOML and on",
        "the command line.",
        "",
        "| old key | key now |",
        "| --- | --- |",
        *(f"| `{old}` | `{new}` |" for old, new in RENAMED_KEYS.items()),
    ]
    return "\n".join(out).rstrip() + "\n"


def _reference_section(obj: Any, path: list[str], out: list[str]) -> None:
    cls = type(obj)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    values, sections = _split_fields(obj)
    rows = []
    for name, value in values:
        doc = docs.get(name, "").replace("\n", " ")
        rows.append(f"| `{name}` | {_type_name(hints[name])} | `{_toml_value(value)}` | {doc} |")
    if path:
        out += [f"## [{'.'.join(path)}]", "", inspect.cleandoc(cls.__doc__ or ""), ""]
    if rows:
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    for name, value in sections:
        _reference_section(value, [*path, name], out)
