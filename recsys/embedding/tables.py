"""TorchRec's table vocabulary in recsys terms, in one place: the pooling modes and storage
dtypes a table may use, the names the config uses for them, and the output names a collection
gives its features.

The maps here are the only translation between ``torchrec.EmbeddingBagConfig`` fields and the
strings and torch dtypes recsys' ops, config and planner speak.
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from recsys._suggest import quoted_with_hints

# Pooling of a table -> the ops' pooling mode.
POOLING_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
# Storage type of a table -> its torch dtype.
TABLE_DTYPES = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
}
# ``model.embedding_dtype`` / ``model.pooling`` names -> TorchRec's enums.
DATA_TYPE_NAMES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}
POOLING_NAMES = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def check_table_config(config: EmbeddingBagConfig) -> None:
    """Raise a ValueError naming the table when its pooling or data_type is not supported."""
    if config.pooling not in POOLING_MODES:
        raise ValueError(
            f"table '{config.name}': pooling {config.pooling} is not supported; "
            f"use {' or '.join(str(p) for p in POOLING_MODES)}"
        )
    if config.data_type not in TABLE_DTYPES:
        raise ValueError(
            f"table '{config.name}': data_type {config.data_type} is not supported; "
            f"use one of {', '.join(str(d) for d in TABLE_DTYPES)}"
        )


def table_dtype(config: EmbeddingBagConfig) -> torch.dtype:
    """The torch dtype a table is stored in."""
    return TABLE_DTYPES[config.data_type]


def pooling_mode(config: EmbeddingBagConfig) -> str:
    """``"sum"`` or ``"mean"``: how the table's bags are pooled."""
    return POOLING_MODES[config.pooling]


def element_bytes(config: EmbeddingBagConfig) -> int:
    """Bytes of one stored element of the table."""
    return table_dtype(config).itemsize


def row_bytes(config: EmbeddingBagConfig, optimizer=None) -> int:
    """Bytes of one row of the table: its weights, and a fused optimizer's float32 state (per
    row or per element, see ``FusedOptimizer.states``; None: no state)."""
    kinds = optimizer.states.values() if optimizer is not None else ()
    states = sum(1 if kind == "row" else config.embedding_dim for kind in kinds)
    return config.embedding_dim * table_dtype(config).itemsize + 4 * states


def options_by_table(tables: list[EmbeddingBagConfig], options, kind: type, what: str) -> dict:
    """Per-table options by table name: ``options`` is one ``kind`` for every table, or a dict
    table name -> ``kind`` for some of them.

    Raises:
        ValueError: a name that is no table, or a value that is not a ``kind`` (each named,
            ``what`` saying which options)."""
    names = [c.name for c in tables]
    if isinstance(options, kind):
        return dict.fromkeys(names, options)
    unknown = [name for name in options if name not in names]
    if unknown:
        raise ValueError(
            f"{what} options for {quoted_with_hints(unknown, names)}, which are not tables of "
            f"this collection; its tables are {names}"
        )
    for name, value in options.items():
        if not isinstance(value, kind):
            raise ValueError(f"{what}['{name}'] = {value!r}; expected a {kind.__name__}")
    return dict(options)


def output_keys(configs: list[EmbeddingBagConfig]) -> tuple[list[str], list[int]]:
    """(key, width) of each pooled feature, in table order: the KeyedTensor a collection of
    ``configs`` returns (TorchRec's names: the feature name, or ``<feature>@<table>`` when a
    feature is read by several tables)."""
    names = [n for per_table in get_embedding_names_by_table(configs) for n in per_table]
    widths = [c.embedding_dim for c in configs for _ in c.feature_names]
    return names, widths
