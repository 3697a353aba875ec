"""``recsys preprocess``: raw click logs or tables -> parquet row groups + metadata, via NVTabular.

Three stages, each streaming in pieces of about ``chunk_mb`` MB so memory stays bounded:

1. **Stage**: read the input (Criteo TSV, parquet or CSV), drop malformed rows (counted and
   reported with file and line / row number, or fatal in strict mode), carve seeded valid /
   test splits out of the input when none are given, and write each split as plain parquet.
2. **Fit** an NVTabular workflow on the train split only: categorical and multi-hot columns
   -> ``Categorify`` (contiguous ids; 0 padding, 1 missing, 2 rare or unseen, frequent values
   from 3) or ``HashBucket``; dense columns -> fill missing with 0, log(1 + max(x, 0)),
   optionally ``Normalize``.
3. **Transform** every split and write ``<output>/<split>/part_*.parquet`` with row groups of
   ``row_group_rows`` (the unit training reads and shards across ranks), then
   ``metadata.json`` (column roles, cardinalities, row counts) that ``ParquetDataset`` and the
   trainer read, so table sizes are never typed by hand.

The output directory appears only when everything succeeded: work happens in
``<output>.partial`` and is renamed at the end.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from recsys._suggest import quoted_with_hints
from recsys.config import PreprocessConfig
from recsys.data import criteo
from recsys.data.criteo import MalformedLines

METADATA = "metadata.json"
SPLITS = ("train", "valid", "test")
FORMAT_VERSION = 1


@dataclass
class Roles:
    """Which input column plays which part."""

    categorical: list[str]
    multi_hot: list[str]
    dense: list[str]
    labels: list[str]

    @property
    def sparse(self) -> list[str]:
        return self.categorical + self.multi_hot

    @property
    def all(self) -> list[str]:
        return self.labels + self.dense + self.sparse


@dataclass
class PreprocessReport:
    """What ``preprocess`` wrote."""

    output: Path
    rows: dict[str, int]
    malformed: MalformedLines
    metadata: dict[str, Any] = field(repr=False)
    seconds: float = 0.0


def preprocess(config: PreprocessConfig) -> PreprocessReport:
    """Run the three stages (see module docstring) and return a report.

    Raises:
        ValueError: bad options, a missing column, an empty split, or (strict mode) a
            malformed line.
        FileNotFoundError: an input does not exist.
    """
    start = time.perf_counter()
    roles = _roles(config)
    output = Path(config.output)
    if not config.output:
        raise ValueError("preprocess.output is empty; give the directory to write (--output DIR)")
    if output.exists() and not config.overwrite:
        raise ValueError(f"output '{output}' already exists; pass --preprocess.overwrite=true")
    sources = {"train": _files(config.input, "input")}
    for split in ("valid", "test"):
        if getattr(config, split):
            sources[split] = _files(getattr(config, split), split)
    carve = [s for s in ("valid", "test") if s not in sources]
    if carve and config.valid_fraction + config.test_fraction >= 1:
        raise ValueError(
            f"valid_fraction {config.valid_fraction} + test_fraction {config.test_fraction} "
            "must be below 1"
        )
    work = output.with_name(output.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    try:
        rows, metadata, malformed = _run(config, roles, sources, carve, work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # never leave a half-written dataset behind
        raise
    if output.exists():
        shutil.rmtree(output)
    work.rename(output)
    return PreprocessReport(output, rows, malformed, metadata, time.perf_counter() - start)


def _run(
    config: PreprocessConfig,
    roles: Roles,
    sources: dict[str, list[Path]],
    carve: list[str],
    work: Path,
) -> tuple[dict[str, int], dict[str, Any], MalformedLines]:
    staging = work / "_staging"
    malformed = MalformedLines()
    staged = _stage(config, roles, sources, carve, staging, malformed)
    for split in SPLITS:
        if staged[split] == 0:
            hint = (
                f"--{split} FILE or a larger preprocess.{split}_fraction"
                if split != "train"
                else "more input"
            )
            raise ValueError(f"split '{split}' has no rows after staging; give {hint}")
    workflow = _build_workflow(config, roles, work)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # merlin warns about absent GPU / tensorflow packages
        workflow.fit(_nvt_dataset(staging / "train", config))
        rows = {s: _transform(workflow, staging / s, work / s, roles, config) for s in SPLITS}
        workflow.save(str(work / "workflow"))
    shutil.rmtree(staging)
    metadata = {
        "format_version": FORMAT_VERSION,
        "labels": roles.labels,
        "dense": roles.dense,
        "categorical": [
            {
                "name": name,
                "cardinality": _cardinality(workflow, name, config),
                "multi_hot": name in roles.multi_hot,
            }
            for name in roles.sparse
        ],
        "splits": {
            s: {"rows": rows[s], "files": sorted(p.name for p in (work / s).glob("*.parquet"))}
            for s in SPLITS
        },
        "malformed_rows": malformed.count,
        "preprocess": dataclasses.asdict(config),
    }
    (work / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
    return rows, metadata, malformed


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata.json of a preprocessed directory, with a clear error when it is not one."""
    file = Path(path) / METADATA
    if not file.is_file():
        raise FileNotFoundError(
            f"'{path}' is not a preprocessed dataset (no {METADATA}); create one with "
            "`recsys preprocess`"
        )
    metadata = json.loads(file.read_text())
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"'{file}' has format_version {metadata.get('format_version')}; this recsys reads "
            f"{FORMAT_VERSION}: preprocess the data again"
        )
    return metadata


