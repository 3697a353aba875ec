"""``recsys preprocess --preprocess.encoding=raw``: raw 64-bit keys in one streaming pass.

Nothing is fitted, so nothing goes through NVTabular: each piece the reader yields (cleaned and
carved into splits by ``recsys.data.etl``) is transformed on the spot and appended to its
split's parquet files, in input order:

- categorical values -> their raw key (``recsys.data.keys.value_keys``: a stable hash of the
  value's text in [1, 2^63); missing -> 0); a multi-hot bag keeps its length, each item hashed;
- dense values: missing -> 0, then sign(x) log(1 + |x|) when ``log_dense`` (no
  ``normalize_dense``: that would need a fitting pass over the train split);
- labels as float32.

Row groups hold exactly ``row_group_rows`` rows (the last one of a split fewer), files at most
``_ROW_GROUPS_PER_FILE`` row groups. The metadata says ``"id_encoding": "raw"`` with cardinality
0 for every feature (no vocabulary, any int64 is a valid id) and an estimate of the number of
distinct keys of each feature in the train split (HyperLogLog, about 1.6% error), a hint for
sizing dynamic tables. The fingerprint is a sha256 of the options and the key scheme: two raw
datasets with the same column roles and options share it (their keys mean the same values).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recsys.config import PreprocessConfig
from recsys.data.keys import KEY_SCHEME, MISSING_KEY, splitmix64, value_keys
from recsys.data.prepared import FINGERPRINT_KEY, FORMAT_VERSION, SPLITS, dense_transform
from recsys.data.readers import Roles, signed_log1p

_ROW_GROUPS_PER_FILE = 64
_HLL_BITS = 12  # 4096 registers per feature: standard error 1.04 / sqrt(4096) = 1.6%


def raw_fingerprint(config: PreprocessConfig, roles: Roles) -> str:
    """sha256 over what decides a raw dataset's keys and dense values."""
    options = {
        "encoding": "raw",
        "key_scheme": KEY_SCHEME,
        "roles": {"categorical": roles.categorical, "multi_hot": roles.multi_hot},
        "dense": roles.dense,
        "dense_transform": dense_transform(config.log_dense, False),
    }
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()


def encode_raw(table: pa.Table, roles: Roles, log_dense: bool) -> pa.Table:
    """A cleaned input piece -> output columns (``roles.all``): keys, transformed dense, labels.

    Args:
        table: labels, dense values (null: missing), categorical values and multi-hot lists
            without null items (as ``recsys.data.etl`` cleans them).
        roles: the columns.
        log_dense: apply sign(x) log(1 + |x|) to dense values.

    Returns:
        labels and dense float32, categorical int64, multi-hot list<int64>, in ``roles.all``
        order.
    """
    columns: dict[str, pa.Array] = {}
    for name in roles.labels:
        columns[name] = pc.cast(table.column(name), pa.float32())
    for name in roles.dense:
        values = pc.fill_null(pc.cast(table.column(name), pa.float64()), 0.0).to_numpy()
        if log_dense:
            values = signed_log1p(values)
        columns[name] = pa.array(values.astype(np.float32))
    for name in roles.categorical:
        columns[name] = pa.array(value_keys(table.column(name)))
    for name in roles.multi_hot:
        bags = table.column(name).combine_chunks()
        lengths = pc.fill_null(pc.list_value_length(bags), 0).to_numpy(zero_copy_only=False)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
        keys = pa.array(value_keys(pc.list_flatten(bags)))
        columns[name] = pa.ListArray.from_arrays(pa.array(offsets), keys)
    return pa.table({name: columns[name] for name in roles.all})


