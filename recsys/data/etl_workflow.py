"""Stages 2 and 3 of ``recsys preprocess`` (see ``recsys.data.etl``): the NVTabular workflow.

Build it (``Categorify`` or ``HashBucket`` for categorical and multi-hot columns; fill, signed
log and optional ``Normalize`` for dense ones) or load the one an earlier run fitted; fit it on
the staged train split; transform every split into parquet row groups; and derive what
``metadata.json`` records of it: cardinalities, dense transform and the fingerprint.

NVTabular and merlin are imported inside the functions: importing ``recsys.data`` needs neither.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys.config import PreprocessConfig
from recsys.data import readers
from recsys.data.prepared import FINGERPRINT_KEY, FORMAT_VERSION, SPLITS, dense_transform
from recsys.data.readers import Roles

# The options that change ids or dense values: in the fingerprint, and fixed in apply mode.
FITTED_OPTIONS = ("encoding", "freq_threshold", "hash_buckets", "log_dense", "normalize_dense")


def nvt_dataset(directory: Path, config: PreprocessConfig):
    from merlin.io import Dataset

    files = sorted(str(p) for p in directory.glob("*.parquet"))  # part_<index>: input order
    return Dataset(files, engine="parquet", part_size=f"{config.chunk_mb}MB", cpu=True)


def build_workflow(config: PreprocessConfig, roles: Roles, work: Path):
    import nvtabular as nvt
    from merlin.schema import Tags
    from nvtabular import ops

    if config.encoding == "categorify":
        encode = ops.Categorify(freq_threshold=config.freq_threshold, out_path=str(work))
    else:
        encode = ops.HashBucket(num_buckets=config.hash_buckets)
    graph = roles.sparse >> encode
    if roles.dense:
        dense = roles.dense >> ops.FillMissing(fill_val=0.0)
        if config.log_dense:
            # pickled by reference with the workflow: loading it imports recsys.data.readers
            signed_log = ops.LambdaOp(
                readers.signed_log1p, dtype=np.float32, tags=[Tags.CONTINUOUS]
            )
            dense = dense >> signed_log
        if config.normalize_dense:
            dense = dense >> ops.Normalize()
        graph = graph + dense
    return nvt.Workflow(graph + roles.labels)


def load_workflow(config: PreprocessConfig):
    import nvtabular as nvt

    directory = Path(config.apply) / "workflow"
    if not (directory / "workflow.pkl").is_file():
        raise FileNotFoundError(f"'{config.apply}' has no fitted workflow ({directory} is missing)")
    return nvt.Workflow.load(str(directory))


def fitted_types(workflow, roles: Roles) -> dict[str, pa.DataType]:
    """The arrow type each categorical column was fitted with (a value must have the same
    type to get the same id: 12 and "12" differ)."""
    from merlin.dtypes import ElementType

    types = {}
    for name in roles.sparse:
        column = workflow.input_schema[name]
        kind = column.dtype.element_type
        if kind in (ElementType.String, ElementType.Object):
            value = pa.string()
        elif kind in (ElementType.Int, ElementType.UInt):
            value = pa.int64()
        elif kind is ElementType.Float:
            value = pa.float64()
        else:
            continue
        types[name] = pa.list_(value) if column.is_list else value
    return types


def _transform(
    workflow,
    source: Path,
    target: Path,
    roles: Roles,
    config: PreprocessConfig,
    fingerprint: str,
) -> int:
    target.mkdir(parents=True)
    if not any(source.glob("*.parquet")):
        return 0  # an empty valid / test split (apply mode)
    types = {name: pa.float32() for name in roles.labels + roles.dense}
    types.update({name: pa.int64() for name in roles.categorical})
    types.update({name: pa.list_(pa.int64()) for name in roles.multi_hot})
    schema = pa.schema([(name, types[name]) for name in roles.all])
    schema = schema.with_metadata({FINGERPRINT_KEY: fingerprint.encode()})
    rows = 0
    for index, frame in enumerate(workflow.transform(nvt_dataset(source, config)).to_iter()):
        table = pa.Table.from_pandas(frame[roles.all], preserve_index=False).cast(schema)
        pq.write_table(
            table, target / f"part_{index:06d}.parquet", row_group_size=config.row_group_rows
        )
        rows += table.num_rows
    return rows


def _cardinality(workflow, name: str, config: PreprocessConfig) -> int:
    if config.encoding == "hash":
        return config.hash_buckets
    return int(workflow.output_schema[name].int_domain.max) + 1


def _fingerprint(directory: Path, config: PreprocessConfig, roles: Roles, workflow) -> str:
    """sha256 over what decides ids and dense values: the options, the fitted categories and
    the normalization statistics."""
    from merlin.dag import Graph
    from nvtabular import ops

    digest = hashlib.sha256()
    options = {key: getattr(config, key) for key in FITTED_OPTIONS}
    options["roles"] = dataclasses.asdict(roles)
    options["dense_transform"] = dense_transform(config.log_dense, config.normalize_dense)
    digest.update(json.dumps(options, sort_keys=True).encode())
    for file in sorted(p for p in (directory / "categories").rglob("*") if p.is_file()):
        digest.update(file.relative_to(directory).as_posix().encode())
        with file.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    for node in Graph.get_nodes_by_op_type([workflow.output_node], ops.Normalize):
        statistics = {"means": node.op.means, "stds": node.op.stds}
        digest.update(json.dumps(statistics, sort_keys=True).encode())
    return digest.hexdigest()


def fit_and_transform(
    workflow, config: PreprocessConfig, roles: Roles, staging: Path, work: Path, fitted: dict | None
) -> tuple[dict[str, int], str]:
    """Fit the workflow on the staged train split (unless ``fitted``), save it in ``work`` and
    transform every split into ``work/<split>``: (rows written per split, fingerprint)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fitted is None:
            workflow.fit(nvt_dataset(staging / "train", config))
        workflow.save(str(work / "workflow"))  # copies the categories into workflow/
        if fitted is None:
            fingerprint = _fingerprint(work / "workflow", config, roles, workflow)
        else:
            fingerprint = fitted["fingerprint"]
        rows = {
            s: _transform(workflow, staging / s, work / s, roles, config, fingerprint)
            for s in SPLITS
        }
    return rows, fingerprint


def fitted_metadata(
    config: PreprocessConfig, roles: Roles, workflow, fitted: dict | None, fingerprint: str
) -> dict[str, Any]:
    """The keys of metadata.json that the fitted workflow decides (in apply mode, those of
    ``fitted``): column roles, cardinalities, dense transform and fingerprint."""
    if fitted is None:
        categorical = [
            {
                "name": name,
                "cardinality": _cardinality(workflow, name, config),
                "multi_hot": name in roles.multi_hot,
            }
            for name in roles.sparse
        ]
        transform = dense_transform(config.log_dense, config.normalize_dense)
    else:
        categorical, transform = fitted["categorical"], fitted["dense_transform"]
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "id_encoding": "index",
        "labels": roles.labels,
        "dense": roles.dense,
        "categorical": categorical,
        "dense_transform": transform,
    }