# ---------------------------------------------------------------------------------------------
# Stage 1: read, validate, split


def _roles(config: PreprocessConfig) -> Roles:
    if config.format == "criteo":
        given = config.categorical + config.multi_hot + config.dense + config.label
        if given:
            raise ValueError(
                "column roles (--categorical/--multi-hot/--dense/--label) are fixed for the "
                f"criteo format; got {given}"
            )
        return Roles(list(criteo.CAT_COLUMNS), [], list(criteo.INT_COLUMNS), [criteo.LABEL])
    roles = Roles(
        list(config.categorical), list(config.multi_hot), list(config.dense), list(config.label)
    )
    if not roles.labels:
        raise ValueError(f"format {config.format!r} needs --label (the 0/1 label column(s))")
    if not roles.sparse:
        raise ValueError(f"format {config.format!r} needs --categorical or --multi-hot columns")
    seen: set[str] = set()
    for name in roles.all:
        if name in seen:
            raise ValueError(f"column '{name}' is given more than one role")
        seen.add(name)
    return roles


def _files(spec: str, what: str) -> list[Path]:
    if not spec:
        raise ValueError(f"preprocess.{what} is empty; give the file(s) to read (--{what} PATH)")
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    elif any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec))
    else:
        files = [path]
    missing = [str(p) for p in files if not p.is_file()]
    if missing or not files:
        raise FileNotFoundError(f"{what}: no such file(s): {', '.join(missing) or spec}")
    return files


def _stage(
    config: PreprocessConfig,
    roles: Roles,
    sources: dict[str, list[Path]],
    carve: list[str],
    staging: Path,
    malformed: MalformedLines,
) -> dict[str, int]:
    rows = dict.fromkeys(SPLITS, 0)
    parts = dict.fromkeys(SPLITS, 0)
    for split in SPLITS:
        (staging / split).mkdir(parents=True, exist_ok=True)
    first_row = 0  # index of the piece's first row among all input rows read so far
    for source_split, files in sources.items():
        for path in files:
            for table in _read(config, roles, path, malformed):
                routed = {source_split: table}
                if source_split == "train" and carve:
                    routed = _carve(table, carve, config, first_row)
                first_row += table.num_rows
                for split, part in routed.items():
                    if part.num_rows:
                        pq.write_table(part, staging / split / f"part_{parts[split]:05d}.parquet")
                        parts[split] += 1
                        rows[split] += part.num_rows
    return rows


def _carve(table: pa.Table, carve: list[str], config: PreprocessConfig, first_row: int) -> dict:
    """Route each row to train or a carved split by a uniform draw keyed on (seed, row index),
    so the split does not depend on how the input was cut into pieces."""
    draw = _uniform(config.seed, np.arange(first_row, first_row + table.num_rows, dtype=np.uint64))
    split_of = np.zeros(table.num_rows, dtype=np.int8)  # 0 train
    edge = 0.0
    for index, split in enumerate(carve, start=1):
        fraction = getattr(config, f"{split}_fraction")
        split_of[(draw >= edge) & (draw < edge + fraction)] = index
        edge += fraction
    routed = {"train": table.filter(pa.array(split_of == 0))}
    for index, split in enumerate(carve, start=1):
        routed[split] = table.filter(pa.array(split_of == index))
    return routed


def _uniform(seed: int, index: np.ndarray) -> np.ndarray:
    """Counter-based uniform [0, 1) numbers: splitmix64 of (seed, index)."""
    with np.errstate(over="ignore"):
        z = index * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _read(
    config: PreprocessConfig, roles: Roles, path: Path, malformed: MalformedLines
) -> Iterator[pa.Table]:
    chunk_bytes = config.chunk_mb << 20
    if config.format == "criteo":
        yield from criteo.read_criteo(path, chunk_bytes, config.strict, malformed)
        return
    first_row = 1
    for table in _read_table_pieces(config, roles, path, chunk_bytes):
        yield _check_table(table, roles, path, first_row, config.strict, malformed)
        first_row += table.num_rows


