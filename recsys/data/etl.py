"""``recsys preprocess``: raw click logs or tables -> parquet row groups + metadata, via NVTabular.

Three stages, each streaming in pieces of about ``chunk_mb`` MB so memory stays bounded:

1. **Stage**: read the input (Criteo TSV, parquet or CSV; ``recsys.data.readers``), drop
   malformed rows (counted and reported with file, line / row number and column, or fatal in
   strict mode), carve seeded valid / test splits out of the input when none are given, and
   write each split as plain parquet. A null bag is an empty bag and null items inside a bag
   are dropped; both are counted, as are negative and missing dense values.
2. **Fit** an NVTabular workflow on the train split only: categorical and multi-hot columns
   -> ``Categorify`` (contiguous ids; 0 padding, 1 missing, 2 rare or unseen, frequent values
   from 3) or ``HashBucket``; dense columns -> fill missing with 0, sign(x) log(1 + |x|)
   (log(1 + x) for counts), optionally ``Normalize``. With ``apply`` the workflow fitted by an
   earlier run is loaded instead, so new data gets the same ids and table sizes.
3. **Transform** every split and write ``<output>/<split>/part_*.parquet`` with row groups of
   ``row_group_rows`` (the unit training reads and shards across ranks), then
   ``metadata.json`` (column roles, cardinalities, row counts, fingerprint) that
   ``ParquetDataset`` and the trainer read, so table sizes are never typed by hand.

With ``encoding = "raw"`` there is nothing to fit: stage 1 hashes every categorical value into
a stable 64-bit key and writes the output directly, in one pass (``recsys.data.etl_raw``).

Provenance: the fingerprint (a sha256 over the fitted categories, the normalization statistics
and the options that change ids or dense values) is in ``metadata.json`` and in the schema
metadata (key ``recsys.preprocess``) of every split file, so :func:`file_fingerprint` tells
preprocessed parquet from raw parquet, and data from another vocabulary.

Nothing is lost: the work happens in a fresh ``.<output>.*.partial`` directory beside the
output; only an empty directory or one written by preprocess (with ``overwrite``) is replaced,
by renaming it aside, renaming the new one in, then deleting the old one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recsys._files import write_failure
from recsys.config import PreprocessConfig
from recsys.data import criteo, readers
from recsys.data.etl_mlperf import check_mlperf, run_mlperf
from recsys.data.etl_raw import RawWriter, raw_fingerprint, raw_metadata
from recsys.data.etl_workflow import (
    FITTED_OPTIONS,
    build_workflow,
    fit_and_transform,
    fitted_metadata,
    fitted_types,
    load_workflow,
)
from recsys.data.prepared import (
    FORMAT_VERSION,
    METADATA,
    SPLITS,
    check_output,
    file_fingerprint,
    input_files,
    new_directory_beside,
    read_metadata,
    replace_output,
)
from recsys.data.readers import MalformedLines, Roles

__all__ = [
    "FORMAT_VERSION",
    "METADATA",
    "SPLITS",
    "InputStats",
    "PreprocessReport",
    "file_fingerprint",
    "preprocess",
    "read_metadata",
]


@dataclass
class InputStats:
    """What the input held that the transform changes: reported, and kept in metadata.json."""

    negative_dense: Counter = field(default_factory=Counter)
    missing_dense: Counter = field(default_factory=Counter)
    null_bags: Counter = field(default_factory=Counter)
    null_bag_items: Counter = field(default_factory=Counter)

    def summary(self, dense: list[str], transform: str) -> list[str]:
        def counts(counter: Counter, names: list[str]) -> str:
            return ", ".join(f"{c} {counter[c]:,}" for c in names if counter[c]) or "none"

        lines = []
        if dense:
            lines.append(
                f"dense: {transform}; negative values: {counts(self.negative_dense, dense)}; "
                f"missing: {counts(self.missing_dense, dense)}"
            )
        for name in sorted(self.null_bags.keys() | self.null_bag_items.keys()):
            lines.append(
                f"bags: {name}: {self.null_bags[name]:,} null list(s) read as empty bags, "
                f"{self.null_bag_items[name]:,} null item(s) dropped"
            )
        return lines


@dataclass
class PreprocessReport:
    """What ``preprocess`` wrote."""

    output: Path
    rows: dict[str, int]
    malformed: MalformedLines
    metadata: dict[str, Any] = field(repr=False)
    seconds: float = 0.0
    stats: InputStats = field(default_factory=InputStats)

    def notes(self) -> list[str]:
        """Lines on what the transform did to the values (dense transform, bags)."""
        return self.stats.summary(self.metadata["dense"], self.metadata["dense_transform"])


def preprocess(config: PreprocessConfig) -> PreprocessReport:
    """Run the three stages (see module docstring; one pass with ``encoding = "raw"``) and
    return a report.

    With ``config.apply`` set to a directory written by preprocess, its fitted workflow
    transforms the input instead of a new one being fitted: column roles, encoding and dense
    transform come from there, the output has the same cardinalities and fingerprint,
    ``valid_fraction = test_fraction = 0`` is allowed (every row goes to train/, in input order)
    and label columns may be absent from parquet / CSV input (the output then has none). This
    transforms raw input for scoring, one output row per input row in input order (strict: a
    malformed row is an error instead of being skipped) in ``<tmp>/train/`` (files in the order
    of ``metadata["splits"]["train"]["files"]``); ``tmp`` may be an existing empty directory.
    Applying a raw directory fits nothing either: it hashes the input the same way, with that
    directory's roles and dense transform (and its fingerprint)::

        preprocess(PreprocessConfig(apply="data/day_0", format="parquet", input="new.parquet",
                                    output=tmp, valid_fraction=0, test_fraction=0, strict=True))

    Raises:
        ValueError: bad options, a missing column, an empty split, an output directory that
            preprocess may not replace, an unreadable file, or (strict mode) a malformed line.
        FileNotFoundError: an input, or the ``apply`` directory, does not exist.
    """
    start = time.perf_counter()
    if not config.output:
        raise ValueError("preprocess.output is empty; give the directory to write (--output DIR)")
    output = Path(config.output)
    fitted = read_metadata(config.apply) if config.apply else None
    sources = _sources(config)
    if fitted is None:
        roles, placeholders = _roles(config), []
    else:
        config, roles, placeholders = _applied(config, fitted, sources["train"][0])
    _check_encoding(config, roles)
    carve = _splits_to_carve(config, sources, applying=fitted is not None)
    inputs = [path for files in sources.values() for path in files]
    check_output(output, config.overwrite, inputs + ([Path(config.apply)] if fitted else []))
    work = new_directory_beside(output, "partial")
    try:
        rows, metadata, malformed, stats = _run(
            config, roles, sources, carve, work, fitted, placeholders
        )
        replace_output(output, work)
    except BaseException as error:
        shutil.rmtree(work, ignore_errors=True)  # never leave a half-written dataset behind
        if isinstance(error, OSError) and (failure := write_failure(error, output)) is not error:
            raise failure from error  # pyarrow's write errors name no file
        raise
    return PreprocessReport(output, rows, malformed, metadata, time.perf_counter() - start, stats)


def _run(
    config: PreprocessConfig,
    roles: Roles,
    sources: dict[str, list[Path]],
    carve: list[str],
    work: Path,
    fitted: dict[str, Any] | None,
    placeholders: list[str],
) -> tuple[dict[str, int], dict[str, Any], MalformedLines, InputStats]:
    """The three stages, written into ``work``: (rows per split, metadata, malformed, stats)."""
    malformed = MalformedLines()
    stats = InputStats()
    if config.encoding == "raw":
        rows, described = _run_raw(config, roles, sources, carve, work, fitted, malformed, stats)
    elif config.encoding == "mlperf":

        def clean(piece: pa.Table, path: Path) -> pa.Table:
            return clean_piece(piece, roles, stats, {}, path, "")

        rows, described = run_mlperf(config, sources, work, malformed, clean)
        _require_staged_rows(rows, applying=False)
    else:
        staging = work / "_staging"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # merlin warns about absent GPU / tensorflow packages
            workflow = load_workflow(config) if fitted else build_workflow(config, roles, work)
        types = fitted_types(workflow, roles) if config.apply else {}
        staged = _stage(
            config, roles, sources, carve, malformed, stats, types, _StagingWriter(staging)
        )
        _require_staged_rows(staged, applying=fitted is not None)
        if placeholders:  # unlabeled input in apply mode: the workflow still reads the labels
            _add_placeholders(staging, placeholders)
        rows, fingerprint = fit_and_transform(workflow, config, roles, staging, work, fitted)
        shutil.rmtree(staging)
        described = fitted_metadata(config, roles, workflow, fitted, fingerprint)
    metadata = {
        **described,
        "splits": {
            s: {"rows": rows[s], "files": sorted(p.name for p in (work / s).glob("*.parquet"))}
            for s in SPLITS
        },
        "malformed_rows": malformed.count,
        "input": {f.name: dict(getattr(stats, f.name)) for f in dataclasses.fields(stats)},
        "preprocess": dataclasses.asdict(config),
    }
    (work / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
    return rows, metadata, malformed, stats


def _run_raw(
    config: PreprocessConfig,
    roles: Roles,
    sources: dict[str, list[Path]],
    carve: list[str],
    work: Path,
    fitted: dict[str, Any] | None,
    malformed: MalformedLines,
    stats: InputStats,
) -> tuple[dict[str, int], dict[str, Any]]:
    """``encoding = "raw"``: read, clean, carve, hash and write in one pass (no staging, no
    fit): (rows per split, the metadata keys describing the columns)."""
    fingerprint = raw_fingerprint(config, roles)
    writer = RawWriter(work, roles, config, fingerprint)
    try:
        _stage(config, roles, sources, carve, malformed, stats, {}, writer.write)
    except BaseException:
        writer.abort()
        raise
    rows = writer.close()
    _require_staged_rows(rows, applying=fitted is not None)
    if fitted is None:
        return rows, raw_metadata(roles, config, fingerprint, writer.distinct_estimates())
    return rows, {
        **raw_metadata(roles, config, fingerprint, None),
        "categorical": fitted["categorical"],
    }


# ---------------------------------------------------------------------------------------------
# Options, inputs and the output directory


def _sources(config: PreprocessConfig) -> dict[str, list[Path]]:
    """The files of each split given as input: train always, valid / test when given."""
    sources = {"train": input_files(config.input, "input")}
    for split in ("valid", "test"):
        if getattr(config, split):
            sources[split] = input_files(getattr(config, split), split)
    return sources


def _check_encoding(config: PreprocessConfig, roles: Roles) -> None:
    """The encoding options are valid for these columns (hashing takes no multi-hot column;
    raw keys fit nothing, so no dense normalization)."""
    if config.encoding == "mlperf":
        check_mlperf(config)
    if config.hash_buckets < 1:
        raise ValueError(f"preprocess.hash_buckets = {config.hash_buckets}; expected >= 1")
    if config.encoding == "raw" and config.normalize_dense:
        raise ValueError(
            "preprocess.normalize_dense = true needs a fitting pass over the train split, and "
            "preprocess.encoding = 'raw' fits nothing (one pass); set normalize_dense = false "
            "(dense values still get the signed log) or use encoding 'categorify' or 'hash'"
        )
    if config.encoding == "hash" and roles.multi_hot:
        raise ValueError(
            "preprocess.encoding = 'hash' does not support multi-hot columns "
            f"{roles.multi_hot} (NVTabular's HashBucket fails on lists); use 'categorify'"
        )


def _splits_to_carve(
    config: PreprocessConfig, sources: dict[str, list[Path]], applying: bool
) -> list[str]:
    """The splits (valid, test) to carve out of the train input: those not given as files (in
    apply mode, only those with a fraction above zero). Checks the fractions."""
    carve = [s for s in ("valid", "test") if s not in sources]
    if applying:  # a zero fraction means no such split
        carve = [s for s in carve if getattr(config, f"{s}_fraction") > 0]
    if min(config.valid_fraction, config.test_fraction) < 0 or (
        carve and config.valid_fraction + config.test_fraction >= 1
    ):
        raise ValueError(
            f"valid_fraction {config.valid_fraction} + test_fraction {config.test_fraction} "
            "must be in [0, 1)"
        )
    return carve


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


def _applied(
    config: PreprocessConfig, fitted: dict[str, Any], first_input: Path
) -> tuple[PreprocessConfig, Roles, list[str]]:
    """Apply mode: (config with the fitted roles and options, roles of the columns to read,
    label columns absent from the input that the workflow reads as null placeholders)."""
    multi_hot = [c["name"] for c in fitted["categorical"] if c["multi_hot"]]
    categorical = [c["name"] for c in fitted["categorical"] if not c["multi_hot"]]
    roles = Roles(categorical, multi_hot, list(fitted["dense"]), list(fitted["labels"]))
    if config.format == "criteo" and _roles(config) != roles:
        raise ValueError(
            f"'{config.apply}' was not preprocessed from the criteo format (its columns: "
            f"{roles.all}); give --format parquet or csv"
        )
    given = {
        "categorical": config.categorical,
        "multi_hot": config.multi_hot,
        "dense": config.dense,
        "label": config.label,
    }
    for key, fitted_names in zip(given, dataclasses.astuple(roles), strict=True):
        if given[key] and given[key] != fitted_names:
            raise ValueError(
                f"preprocess.{key} = {given[key]} conflicts with '{config.apply}', fitted with "
                f"{key} = {fitted_names}; in apply mode the column roles come from there"
            )
    defaults = PreprocessConfig()
    options = {}
    for key in FITTED_OPTIONS:
        value, used = getattr(config, key), fitted["preprocess"].get(key, getattr(defaults, key))
        if value != getattr(defaults, key) and value != used:
            raise ValueError(
                f"preprocess.{key} = {value!r} conflicts with '{config.apply}', fitted with "
                f"{used!r}; in apply mode it comes from there"
            )
        options[key] = used
    config = dataclasses.replace(
        config,
        categorical=categorical,
        multi_hot=multi_hot,
        dense=roles.dense,
        label=roles.labels,
        **options,
    )
    placeholders = []
    if config.format != "criteo" and roles.labels:
        names = readers.column_names(first_input, config.format)
        if not any(label in names for label in roles.labels):  # unlabeled: for scoring
            placeholders, roles.labels = roles.labels, []
    return config, roles, placeholders


# ---------------------------------------------------------------------------------------------
# Stage 1: read, clean, split


class _StagingWriter:
    """Writes each staged piece as its own plain parquet file ``<staging>/<split>/part_*``."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging
        self.parts = dict.fromkeys(SPLITS, 0)
        for split in SPLITS:
            (staging / split).mkdir(parents=True, exist_ok=True)

    def __call__(self, split: str, part: pa.Table) -> None:
        pq.write_table(part, self.staging / split / f"part_{self.parts[split]:06d}.parquet")
        self.parts[split] += 1


