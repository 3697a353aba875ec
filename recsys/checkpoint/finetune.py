"""Fine-tuning: a new run that starts from a checkpoint's model weights.

:func:`init_from_checkpoint` loads the weights only: the optimizers (the tables' fused states
included) start fresh, at step 0, with the new run's learning rates. It is strict by default:
every parameter and buffer of the model must be in the checkpoint with the same shape, except

- ``new_modules``: paths that start from their fresh initialization (a task head added to an
  MMoE: ``tower_arch.1``);
- ``grow``: parameters whose first dimension grew; the checkpoint's rows are loaded and the
  new rows keep their initialization (``"embeddings"``: tables whose row count grew with new
  ids; ``"moe_arch.gates"``: an MMoE's gate, whose rows are task-major, gaining a task).

Anything else that differs is one ``ValueError`` listing every difference, unless
``strict=false``, which loads what matches and reports the rest. :func:`freeze` stops modules
from training (``"embeddings"`` or module paths such as ``"dense_arch"``).

Call both on the unsharded model, before the embedding optimizer is set and before
:func:`recsys.distributed.parallel.parallelize` (which keeps frozen tables frozen).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from recsys._suggest import did_you_mean
from recsys.checkpoint.io import checkpoint_shapes, load_checkpoint
from recsys.config import CheckpointConfig
from recsys.embedding.interface import (
    embedding_collections,
    is_optimizer_state,
    state_prefix,
    variable_state_keys,
)

EMBEDDINGS = "embeddings"


def init_from_checkpoint(model: nn.Module, path: str | Path, config: CheckpointConfig) -> str:
    """Load the model weights of checkpoint ``path`` into ``model`` (see module docstring).

    Args:
        model: the new run's unsharded model.
        path: a checkpoint directory.
        config: the ``[checkpoint]`` section (new_modules, grow, strict).

    Returns:
        A report: what was loaded, grown, started fresh and (strict=false) skipped.

    Raises:
        ValueError: with strict, the model and checkpoint differ beyond new_modules and grow;
            a new_modules or grow entry that names nothing in the model.
    """
    optimizer_state = _optimizer_state_test(model)
    saved = {
        key.removeprefix("model."): shape
        for key, shape in checkpoint_shapes(path).items()
        if key.startswith("model.") and shape is not None
    }
    saved = {k: v for k, v in saved.items() if not is_optimizer_state(k)}
    own = {k: v for k, v in model.state_dict().items() if not optimizer_state(k)}
    new = _matching(config.new_modules, own, model, "new_modules")
    grow = _matching(config.grow, own, model, "grow")
    variable = variable_state_keys(model)
    same, grown, fresh, missing, mismatched = {}, {}, [], [], []
    for key, tensor in own.items():
        if key in new:
            fresh.append(key)
        elif key not in saved:
            missing.append(key)
        elif key in variable:  # a dynamic table's keys and rows: as many as it saved
            same[key] = torch.empty(tuple(saved[key]), dtype=tensor.dtype, device=tensor.device)
        elif tuple(saved[key]) == tuple(tensor.shape):
            same[key] = tensor
        elif key in grow and _grew(tuple(saved[key]), tuple(tensor.shape)):
            grown[key] = torch.empty(tuple(saved[key]), dtype=tensor.dtype, device=tensor.device)
        else:
            mismatched.append((key, list(saved[key]), list(tensor.shape)))
    unexpected = sorted(set(saved) - set(own))
    if config.strict and (missing or mismatched or unexpected):
        raise ValueError(_differences(path, missing, mismatched, unexpected, _table_weights(model)))
    state = {"model": {**same, **grown}}
    load_checkpoint(path, state)
    loaded = state["model"]
    with torch.no_grad():
        for key, tensor in loaded.items():
            target = own[key]
            if key in grown:
                target[: tensor.shape[0]].copy_(tensor)
            elif key not in variable:
                target.copy_(tensor)
    model.load_state_dict({k: v for k, v in loaded.items() if k in variable}, strict=False)
    lines = [f"fine-tuning from {path}: {len(same)} tensors loaded"]
    if grown:
        lines.append(
            "  grown (checkpoint rows loaded, new rows fresh): "
            + ", ".join(f"{k} {list(saved[k])} -> {list(own[k].shape)}" for k in grown)
        )
    if fresh:
        lines.append(f"  fresh (new_modules): {', '.join(fresh)}")
    skipped = missing + [f"{k} {old} vs {now}" for k, old, now in mismatched]
    if skipped:
        lines.append(f"  kept fresh, not loadable (strict=false): {', '.join(skipped)}")
    if unexpected:
        lines.append(f"  in the checkpoint but not the model (unused): {', '.join(unexpected)}")
    return "\n".join(lines)


def freeze(model: nn.Module, names: list[str]) -> list[str]:
    """Stop the modules ``names`` from training: their parameters take no gradient, and an
    embedding collection among them loses its fused optimizer (no update in backward).

    Args:
        model: the unsharded model.
        names: ``"embeddings"`` (every embedding collection) or module paths; a path inside a
            collection (a single table) is refused: a collection is updated as a whole.

    Returns:
        The module paths frozen.
    """
    modules = dict(model.named_modules())
    collections = embedding_collections(model)
    frozen = []
    for name in names:
        if name == EMBEDDINGS:
            targets = list(collections)
        elif name in modules and name != "":
            inside = [c for c in collections if c and name.startswith(f"{c}.")]
            if inside:
                raise ValueError(
                    f"checkpoint.freeze: '{name}' is inside the embedding collection "
                    f"'{inside[0]}'; freeze the whole collection ('{inside[0]}') or "
                    f"'{EMBEDDINGS}'"
                )
            targets = [name]
        else:
            choices = [EMBEDDINGS, *(p for p in modules if p)]
            raise ValueError(
                f"checkpoint.freeze: {type(model).__name__} has no module '{name}'"
                f"{did_you_mean(name, choices)}; expected '{EMBEDDINGS}' or one of its "
                f"top-level modules: {', '.join(n for n, _ in model.named_children())}"
            )
        for target in targets:
            for collection in embedding_collections(modules[target]).values():
                if collection.optimizer is not None:
                    collection.set_optimizer(None)
            for parameter in modules[target].parameters():
                parameter.requires_grad_(False)
            frozen.append(target)
    return frozen


def _optimizer_state_test(model: nn.Module):
    """A test of whether a key of ``model``'s state is a collection's fused optimizer state:
    never part of fine-tuning (checkpoint keys are tested by their shape alone, with
    :func:`is_optimizer_state`: the checkpoint may hold tables the model does not)."""
    prefixes = {state_prefix(p): c for p, c in embedding_collections(model).items()}

    def is_optimizer_state(key: str) -> bool:
        return any(
            key.startswith(prefix) and collection.is_optimizer_state_key(key[len(prefix) :])
            for prefix, collection in prefixes.items()
        )

    return is_optimizer_state


def _table_weights(model: nn.Module) -> set[str]:
    """Every collection's table weight keys in the model's state dict."""
    return {
        state_prefix(path) + key
        for path, collection in embedding_collections(model).items()
        for key in collection.weight_keys()
    }


def _matching(
    names: list[str], own: dict[str, torch.Tensor], model: nn.Module, option: str
) -> set[str]:
    """State keys that ``names`` cover: "embeddings" (table weights), a module path (its keys)
    or a key. An entry covering nothing is a ValueError."""
    tables = _table_weights(model)
    covered: set[str] = set()
    for name in names:
        keys = tables if name == EMBEDDINGS else {k for k in own if _under(k, name)}
        if not keys:
            raise ValueError(
                f"checkpoint.{option}: '{name}' names nothing in {type(model).__name__}"
                f"{did_you_mean(name, [EMBEDDINGS, *own])}"
            )
        covered |= keys
    return covered


def _under(key: str, path: str) -> bool:
    return key == path or key.startswith(f"{path}.")


def _grew(old: tuple[int, ...], new: tuple[int, ...]) -> bool:
    return len(old) == len(new) and old[1:] == new[1:] and old[0] < new[0]


def _differences(
    path: str | Path,
    missing: list[str],
    mismatched: list[tuple[str, list[int], list[int]]],
    unexpected: list[str],
    tables: set[str],
) -> str:
    lines = [f"checkpoint.init_from = '{path}' does not match the model:"]
    if missing:
        modules = sorted({k.rsplit(".", 1)[0] for k in missing})
        lines.append(
            f"  not in the checkpoint: {', '.join(missing)} (start them fresh with "
            f"checkpoint.new_modules={_toml_list(modules)})"
        )
    for key, old, new in mismatched:
        hint = ""
        if len(old) == len(new) and old[1:] == new[1:] and old[0] < new[0]:
            name = EMBEDDINGS if key in tables else key.rsplit(".", 1)[0]
            hint = f' (rows grew: keep the old ones with checkpoint.grow=["{name}"])'
        lines.append(f"  shape differs: {key}: checkpoint {old}, model {new}{hint}")
    if unexpected:
        lines.append(f"  in the checkpoint but not the model: {', '.join(unexpected)}")
    lines.append("  (checkpoint.strict=false loads what matches and keeps the rest fresh)")
    return "\n".join(lines)


def _toml_list(items: list[str]) -> str:
    return "[" + ",".join(f'"{item}"' for item in items) + "]"
