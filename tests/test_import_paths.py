"""The import paths users had before ``recsys/embedding`` and ``recsys/ops`` got subpackages
keep working: a package re-exports its old module's names, or an alias module at the old path
gives the same objects as the new home."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import recsys

MOVED = {
    "recsys.embedding.dynamic": "recsys.embedding.dynamic.collection",
    "recsys.embedding.dynamic_table": "recsys.embedding.dynamic.table",
    "recsys.embedding.tiered": "recsys.embedding.tiered.collection",
    "recsys.embedding.row_store": "recsys.embedding.tiered.row_store",
    "recsys.embedding.row_cache": "recsys.embedding.tiered.row_cache",
    "recsys.ops.embedding_bag": "recsys.ops.embedding_bag.pooled",
    "recsys.ops.slot_map": "recsys.ops.slot_map.hash_map",
    "recsys.ops.dot_interaction": "recsys.ops.interaction.dot",
    "recsys.ops.cross_interaction": "recsys.ops.interaction.cross",
    "recsys.ops.fused_mlp": "recsys.ops.mlp.fused_linear",
    "recsys.ops.jagged_attention": "recsys.ops.jagged.attention",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_homes_objects(old):
    alias, home = importlib.import_module(old), importlib.import_module(MOVED[old])
    names = [n for n in alias.__all__ if hasattr(home, n)]
    assert names, f"{old} re-exports nothing of {MOVED[old]}"
    for name in names:
        assert getattr(alias, name) is getattr(home, name), f"{old}.{name}"


def test_the_documented_names_import():
    from recsys.embedding.dynamic import DynamicEmbeddingBagCollection
    from recsys.embedding.dynamic_table import DynamicTableOptions
    from recsys.embedding.tiered import StorageOptions, TieredEmbeddingBagCollection
    from recsys.ops.embedding_bag import table_batched_embedding_bag
    from recsys.ops.jagged_attention import jagged_attention

    assert DynamicEmbeddingBagCollection.__module__ == "recsys.embedding.dynamic.collection"
    assert DynamicTableOptions.__module__ == "recsys.embedding.dynamic.table"
    assert TieredEmbeddingBagCollection.__module__ == "recsys.embedding.tiered.collection"
    assert StorageOptions.__module__ == "recsys.embedding.tiered.options"
    assert callable(table_batched_embedding_bag) and callable(jagged_attention)
    for name in recsys.__all__:
        assert getattr(recsys, name) is not None


def test_the_c_source_sits_beside_its_module():
    from recsys.ops.slot_map import key_arena_cpu

    assert (Path(key_arena_cpu.__file__).with_name("key_arena_cpu.c")).is_file()
