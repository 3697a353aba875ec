"""The model contract: how ``model.name`` becomes a class, and what the trainer passes it.

``model.name`` is one of three things, resolved by :func:`resolve_model`:

- a built-in model (``dlrm``, ``dcn``, ..., ``sasrec``; :data:`recsys.build.models.MODELS`);
- the name of an installed package's entry point in the group ``recsys.models``
  (``[project.entry-points."recsys.models"]`` / ``gated_dlrm = "my_pkg.models:GatedDLRM"`` in
  its ``pyproject.toml``); a built-in's name always means the built-in;
- ``"module:Class"``: a class imported from the installed packages, then from the working
  directory (appended to ``sys.path``, so it never shadows an installed module).

A click model (every model but the sequence ones) is built the same way whatever its origin
(:func:`recsys.build.models.build_model`): the trainer reads the constructor's signature and
passes, **by parameter name**, each of :data:`TRAINER_ARGUMENTS` the class takes (the tables
are made only when it takes them); the class's other parameters come from ``[model.args]``
(a built-in's from its own section, such as ``[model.cross]``) or keep their defaults. Its
``forward(dense_features, sparse_features)`` returns logits ``[B, T]`` (:class:`ClickModel`).
A class that does not fit is refused before any table is built (:func:`check_constructor`,
:func:`check_forward`), or at the first batch for an output of the wrong shape.

Example::

    resolved = resolve_model("mymodels:DLRMModule")
    resolved.origin  # "mymodels:DLRMModule (./mymodels.py)"
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

__all__ = [
    "BUILTIN_MODELS",
    "ENTRY_POINT_GROUP",
    "TRAINER_ARGUMENTS",
    "ClickModel",
    "ResolvedModel",
    "available_models",
    "check_constructor",
    "check_forward",
    "check_logits",
    "check_model_class",
    "model_name_problem",
    "models_table",
    "resolve_model",
]

ENTRY_POINT_GROUP = "recsys.models"
"""The entry-point group an installed package lists its model classes in."""

TRAINER_ARGUMENTS: dict[str, str] = {
    "embedding_bag_collection": (
        "a recsys EmbeddingBagCollection (TorchRec's interface): one table per categorical "
        "feature of the data, named and keyed by the feature, model.embedding_dim wide, with "
        "the run's embedding options applied (fused optimizer, model.embedding_dtype, "
        "[model.dynamic], [model.storage]); under torchrun its tables are on the meta device "
        "until parallelize shards them, so read its configs, not its weights"
    ),
    "linear_embedding_bag_collection": (
        "a second collection of dimension-1 tables, one per feature (a first-order term)"
    ),
    "tables": "the EmbeddingBagConfig of each table of embedding_bag_collection, in order",
    "dense_in_features": "the number of dense features (0 for categorical-only data)",
    "embedding_dim": "model.embedding_dim",
    "num_tasks": "the number of labels per sample (T of the [B, T] logits)",
    "dense_arch_layer_sizes": (
        "model.dense_arch_layer_sizes (checked to end with model.embedding_dim when the data "
        "has dense features)"
    ),
    "over_arch_layer_sizes": "model.over_arch_layer_sizes (checked to end with num_tasks)",
    "activation": "model.activation",
    "dropout": "model.dropout",
    "dense_device": "the torch.device of the run (TorchRec's models build their MLPs on it)",
}
"""What the trainer passes a click model's constructor, by parameter name: name -> meaning."""


@runtime_checkable
class ClickModel(Protocol):
    """What a click model is to the trainer (type-check your class against it): an
    ``nn.Module`` whose forward maps a batch to logits (not probabilities)."""

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        """``dense_features`` [B, N] float32, ``sparse_features`` the ids of every
        categorical feature (keys in the data's order) -> logits [B, T]."""
        ...


@dataclass(frozen=True)
class ResolvedModel:
    """A ``model.name`` resolved to its class."""

    name: str
    """As ``model.name`` says it."""
    cls: type[nn.Module]
    origin: str
    """Where the class came from, for messages: ``"built-in"``, ``"entry point 'x' of
    my-package 1.0 (my_pkg.models:X)"`` or ``"mymodels:DLRMModule (./mymodels.py)"``."""
    builtin: bool


