"""The item table of a sequence model's export, held in memory: a tiered item table (host or
disk, behind a cache) becomes the in-memory collection of the same rows before
``torch.export``.

The top-K program scores every item of the corpus for each history, so it reads every item's
vector anyway: a cache in front of a store would hold the whole table after the first request.
The export therefore reads the rows once from the checkpoint's store (in runs that fit the
cache) into the program:

- a fixed tiered table -> an :class:`~recsys.embedding.unpooled.EmbeddingCollection` whose row
  i is item i's row;
- a dynamic tiered table -> a :class:`~recsys.embedding.unpooled_tables.DynamicEmbeddingCollection`
  holding the keys its store and cache held and their rows (an item it never trained reads the
  zero row, as the trained model's does).

Both are frozen (no optimizer state: the program never trains), in the table's dtype, so the
program's scores are the trained model's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from recsys.embedding.dynamic.mixin import DYNAMIC
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.interface import UNPOOLED_TABLES, WEIGHT
from recsys.embedding.tables import table_dtype
from recsys.embedding.tiered.mixin import TieredTables
from recsys.embedding.unpooled import EmbeddingCollection
from recsys.embedding.unpooled_tables import DynamicEmbeddingCollection

__all__ = ["in_memory_item_table"]


def in_memory_item_table(model: nn.Module) -> bool:
    """Replace ``model.embeddings`` (a sequence model's item collection) by an in-memory copy
    when it is tiered (see the module docstring); return whether it was. The model must be in
    eval mode (lookups then read rows without training them)."""
    tiered = model.embeddings
    if not isinstance(tiered, TieredTables):
        return False
    (config,) = tiered.embedding_configs()
    name = config.name
    keys = model.item_keys()  # a dynamic table: the keys of its store and cache, ascending
    with torch.no_grad():
        rows = model.item_vectors(keys).to(table_dtype(config)).cpu()  # [N, D], read in runs
    if keys is None:
        plain = EmbeddingCollection([config], device="cpu")
        with torch.no_grad():
            plain.embeddings[name].weight.copy_(rows)
    else:
        options = tiered.dynamic_options[name]
        dynamic = DynamicTableOptions(bucket_size=options.bucket_size)
        plain = DynamicEmbeddingCollection(
            [replace(config, num_embeddings=max(1, len(keys)))],
            {name: dynamic},
            device="cpu",
            seed=tiered.seed,
        )
        keys = keys.cpu()
        buckets = max(1, -(-len(keys) // options.bucket_size))
        plain.load_table_state(
            name,
            {
                f"{UNPOOLED_TABLES}.{name}.{WEIGHT}": rows,
                f"{DYNAMIC}.{name}.keys": keys,
                f"{DYNAMIC}.{name}.scores": torch.zeros_like(keys),
                f"{DYNAMIC}.{name}.last_seen": torch.zeros_like(keys),
                f"{DYNAMIC}.{name}.num_buckets": torch.tensor([buckets]),
            },
        )
    model.embeddings = plain.requires_grad_(False).eval()
    return True
