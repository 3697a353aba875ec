"""Data: sources (synthetic, preprocessed parquet, raw Criteo TSV) behind one chunked interface,
the Batch they produce, and the BatchLoader that feeds training."""

from __future__ import annotations

from pathlib import Path

from recsys.config import DataConfig
from recsys.data.loader import ChunkedDataset


def resolve_source(config: DataConfig, sequences: bool = False) -> str:
    """``data.source`` with ``auto`` resolved from ``data.path`` (``sequences``: for a sequence
    model, whose built-in data is the synthetic interaction log)."""
    if config.source != "auto":
        return config.source
    if not config.path:
        return "synthetic_sequences" if sequences else "synthetic"
    if not Path(config.path).is_dir():
        return "criteo"
    from recsys.data.sequence_source import is_sequence_directory

    return "sequences" if is_sequence_directory(config.path) else "parquet"


def build_dataset(config: DataConfig, seed: int) -> ChunkedDataset:
    """The dataset the ``[data]`` section names (see ``data.source``)."""
    source = resolve_source(config)
    if source in ("sequences", "synthetic_sequences"):
        raise ValueError(
            f"data.source = {source!r} (data.path = '{config.path}') holds user histories, for "
            "sequence models (model.name = 'sasrec' or 'hstu'); this model trains on click logs"
        )
    path = Path(config.path) if config.path else None
    if source == "synthetic":
        if path is not None:
            raise ValueError(
                f"data.path = '{config.path}' but data.source = 'synthetic'; "
                "use data.source = 'auto' (or 'parquet' / 'criteo') to read it"
            )
        from recsys.data.synthetic import SyntheticDataset

        return SyntheticDataset(config.synthetic, seed=seed)
    if path is None:
        raise ValueError(f"data.source = '{source}' needs data.path")
    if not path.exists():
        raise FileNotFoundError(f"data.path not found: '{path}'")
    if source == "parquet":
        from recsys.data.parquet import ParquetDataset

        return ParquetDataset(path, validate=config.validate)
    from recsys.data.criteo import CriteoDataset

    c = config.criteo
    return CriteoDataset(
        path, c.hash_buckets, c.valid_fraction, c.test_fraction, seed=seed, strict=c.strict
    )