BUILTIN_MODELS: dict[str, str] = {
    "dlrm": "recsys.models.dlrm:DLRM",
    "dlrm_dcn": "recsys.models.dlrm:DLRM_DCN",
    "dcn": "recsys.models.dcn:DCN",
    "pnn": "recsys.models.pnn:PNN",
    "mmoe": "recsys.models.mmoe:MMoE",
    "deepfm": "recsys.models.deepfm:DeepFM",
    "wide_deep": "recsys.models.wide_deep:WideDeep",
    "xdeepfm": "recsys.models.xdeepfm:XDeepFM",
    "sasrec": "recsys.models.sasrec:SASRec",
    "hstu": "recsys.models.hstu:HSTU",
    "hstu_ranking": "recsys.models.hstu_ranking:HSTURanking",
}
"""The built-in models' short names -> their classes, registered like an entry point (how each
is built, its own options: :data:`recsys.build.models.MODELS`)."""


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_models() -> dict[str, str]:
    """Every short name ``model.name`` may take -> where its class comes from: the built-ins,
    then the installed entry points (their ``"module:Class"`` and package; one with a
    built-in's name is listed as ignored)."""
    names = {name: f"built-in ({target})" for name, target in BUILTIN_MODELS.items()}
    for name, ep in sorted(_entry_points().items()):
        if name in names:
            names[f"{name} (ignored)"] = f"{ep.value}: entry point shadowed by the built-in"
            continue
        dist = getattr(ep, "dist", None)
        package = f", package {dist.name} {dist.version}" if dist is not None else ""
        names[name] = f"{ep.value} (entry point{package})"
    return names


def models_table() -> str:
    """What ``recsys config --models`` prints: every short name and its class."""
    models = available_models()
    width = max(len(name) for name in models) + 2
    lines = [f"{'model.name':<{width}}class"]
    lines += [f"{name:<{width}}{origin}" for name, origin in models.items()]
    lines.append(
        'or any class as model.name = "module:Class" (README, "Your model class"), with its '
        "own constructor options in [model.args]"
    )
    return "\n".join(lines) + "\n"


def resolve_model(name: str) -> ResolvedModel:
    """The class ``model.name`` names (see the module docstring).

    Raises:
        ValueError: an unknown short name (with the closest known one), a module that cannot
            be imported, an attribute it lacks, or something that is not an nn.Module class.
    """
    if name in BUILTIN_MODELS:  # only the one named is imported
        cls = _import_class(BUILTIN_MODELS[name], f"model.name {name!r}")
        return ResolvedModel(name, cls, "built-in", builtin=True)
    if ":" not in name:
        entry_points = _entry_points()
        if name in entry_points:
            ep = entry_points[name]
            dist = getattr(ep, "dist", None)
            package = f" of {dist.name} {dist.version}" if dist is not None else ""
            cls = _import_class(ep.value, f"model.name {name!r} (entry point {ep.value!r})")
            return ResolvedModel(name, cls, f"entry point {name!r}{package} ({ep.value})", False)
        known = [*BUILTIN_MODELS, *entry_points]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        raise ValueError(
            f"model.name {name!r}: not a built-in model or an installed entry point{hint} "
            f"Available: {', '.join(known)}, or a class of your own as 'module:Class'"
        )
    cls = _import_class(name, f"model.name {name!r}")
    where = inspect.getsourcefile(cls) or "?"
    shown = os.path.relpath(where) if not os.path.relpath(where).startswith("..") else where
    return ResolvedModel(name, cls, f"{name} ({shown})", builtin=False)


def model_name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as ``model.name`` (None: it resolves); the config's check."""
    try:
        resolve_model(name)
    except ValueError as error:
        return f"names no model class: {str(error).removeprefix(f'model.name {name!r}: ')}"
    return None