class RawWriter:
    """Appends transformed pieces to ``<work>/<split>/part_*.parquet``, row groups of exactly
    ``config.row_group_rows`` rows, and estimates each feature's distinct train keys.

    Args:
        work: the output directory being written (split directories are created here).
        roles: the columns.
        config: the preprocess options (``log_dense``, ``row_group_rows``).
        fingerprint: written into every file's schema metadata.
        types: column types other than those :func:`encode_raw` gives (for pieces encoded
            elsewhere and handed to :meth:`append`).

    Example::

        writer = RawWriter(work, roles, config, fingerprint)
        writer.write("train", piece)        # any number of times, any split
        rows = writer.close()               # {"train": ..., "valid": ..., "test": ...}
    """

    def __init__(
        self,
        work: Path,
        roles: Roles,
        config: PreprocessConfig,
        fingerprint: str,
        types: dict[str, pa.DataType] | None = None,
    ) -> None:
        self.work = work
        self.roles = roles
        self.config = config
        self.rows = dict.fromkeys(SPLITS, 0)
        kinds = {name: pa.float32() for name in roles.labels + roles.dense}
        kinds.update({name: pa.int64() for name in roles.categorical})
        kinds.update({name: pa.list_(pa.int64()) for name in roles.multi_hot})
        kinds.update(types or {})
        schema = pa.schema([(name, kinds[name]) for name in roles.all])
        self.schema = schema.with_metadata({FINGERPRINT_KEY: fingerprint.encode()})
        self._pending: dict[str, list[pa.Table]] = {s: [] for s in SPLITS}
        self._pending_rows = dict.fromkeys(SPLITS, 0)
        self._writers: dict[str, pq.ParquetWriter | None] = dict.fromkeys(SPLITS)
        self._files = dict.fromkeys(SPLITS, 0)
        self._groups = dict.fromkeys(SPLITS, 0)
        self._registers = {name: np.zeros(1 << _HLL_BITS, np.uint8) for name in roles.sparse}
        for split in SPLITS:
            (work / split).mkdir(parents=True, exist_ok=True)

    def write(self, split: str, table: pa.Table) -> None:
        """Transform a cleaned piece and append it to ``split``."""
        encoded = encode_raw(table, self.roles, self.config.log_dense)  # cast in append
        if split == "train":
            for name in self.roles.sparse:
                column = encoded.column(name)
                if name in self.roles.multi_hot:
                    column = pc.list_flatten(column)
                _hll_add(self._registers[name], column.to_numpy())
        self.append(split, encoded)

    def append(self, split: str, encoded: pa.Table) -> None:
        """Append a piece already in the output's columns and types to ``split``."""
        encoded = encoded.select(self.roles.all).cast(self.schema)
        self._pending[split].append(encoded)
        self._pending_rows[split] += encoded.num_rows
        self.rows[split] += encoded.num_rows
        group = self.config.row_group_rows
        if self._pending_rows[split] >= group:
            pending = pa.concat_tables(self._pending[split])
            whole = pending.num_rows // group * group
            for start in range(0, whole, group):
                self._write_group(split, pending.slice(start, group))
            rest = pending.slice(whole)
            self._pending[split] = [rest] if rest.num_rows else []
            self._pending_rows[split] = rest.num_rows

    def close(self) -> dict[str, int]:
        """Write what is left and close every file: the rows written per split."""
        for split in SPLITS:
            if self._pending_rows[split]:
                self._write_group(split, pa.concat_tables(self._pending[split]))
                self._pending[split], self._pending_rows[split] = [], 0
            self._close_file(split)
        return dict(self.rows)

    def abort(self) -> None:
        """Close the open files without writing what is pending (the work is being discarded)."""
        for split in SPLITS:
            self._close_file(split)

    def distinct_estimates(self) -> dict[str, int]:
        """Estimated number of distinct keys (missing values not counted) per feature, train."""
        return {name: _hll_estimate(r) for name, r in self._registers.items()}

    def _write_group(self, split: str, table: pa.Table) -> None:
        if self._writers[split] is None:
            file = self.work / split / f"part_{self._files[split]:06d}.parquet"
            self._writers[split] = pq.ParquetWriter(file, self.schema)
        self._writers[split].write_table(table, row_group_size=table.num_rows)
        self._groups[split] += 1
        if self._groups[split] == _ROW_GROUPS_PER_FILE:
            self._close_file(split)

    def _close_file(self, split: str) -> None:
        writer = self._writers[split]
        if writer is not None:
            writer.close()
            self._writers[split] = None
            self._files[split] += 1
            self._groups[split] = 0


def raw_metadata(
    roles: Roles, config: PreprocessConfig, fingerprint: str, distinct: dict[str, int] | None
) -> dict[str, Any]:
    """The keys of metadata.json that describe a raw dataset's columns (those ``fitted_metadata``
    gives for a fitted workflow): cardinality 0 per feature, ``id_encoding`` raw, and (when
    known) the estimated distinct train keys per feature."""
    categorical = []
    for name in roles.sparse:
        entry = {"name": name, "cardinality": 0, "multi_hot": name in roles.multi_hot}
        if distinct is not None:
            entry["distinct_estimate"] = distinct[name]
        categorical.append(entry)
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "id_encoding": "raw",
        "labels": roles.labels,
        "dense": roles.dense,
        "categorical": categorical,
        "dense_transform": dense_transform(config.log_dense, False),
    }


def _hll_add(registers: np.ndarray, keys: np.ndarray) -> None:
    """HyperLogLog: register = max over its keys of the rank of the first set bit."""
    keys = keys[keys != MISSING_KEY]
    if not keys.size:
        return
    h = splitmix64(keys.astype(np.uint64))
    index = (h >> np.uint64(64 - _HLL_BITS)).astype(np.intp)
    rest = (h & np.uint64((1 << (64 - _HLL_BITS)) - 1)).astype(np.float64)
    # frexp: rest = m 2^e with m in [0.5, 1), so the leading zeros of a (64 - b)-bit rest are
    # (64 - b) - e and the rank is that + 1 (rest = 0: e = 0, the largest rank).
    rank = (64 - _HLL_BITS + 1 - np.frexp(rest)[1]).astype(np.uint8)
    np.maximum.at(registers, index, rank)


def _hll_estimate(registers: np.ndarray) -> int:
    m = float(registers.size)
    estimate = 0.7213 / (1 + 1.079 / m) * m * m / np.sum(np.exp2(-registers.astype(np.float64)))
    zeros = int(np.count_nonzero(registers == 0))
    if estimate <= 2.5 * m and zeros:  # small range: linear counting
        estimate = m * np.log(m / zeros)
    return round(estimate)