def _stage(
    config: PreprocessConfig,
    roles: Roles,
    sources: dict[str, list[Path]],
    carve: list[str],
    malformed: MalformedLines,
    stats: InputStats,
    types: dict[str, pa.DataType],
    write: Callable[[str, pa.Table], None],
) -> dict[str, int]:
    """Read every input piece, clean it (``types``: the category types of apply mode), route
    its rows to their split and hand each non-empty part to ``write(split, part)`` in input
    order: the rows per split."""
    rows = dict.fromkeys(SPLITS, 0)
    first_row = 0  # index of the piece's first row among all input rows read so far
    for source_split, files in sources.items():
        for path in files:
            for table in _read(config, roles, path, malformed):
                table = clean_piece(table, roles, stats, types, path, config.apply)
                routed = {source_split: table}
                if source_split == "train" and carve:
                    routed = _carve(table, carve, config, first_row)
                first_row += table.num_rows
                for split, part in routed.items():
                    if part.num_rows:
                        write(split, part)
                        rows[split] += part.num_rows
    return rows


def _read(
    config: PreprocessConfig, roles: Roles, path: Path, malformed: MalformedLines
) -> Iterator[pa.Table]:
    chunk_bytes = config.chunk_mb << 20
    if config.format == "criteo":
        return criteo.read_criteo(path, chunk_bytes, config.strict, malformed)
    return readers.read_table(config.format, path, roles, chunk_bytes, config.strict, malformed)


