"""ParquetDataset: the output of ``recsys preprocess`` as chunks (parquet row groups).

Each split is the list of row groups of its files, in file order; chunk i is row group i. The
loader shards chunks across ranks and cuts them into batches, so a row group is read by exactly
one rank per epoch. Columns become a :class:`~recsys.data.batch.Batch` with whole-column numpy /
pyarrow operations (no Python loop per row): dense columns are stacked, one-hot categorical
columns are the KJT values as they are, and a multi-hot list column contributes its flattened
values with the list lengths as bag lengths.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec import KeyedJaggedTensor

from recsys.data.batch import Batch, DatasetSpec
from recsys.data.etl import SPLITS, read_metadata


class ParquetDataset:
    """A directory written by ``recsys preprocess``.

    Args:
        path: the directory (holds metadata.json and train/, valid/, test/).
        validate: check every chunk: labels in {0, 1}, finite dense values, ids inside their
            tables (catches data preprocessed with another schema; raw keys, any int64, are
            not range-checked).

    Example::

        data = ParquetDataset("data/criteo_kaggle")
        data.spec.cardinalities    # from metadata.json
        batch = data.chunk("train", 0)
    """

    def __init__(self, path: str | Path, validate: bool = True) -> None:
        self.path = Path(path)
        self.metadata = read_metadata(self.path)
        self.validate = validate
        categorical = self.metadata["categorical"]
        self.spec = DatasetSpec(
            dense_names=tuple(self.metadata["dense"]),
            sparse_names=tuple(c["name"] for c in categorical),
            cardinalities=tuple(int(c["cardinality"]) for c in categorical),
            label_names=tuple(self.metadata["labels"]),
            fingerprint=self.metadata["fingerprint"],
            id_encoding=self.metadata["id_encoding"],
        )
        self._multi_hot = {c["name"] for c in categorical if c["multi_hot"]}
        # The most ids one sample has per feature, where known (a multi-hot bag has no bound).
        self.max_ids_per_sample = {
            name: 1 for name in self.spec.sparse_names if name not in self._multi_hot
        }
        self._files: dict[Path, pq.ParquetFile] = {}
        self._chunks: dict[str, list[tuple[Path, int, int]]] = {}
        for split in SPLITS:
            chunks = []
            for name in self.metadata["splits"][split]["files"]:
                file = self.path / split / name
                if not file.is_file():
                    raise FileNotFoundError(f"'{file}' listed in metadata.json is missing")
                meta = self._file(file).metadata
                chunks += [
                    (file, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
                ]
            self._chunks[split] = chunks

    def num_samples(self, split: str) -> int:
        return sum(rows for _, _, rows in self._split(split))

    def num_chunks(self, split: str) -> int:
        return len(self._split(split))

    def chunk_rows(self, split: str, index: int) -> int:
        return self._split(split)[index][2]

    def chunk(self, split: str, index: int) -> Batch:
        file, group, _ = self._split(split)[index]
        table = self._file(file).read_row_group(group)
        return table_to_batch(
            table, self.spec, self._multi_hot, f"{file} row group {group}", self.validate
        )

    def _split(self, split: str) -> list[tuple[Path, int, int]]:
        if split not in self._chunks:
            raise ValueError(f"unknown split '{split}'; expected one of {', '.join(SPLITS)}")
        return self._chunks[split]

    def _file(self, file: Path) -> pq.ParquetFile:
        if file not in self._files:
            self._files[file] = pq.ParquetFile(file)
        return self._files[file]


def table_to_batch(
    table: pa.Table,
    spec: DatasetSpec,
    multi_hot: set[str],
    where: str = "table",
    validate: bool = True,
) -> Batch:
    """Columns of ``table`` named by ``spec`` -> Batch (dense [B, N_dense], KJT, labels [B, T]).

    With ``validate``, ids must lie in [0, cardinality) unless ``spec.id_encoding`` is "raw"
    (any int64 key is valid: they pass unchanged).
    """
    check_range = validate and spec.id_encoding == "index"
    num_rows = table.num_rows
    dense = np.empty((num_rows, spec.num_dense), dtype=np.float32)
    for j, name in enumerate(spec.dense_names):
        dense[:, j] = _numpy(table, name, where)
    labels = np.empty((num_rows, spec.num_tasks), dtype=np.float32)
    for j, name in enumerate(spec.label_names):
        labels[:, j] = _numpy(table, name, where)
    values, lengths = [], []
    for name, cardinality in zip(spec.sparse_names, spec.cardinalities, strict=True):
        column = table.column(name)
        if name in multi_hot:
            bag_lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy()
            ids = pc.list_flatten(column).to_numpy(zero_copy_only=False)
        else:
            bag_lengths = np.ones(num_rows, dtype=np.int32)
            ids = column.to_numpy(zero_copy_only=False)
        ids = ids.astype(np.int64, copy=False)
        if check_range and ids.size and (ids.min() < 0 or ids.max() >= cardinality):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(
                f"{where}: {name} id {bad} is outside its table of {cardinality} rows "
                "(preprocessed with another schema? run `recsys preprocess` again)"
            )
        values.append(ids)
        lengths.append(bag_lengths.astype(np.int32, copy=False))
    if validate:
        if not np.isin(labels, (0.0, 1.0)).all():
            row, task = np.argwhere(~np.isin(labels, (0.0, 1.0)))[0]
            raise ValueError(
                f"{where}: label {spec.label_names[task]} of row {row} is {labels[row, task]!r}; "
                "labels must be 0 or 1"
            )
        if not np.isfinite(dense).all():
            row, col = np.argwhere(~np.isfinite(dense))[0]
            raise ValueError(
                f"{where}: dense {spec.dense_names[col]} of row {row} is {dense[row, col]!r}; "
                "dense features must be finite"
            )
    return Batch(
        dense=torch.from_numpy(dense),
        sparse=KeyedJaggedTensor(
            keys=list(spec.sparse_names),
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        ),
        labels=torch.from_numpy(labels),
    )


def _numpy(table: pa.Table, name: str, where: str) -> np.ndarray:
    column = table.column(name)
    if column.null_count:
        raise ValueError(f"{where}: column {name} has {column.null_count} missing values")
    return column.to_numpy()