def _read_table_pieces(
    config: PreprocessConfig, roles: Roles, path: Path, chunk_bytes: int
) -> Iterator[pa.Table]:
    if config.format == "parquet":
        try:
            file = pq.ParquetFile(path)
        except pa.ArrowInvalid as error:
            raise ValueError(f"'{path}' is not a readable parquet file: {error}") from None
        _require_columns(file.schema_arrow.names, roles, path)
        num_rows = max(file.metadata.num_rows, 1)
        size = sum(file.metadata.row_group(i).total_byte_size for i in range(file.num_row_groups))
        rows_per_piece = max(1024, chunk_bytes * num_rows // max(size, 1))
        for batch in file.iter_batches(batch_size=rows_per_piece, columns=roles.all):
            yield pa.Table.from_batches([batch])
        return
    try:
        reader = pcsv.open_csv(
            str(path),
            read_options=pcsv.ReadOptions(block_size=chunk_bytes),
            convert_options=pcsv.ConvertOptions(
                column_types={c: pa.string() for c in roles.sparse}
            ),
        )
    except pa.ArrowInvalid as error:
        raise ValueError(f"'{path}' is not a readable CSV file: {error}") from None
    _require_columns(reader.schema.names, roles, path)
    for batch in reader:
        table = pa.Table.from_batches([batch]).select(roles.all)
        for name in roles.multi_hot:  # a CSV bag is "a|b|c"
            values = table.column(name)
            bags = pc.split_pattern(pc.fill_null(values, ""), "|")
            bags = pc.if_else(
                pc.equal(pc.fill_null(values, ""), ""), pa.scalar([], bags.type), bags
            )
            table = table.set_column(table.schema.get_field_index(name), name, bags)
        yield table


def _require_columns(names: list[str], roles: Roles, path: Path) -> None:
    missing = [c for c in roles.all if c not in names]
    if missing:
        hints = quoted_with_hints(missing, names)
        raise ValueError(f"'{path}' has no column(s) {hints}; its columns: {names}")


def _check_table(
    table: pa.Table,
    roles: Roles,
    path: Path,
    first_row: int,
    strict: bool,
    malformed: MalformedLines,
) -> pa.Table:
    """Labels must be 0/1 and dense values finite (null means missing and is allowed)."""
    checks = []  # (role, column, values, malformed mask, what is wrong)
    columns = {}
    for name in roles.labels:
        values = pc.cast(table.column(name), pa.float32()).to_numpy(zero_copy_only=False)
        checks.append(("label", name, values, ~np.isin(values, [0.0, 1.0]), "is not 0 or 1"))
        columns[name] = pa.array(np.nan_to_num(values), pa.float32())
    for name in roles.dense:
        column = pc.cast(table.column(name), pa.float32())
        values = column.to_numpy(zero_copy_only=False)  # null -> nan here
        missing = column.is_null().to_numpy(zero_copy_only=False)
        checks.append(("dense", name, values, ~np.isfinite(values) & ~missing, "is not finite"))
        columns[name] = column
    for name in roles.sparse:
        columns[name] = table.column(name)
    bad = np.zeros(table.num_rows, dtype=bool)
    problems = []
    for role, name, values, wrong, what in checks:
        for row in np.flatnonzero(wrong & ~bad):  # report the first bad field of a row
            line = first_row + int(row)
            problems.append((line, name, f"row {line}: {role} {name} {values[row]!r} {what}"))
        bad |= wrong
    for line, kind, detail in sorted(problems):
        if strict:
            raise ValueError(f"{path}: {detail}")
        malformed.add(path, line, kind, detail)
    return pa.table(columns).filter(pa.array(~bad))


# ---------------------------------------------------------------------------------------------
# Stages 2 and 3: NVTabular fit and transform


def _nvt_dataset(directory: Path, config: PreprocessConfig):
    from merlin.io import Dataset

    files = sorted(str(p) for p in directory.glob("*.parquet"))
    return Dataset(files, engine="parquet", part_size=f"{config.chunk_mb}MB", cpu=True)


def _build_workflow(config: PreprocessConfig, roles: Roles, work: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import nvtabular as nvt
        from nvtabular import ops

    if config.encoding == "categorify":
        encode = ops.Categorify(freq_threshold=config.freq_threshold, out_path=str(work))
    else:
        if config.hash_buckets < 1:
            raise ValueError(f"preprocess.hash_buckets = {config.hash_buckets}; expected >= 1")
        encode = ops.HashBucket(num_buckets=config.hash_buckets)
    graph = roles.sparse >> encode
    if roles.dense:
        dense = roles.dense >> ops.FillMissing(fill_val=0.0)
        if config.log_dense:
            dense = dense >> ops.Clip(min_value=0) >> ops.LogOp()
        if config.normalize_dense:
            dense = dense >> ops.Normalize()
        graph = graph + dense
    return nvt.Workflow(graph + roles.labels)


def _transform(workflow, source: Path, target: Path, roles: Roles, config: PreprocessConfig) -> int:
    target.mkdir(parents=True)
    types = {name: pa.float32() for name in roles.labels + roles.dense}
    types.update({name: pa.int64() for name in roles.categorical})
    types.update({name: pa.list_(pa.int64()) for name in roles.multi_hot})
    schema = pa.schema([(name, types[name]) for name in roles.all])
    rows = 0
    for index, frame in enumerate(workflow.transform(_nvt_dataset(source, config)).to_iter()):
        table = pa.Table.from_pandas(frame[roles.all], preserve_index=False).cast(schema)
        pq.write_table(
            table, target / f"part_{index:05d}.parquet", row_group_size=config.row_group_rows
        )
        rows += table.num_rows
    return rows


def _cardinality(workflow, name: str, config: PreprocessConfig) -> int:
    if config.encoding == "hash":
        return config.hash_buckets
    return int(workflow.output_schema[name].int_domain.max) + 1
