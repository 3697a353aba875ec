"""Exporting pooled tables as one lookup: the exported program pools every feature of a
collection with one ``F.embedding_bag`` over the collection's packed buffer.

An eager :class:`~recsys.embedding.collection.EmbeddingBagCollection` looks its tables up
table by table on CPU, reading each feature's slice bounds from the data. Traced by
``torch.export``, that is about twenty graph nodes per feature (slices, data reads and their
asserts, the lookup) that the program runs one by one: with 26 features most of a one-row
call's fixed cost (the score phase of ``benchmarks/results/serving.csv``'s rows of 92175c1
against 0809b90). A
:class:`PackedLookup` stands in for the collection while it is exported: the packed buffer is
one parameter (``packed``, [rows of all tables, D], the collection's storage, not a copy) and
the program looks every bag up at once (:func:`~recsys.ops.embedding_bag.cpu.pool_packed`),
with the same sums in the same order, so its scores equal the eager model's bit for bit.

A collection is packed when its tables share one dim, one pooling and fp32, and the program's
keys are its features in order (the default recipes' case); any other collection is exported
as it is. A dynamic table's rows in ``dynamic.json`` then name ``packed`` and the table's first
row and row count in it (:mod:`recsys.serve.exported_deltas`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchrec import KeyedJaggedTensor, KeyedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.inputs import input_weights
from recsys.embedding.tables import output_keys, pooling_mode, table_dtype
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.ops.embedding_bag.cpu import pool_packed

__all__ = ["PACKED", "PackedLookup", "pack_for_export", "packable"]

PACKED = "packed"
"""The parameter of a :class:`PackedLookup`: its collection's tables in one matrix."""


class PackedLookup(nn.Module):
    """Stands in for an :class:`EmbeddingBagCollection` while a model is exported (see the
    module docstring); forward takes and returns what the collection's does.

    Args:
        collection: the collection replaced: tables of one dim, one pooling, fp32, not
            tiered (:func:`packable`). Its lookup of ids to rows (a dynamic table's frozen
            map) is still called; its tables are this module's :data:`PACKED` parameter.
    """

    def __init__(self, collection: EmbeddingBagCollection) -> None:
        super().__init__()
        configs = collection.embedding_bag_configs()
        layout = collection.layout
        self.packed = nn.Parameter(collection.packed_weight().detach(), requires_grad=False)
        # Called for its lookup of ids to rows, not a submodule: its tables are `packed` now.
        object.__setattr__(self, "collection", collection)
        self.weighted = collection.is_weighted()
        self.mean = pooling_mode(configs[0]) == "mean"
        self.keys, self.widths = output_keys(configs)
        self.features = [f for c in configs for f in c.feature_names]
        tables = [t for t, c in enumerate(configs) for _ in c.feature_names]
        self.register_buffer("key_rows", torch.tensor([layout.rows[t] for t in tables]))
        self.register_buffer("key_base", torch.tensor([layout.row_offsets[t] for t in tables]))
        # table -> (first row in `packed`, rows): where deltas find a dynamic table's rows
        self.table_rows = {
            c.name: (layout.row_offsets[t], layout.rows[t]) for t, c in enumerate(configs)
        }

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if list(features.keys()) != self.features:
            raise ValueError(
                f"keys {features.keys()}; this packed lookup was built for {self.features}"
            )
        pooled = pool_packed(
            self.packed,
            self.collection.lookup_ids(features),
            features.lengths(),
            features.offsets(),
            input_weights(features, self.weighted),
            self.key_rows,
            self.key_base,
            self.mean,
            features.stride(),
        )
        return KeyedTensor(keys=self.keys, length_per_key=self.widths, values=pooled)


def packable(collection: nn.Module, keys: Sequence[str]) -> bool:
    """Whether ``collection`` exports as a :class:`PackedLookup` when the program's KJT has
    ``keys``: an in-memory collection of fp32 tables of one dim and one pooling whose
    features are ``keys`` in order."""
    if not isinstance(collection, EmbeddingBagCollection) or isinstance(
        collection, TieredEmbeddingBagCollection
    ):
        return False
    configs = collection.embedding_bag_configs()
    return (
        bool(configs)
        and len({c.embedding_dim for c in configs}) == 1
        and len({pooling_mode(c) for c in configs}) == 1
        and table_dtype(configs[0]) == torch.float32  # one dtype for a collection's tables
        and [f for c in configs for f in c.feature_names] == list(keys)
    )


def pack_for_export(model: nn.Module, keys: Sequence[str]) -> dict[str, PackedLookup]:
    """Replace (in place) every collection of ``model`` that :func:`packable` allows by a
    :class:`PackedLookup`; the replacements by module path."""
    packed = {}
    for path, module in list(model.named_modules()):
        if not packable(module, keys):
            continue
        lookup = PackedLookup(module)
        owner, _, attribute = path.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attribute, lookup)
        packed[path] = lookup
    return packed