def _import_class(target: str, what: str) -> type[nn.Module]:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what}: expected 'module:Class' (e.g. 'mymodels:DLRMModule')")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after the installed packages: it shadows none of them
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise ValueError(
                f"{what}: no module {error.name!r} in the installed packages or the working "
                f"directory {cwd}: run from the directory that holds it, or install its package"
            ) from None
        raise ValueError(f"{what}: importing {module_name!r} failed: {error}") from error
    except Exception as error:  # the user's module raised while importing
        raise ValueError(
            f"{what}: importing {module_name!r} failed: {type(error).__name__}: {error}"
        ) from error
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            classes = [n for n, v in vars(module).items() if isinstance(v, type)]
            close = difflib.get_close_matches(part, classes, n=1)
            hint = f"; did you mean {module_name}:{close[0]}?" if close else ""
            raise ValueError(f"{what}: module {module_name!r} has no {attribute!r}{hint}")
        found = getattr(found, part)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"{what}: {attribute} is a {type(found).__name__}, not an nn.Module class")
    return found


def check_constructor(
    resolved: ResolvedModel, own: dict[str, Any], args: dict[str, Any]
) -> set[str]:
    """The names of :data:`TRAINER_ARGUMENTS` the class's constructor takes, after checking
    that it can be called: every ``args`` key ([model.args]) is one of its parameters that
    nothing else sets, and every parameter without a default is provided by the trainer,
    ``own`` (a built-in's section) or ``args``.

    Raises:
        ValueError: one line naming the class, the bad or missing argument and what would fit.
    """
    cls = resolved.cls
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    named = {p.name: p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    what = f"model.name {resolved.name!r}: {cls.__name__}.__init__"
    for key in args:
        if key in TRAINER_ARGUMENTS and (key in named or any_keyword):
            raise ValueError(
                f"{what}: [model.args] sets {key!r}, which the trainer passes "
                f"({TRAINER_ARGUMENTS[key].split(';')[0]}); remove it from [model.args]"
            )
        if key in own:
            raise ValueError(
                f"{what}: [model.args] sets {key!r}, which this built-in model reads from its "
                "own section of [model]; set it there"
            )
        if key not in named and not any_keyword:
            close = difflib.get_close_matches(key, list(named), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{what} takes no argument {key!r} (from [model.args]; it takes "
                f"{', '.join(named) or 'none'}){hint}"
            )
        if key in named and named[key].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ValueError(f"{what}: {key!r} is positional-only; the trainer passes by name")
    takes = {name for name in TRAINER_ARGUMENTS if name in named}
    for name, parameter in named.items():
        required = parameter.default is parameter.empty
        if required and parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ValueError(f"{what}: {name!r} is positional-only; the trainer passes by name")
        if required and not (name in takes or name in own or name in args):
            raise ValueError(
                f"{what} needs {name!r}, which the trainer does not pass; set it in "
                f"[model.args] (--model.args.{name}=...) or name a trainer argument "
                f"({', '.join(TRAINER_ARGUMENTS)})"
            )
    return takes


def check_forward(resolved: ResolvedModel) -> None:
    """Raise ``ValueError`` unless ``forward`` can be called as
    ``forward(dense_features, sparse_features)`` (two positional arguments)."""
    cls = resolved.cls
    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    required = [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if (len(positional) >= 2 or variadic) and len(required) <= 2:
        return
    shown = ", ".join(["self", *(str(p) for p in parameters)])
    raise ValueError(
        f"model.name {resolved.name!r}: {cls.__name__}.forward({shown}) cannot be called as "
        "forward(dense_features, sparse_features): the trainer passes the dense features "
        "[B, N] and a KeyedJaggedTensor of the ids, and expects logits [B, T]"
    )


def check_model_class(name: str, args: dict[str, Any]) -> None:
    """The checks of a model class of the user's that need no data (its forward, its
    constructor against ``[model.args]``), run before the data is read; a built-in's are run
    by :func:`~recsys.build.models.build_model`, with its options."""
    resolved = resolve_model(name)
    if not resolved.builtin:
        check_forward(resolved)
        check_constructor(resolved, {}, args)


def check_logits(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> None:
    """Raise ``ValueError`` when a click model's output is not ``[B, T]`` like ``labels``
    (shapes only: no sync)."""
    if isinstance(logits, torch.Tensor) and logits.shape == labels.shape:
        return
    name = type(getattr(model, "module", model)).__name__
    got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
    raise ValueError(
        f"{name}.forward returned logits of shape {got}; the trainer expects [B, T] = "
        f"{list(labels.shape)} (batch, tasks), e.g. [B, 1] for one label"
    )
