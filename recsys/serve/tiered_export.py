"""Exporting a model whose tables live in host memory or on disk (``[model.storage]``): the
exported program takes those tables' pooled vectors as an input instead of holding their rows.

A table larger than memory cannot sit inside a ``.pt2`` program. ``recsys export`` of such a
checkpoint therefore writes a program with a fourth input::

    dense    f32[B, N_dense]    as for every export
    values   int64[L]           every feature's ids, key-major (the tiered features' too)
    lengths  int64[F * B]
    tiered   f32[B, W]          the pooled vectors of the features read from tiered tables,
                                side by side in the order of ``tiered.json``'s ``columns``
    ->       f32[B, T]

and an extra file ``tiered.json`` naming, per tiered table, where its rows are (``rows``: the
directory ``<export>.tables/`` beside the export, holding hard links to, or copies of, the
checkpoint's ``tiered.<table>.*`` files, so that ``checkpoint.keep`` rotating the checkpoint
away leaves the export whole; exports before this kept only ``checkpoint``), dim, pooling,
features, and what an absent row is (a fixed table's lazy initial row: seed and bound; a
dynamic table's: the zero row). :func:`recsys.serve.export.load_program` puts
:class:`~recsys.serve.cached_tables.CachedTables` in front of such a program, so ``recsys
predict`` and ``recsys serve`` call it with the usual three inputs and the tiered rows are
looked up through a bounded cache outside the program.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import KeyedJaggedTensor, KeyedTensor

from recsys.embedding.row_init import table_seed
from recsys.embedding.tables import output_keys, table_dtype
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection

__all__ = [
    "TIERED_FILE",
    "OutsideTables",
    "TieredInference",
    "keep_tiered_rows",
    "outside_tables",
    "rows_beside",
    "tiered_export",
    "tiered_info",
]

TIERED_FILE = "tiered.json"
"""The extra file of an export whose tiered tables are looked up outside its program."""


class _Holder:
    """The ``tiered`` input of the program while it runs (not a module attribute: export
    would see a tensor attribute assigned in forward)."""

    pooled: torch.Tensor | None = None


class OutsideTables(nn.Module):
    """Stands in for a :class:`TieredEmbeddingBagCollection` while a model is exported: its
    in-memory tables pool as usual, its tiered tables' features take their pooled vectors from
    columns of the program's ``tiered`` input.

    Args:
        collection: the collection replaced (its in-memory tables' weights are taken over).
        holder: where the program's ``tiered`` input is put before the model runs.
        first_column: this collection's first column in ``tiered``.
    """

    def __init__(
        self, collection: TieredEmbeddingBagCollection, holder: _Holder, first_column: int
    ) -> None:
        super().__init__()
        if collection.is_weighted():
            raise ValueError(
                "a weighted embedding collection with tiered tables cannot be exported yet; "
                "expected unweighted features (or tier 'device')"
            )
        configs = collection.embedding_bag_configs()
        tiered = set(collection.tiered_tables())
        self.holder = holder
        self.keys, self.widths = output_keys(configs)
        self.features = [f for c in configs for f in c.feature_names]
        self.weights = nn.ParameterDict(
            {
                c.name: nn.Parameter(collection.embedding_bags[c.name].weight.detach().clone())
                for c in configs
                if c.name not in tiered
            }
        )
        # Per feature in output order: (table, mean pooling, tiered column slice or None).
        self.plan: list[tuple[str, bool, tuple[int, int] | None]] = []
        self.columns: list[dict[str, Any]] = []
        column = first_column
        for config in configs:
            mean = config.pooling.name == "MEAN"
            for feature in config.feature_names:
                span = None
                if config.name in tiered:
                    span = (column, column + config.embedding_dim)
                    self.columns.append(
                        {
                            "feature": feature,
                            "table": config.name,
                            "start": span[0],
                            "stop": span[1],
                        }
                    )
                    column = span[1]
                self.plan.append((config.name, mean, span))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        keys, offsets, values = features.keys(), features.offsets(), features.values()
        B = features.stride()
        # A tensor index, not k * B in Python: export would fix B to the traced value.
        num_keys = len(keys)
        bounds = offsets[torch.arange(num_keys + 1, device=offsets.device) * B].tolist()
        pooled = []
        for feature, (table, mean, span) in zip(self.features, self.plan, strict=True):
            if span is not None:
                pooled.append(self.holder.pooled[:, span[0] : span[1]])  # [B, D]
                continue
            k = keys.index(feature)
            start, stop = bounds[k], bounds[k + 1]
            bag_offsets = offsets[k * B : (k + 1) * B + 1] - start
            weight = self.weights[table]
            if weight.dtype != torch.float32:
                weight = weight.float()
            out = F.embedding_bag(
                values[start:stop],
                weight,
                bag_offsets,
                mode="mean" if mean else "sum",
                include_last_offset=True,
            )  # [B, D]
            pooled.append(out)
        return KeyedTensor(keys=self.keys, length_per_key=self.widths, values=torch.cat(pooled, 1))


class TieredInference(nn.Module):
    """An inference module (``(dense, values, lengths) -> [B, T]``) whose model's tiered
    collections were replaced by :class:`OutsideTables`: what is exported, with the fourth
    input ``tiered`` f32[B, W]."""

    def __init__(self, inference: nn.Module, holder: _Holder) -> None:
        super().__init__()
        self.inference = inference
        self.holder = holder

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, tiered: torch.Tensor
    ) -> torch.Tensor:
        self.holder.pooled = tiered
        try:
            return self.inference(dense, values, lengths)
        finally:
            self.holder.pooled = None


def outside_tables(model: nn.Module) -> tuple[_Holder, list[OutsideTables]]:
    """Replace every tiered collection of ``model`` (in place) by an :class:`OutsideTables`;
    returns the holder of the ``tiered`` input and the replacements (in column order)."""
    holder, replaced, column = _Holder(), [], 0
    for path, module in list(model.named_modules()):
        if not isinstance(module, TieredEmbeddingBagCollection) or not module.tiered_tables():
            continue
        outside = OutsideTables(module, holder, column)
        column = outside.columns[-1]["stop"] if outside.columns else column
        owner, _, attribute = path.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attribute, outside)
        replaced.append((module, outside))
    return holder, replaced


def tiered_info(
    replaced: list[tuple[TieredEmbeddingBagCollection, OutsideTables]], checkpoint: str
) -> dict[str, Any]:
    """What an export's ``tiered.json`` records (see the module docstring)."""
    tables, columns = {}, []
    for collection, outside in replaced:
        columns += outside.columns
        layouts = collection.tiered_files().layouts
        configs = {c.name: c for c in collection.embedding_bag_configs()}
        for name in collection.tiered_tables():
            config, storage = configs[name], collection.storage[name]
            block = collection.blocks[name]
            dynamic = name in collection.dynamic_options
            bound = None
            if not dynamic:
                bound = math.sqrt(1.0 / block.table_rows)
            tables[name] = {
                "dim": config.embedding_dim,
                "dtype": str(table_dtype(config)).removeprefix("torch."),
                "num_embeddings": config.num_embeddings,
                "dynamic": dynamic,
                "seed": table_seed(collection.seed, name),
                "bound": bound,
                "offset": block.offset,
                "tier": storage.tier,
                "cache_rows": collection.caches[name].num_rows,
                "policy": storage.policy,
                "features": list(config.feature_names),
                "mean": config.pooling.name == "MEAN",
                "layout": layouts[name],
            }
    width = columns[-1]["stop"] if columns else 0
    return {"checkpoint": checkpoint, "width": width, "tables": tables, "columns": columns}


def tiered_export(
    model: nn.Module, module: nn.Module, inputs: tuple, shapes: dict, checkpoint: Path
) -> tuple[nn.Module, tuple, dict, dict[str, str]]:
    """What ``recsys export`` exports for ``model`` (loaded from ``checkpoint``; ``module``
    wraps it, ``inputs`` and ``shapes`` are its example inputs and dynamic shapes): unchanged
    without tiered tables; else a :class:`TieredInference` with the ``tiered`` input added.
    Also returns the extra files to write (``tiered.json``, or none)."""
    holder, replaced = outside_tables(model)
    if not replaced:
        return module, inputs, shapes, {}
    info = tiered_info(replaced, str(Path(checkpoint).resolve()))
    batch = shapes["dense"][0]
    inputs = (*inputs, torch.zeros(inputs[0].shape[0], info["width"]))
    shapes = {**shapes, "tiered": {0: batch}}
    for collection, _ in replaced:
        collection.close()  # its rows are read from the checkpoint when the export loads
    extra = {TIERED_FILE: json.dumps(info, indent=1) + "\n"}
    return TieredInference(module, holder), inputs, shapes, extra


def keep_tiered_rows(extra: dict[str, str], checkpoint: Path, output: Path) -> None:
    """When ``extra`` (an export's extra files) holds ``tiered.json``: link the checkpoint's
    files of those tables into ``<output>.tables/`` beside the export (hard links, copies
    across filesystems; the directory appears whole, replacing one there), and point
    ``tiered.json``'s ``rows`` at it."""
    if TIERED_FILE not in extra:
        return
    info = json.loads(extra[TIERED_FILE])
    target = output.parent / f"{output.name}.tables"
    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=output.parent))
    try:
        for name in info["tables"]:
            for file in Path(checkpoint).glob(f"tiered.{name}.*"):
                try:
                    os.link(file, work / file.name)
                except OSError:  # another filesystem (or no hard links): a copy
                    shutil.copy2(file, work / file.name)
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["rows"] = target.name
    extra[TIERED_FILE] = json.dumps(info, indent=1) + "\n"


def rows_beside(info: dict[str, Any], export: str | Path) -> dict[str, Any]:
    """``tiered.json`` of the export at ``export`` with ``checkpoint`` pointing where its rows
    are: the directory beside the export (``rows``), else (older exports) the checkpoint."""
    if "rows" not in info:
        return info
    return {**info, "checkpoint": str(Path(export).resolve().parent / info["rows"])}