def clean_piece(
    table: pa.Table,
    roles: Roles,
    stats: InputStats,
    types: dict[str, pa.DataType],
    path: Path,
    apply: str,
) -> pa.Table:
    """Count negative and missing dense values; null bags -> empty, null items dropped;
    in apply mode, categories in the type the workflow was fitted on."""
    for name in roles.dense:
        column = table.column(name)
        stats.negative_dense[name] += pc.sum(pc.less(column, 0)).as_py() or 0
        stats.missing_dense[name] += column.null_count
    for name in roles.multi_hot:
        bags = table.column(name).combine_chunks()
        items = pc.list_flatten(bags)
        if bags.null_count or items.null_count:
            stats.null_bags[name] += bags.null_count
            stats.null_bag_items[name] += items.null_count
            keep = items.is_valid()
            parents = pc.list_parent_indices(bags).filter(keep).to_numpy()
            offsets = np.concatenate([[0], np.cumsum(np.bincount(parents, minlength=len(bags)))])
            offsets = pa.array(offsets, bags.offsets.type)
            bags = type(bags).from_arrays(offsets, items.filter(keep))
        table = table.set_column(table.schema.get_field_index(name), name, bags)
    for name, kind in types.items():
        if table.schema.field(name).type != kind:
            try:
                table = table.set_column(
                    table.schema.get_field_index(name), name, pc.cast(table.column(name), kind)
                )
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise ValueError(
                    f"'{path}': column '{name}' does not convert to {kind}, the type '{apply}' "
                    f"was fitted on: {error}"
                ) from None
    return table


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


def _add_placeholders(staging: Path, labels: list[str]) -> None:
    """Null label columns for unlabeled input: the fitted workflow reads them; the output drops
    them."""
    for file in staging.rglob("*.parquet"):
        table = pq.read_table(file)
        for name in labels:
            table = table.append_column(name, pa.nulls(table.num_rows, pa.float32()))
        pq.write_table(table, file)


def _require_staged_rows(staged: dict[str, int], applying: bool) -> None:
    """Every split has rows (in apply mode, only train must: valid / test may be empty)."""
    for split in SPLITS:
        if staged[split] == 0 and (split == "train" or not applying):
            hint = (
                f"--{split} FILE or a larger preprocess.{split}_fraction"
                if split != "train"
                else "more input"
            )
            raise ValueError(f"split '{split}' has no rows after staging; give {hint}")
