"""What a request to ``recsys serve`` may hold, checked before it joins a batch: every bad
field is a :class:`RequestError` naming it (the server answers 400 and stays up), so a batch
the engine merges holds only well-formed rows.

Two forms, both turned into :class:`Rows` (B samples, F = ``len(spec.sparse_names)``):

- Named features (the plain JSON route), one sample or a list of them::

      {"dense": {"int_0": 0.5, ...}, "sparse": {"cat_0": 123, "cat_1": [4, 9], "cat_2": []}}
      [{"dense": ..., "sparse": ...}, ...]

  Every dense feature is a finite number; every categorical feature an id or a list of ids
  (a bag; ``[]`` is an empty bag).
- Tensors (the Open Inference Protocol, KServe v2 ``/v2/models/<name>/infer``)::

      dense    FP32 (or FP64) [B, N_dense]   features in spec.dense_names order
      lengths  INT64 (or INT32) [B, F]       sample b's number of ids of feature f
      values   INT64 [L]                     the ids, sample-major: sample 0's feature 0 ids,
                                             its feature 1 ids, ..., then sample 1's

Ids: with ``spec.id_encoding == "index"`` each lies in [0, cardinality) of its feature (as
``recsys predict`` checks); raw ids are any int64 but the two reserved smallest values. A bag
holds at most ``max_ids`` ids.

Raw rows (the JSON route of ``recsys serve --transform``): the same named form, but the values
are those of the data the model's training data was preprocessed from, transformed here by its
fitted workflow (:class:`recsys.data.etl_online.RowTransform`): a categorical value is a string
or an integer (as it was fitted: 12 and "12" differ) or null, a multi-hot one a list of them,
a dense value a finite number or null (missing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from recsys._suggest import quoted_with_hints
from recsys.data.batch import DatasetSpec
from recsys.data.etl_online import RowTransform
from recsys.ops.slot_map.hash_map import RESERVED_KEY

__all__ = ["RequestError", "Rows", "raw_rows_from_json", "rows_from_json", "rows_from_tensors"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class RequestError(ValueError):
    """A request the model cannot score; the message names the field and what was expected."""


@dataclass(frozen=True)
class Rows:
    """Checked samples, in the order :meth:`ServedModel.score` takes them."""

    dense: np.ndarray  # float32 [B, N_dense]
    lengths: np.ndarray  # int64 [B, F]
    values: np.ndarray  # int64 [L], sample-major

    def __len__(self) -> int:
        return self.dense.shape[0]


def rows_from_json(body: Any, spec: DatasetSpec, max_ids: int) -> Rows:
    """Named features (one sample, or a list of them) as :class:`Rows`.

    Raises:
        RequestError: not an object or list of objects; a missing or unknown feature, a dense
            value that is not a finite number, an id that is not an integer or outside its
            table, a bag of more than ``max_ids`` ids (each named, with the sample's index).
    """
    samples = body if isinstance(body, list) else [body]
    if not samples:
        raise RequestError("the request holds no sample: send an object or a non-empty list")
    dense = np.empty((len(samples), spec.num_dense), np.float32)
    lengths = np.empty((len(samples), len(spec.sparse_names)), np.int64)
    values: list[int] = []
    for b, sample in enumerate(samples):
        at = f"sample {b}: " if isinstance(body, list) else ""
        if not isinstance(sample, dict):
            raise RequestError(f"{at}expected an object with 'dense' and 'sparse', got {sample!r}")
        _check_keys(sample, ("dense", "sparse"), "", at, "the request")
        given_dense = _section(sample, "dense", spec.dense_names, at)
        given_sparse = _section(sample, "sparse", spec.sparse_names, at)
        for i, name in enumerate(spec.dense_names):
            dense[b, i] = _dense_value(given_dense[name], f"{at}dense feature '{name}'")
        for f, name in enumerate(spec.sparse_names):
            bag = given_sparse[name]
            bag = bag if isinstance(bag, list) else [bag]
            where = f"{at}sparse feature '{name}'"
            if len(bag) > max_ids:
                raise RequestError(f"{where} has {len(bag)} ids; at most {max_ids} per bag")
            for value in bag:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise RequestError(f"{where}: id {value!r} is not an integer")
            lengths[b, f] = len(bag)
            values.extend(bag)
    return _checked_ids(Rows(dense, lengths, _int64(values, "sparse ids")), spec)


def raw_rows_from_json(body: Any, spec: DatasetSpec, transform: RowTransform, max_ids: int) -> Rows:
    """Named features with raw values (one sample, or a list of them), transformed by
    ``transform`` into :class:`Rows` (see the module docstring).

    Raises:
        RequestError: not an object or list of objects; a missing or unknown feature, a dense
            value that is neither a finite number nor null, a categorical value that is not a
            string, an integer or null (or, multi-hot, a list of them), one that does not
            convert to the type the workflow was fitted on, a bag of more than ``max_ids``
            values (each named, with the sample's index).
    """
    samples = body if isinstance(body, list) else [body]
    if not samples:
        raise RequestError("the request holds no sample: send an object or a non-empty list")
    roles = transform.roles
    columns: dict[str, list] = {name: [] for name in transform.inputs}
    for b, sample in enumerate(samples):
        at = f"sample {b}: " if isinstance(body, list) else ""
        if not isinstance(sample, dict):
            raise RequestError(f"{at}expected an object with 'dense' and 'sparse', got {sample!r}")
        _check_keys(sample, ("dense", "sparse"), "", at, "the request")
        given_dense = _section(sample, "dense", roles.dense, at)
        given_sparse = _section(sample, "sparse", roles.sparse, at)
        for name in roles.dense:
            value = given_dense[name]
            where = f"{at}dense feature '{name}'"
            columns[name].append(None if value is None else _dense_value(value, where))
        for name in roles.sparse:
            value, where = given_sparse[name], f"{at}sparse feature '{name}'"
            if name in roles.multi_hot:
                bag = value if isinstance(value, list) else [value]
                if len(bag) > max_ids:
                    raise RequestError(f"{where} has {len(bag)} values; at most {max_ids}")
                for item in bag:
                    _raw_value(item, where)
                columns[name].append(bag)
            else:
                columns[name].append(_raw_value(value, where))
    try:
        table = pa.table({name: pa.array(values) for name, values in columns.items()})
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as error:
        raise RequestError(
            f"the raw values do not form columns of one type each: {error}"
        ) from None
    try:
        transformed = transform(table)
    except ValueError as error:
        raise RequestError(str(error)) from None
    dense = np.stack(
        [transformed.column(n).to_numpy().astype(np.float32) for n in spec.dense_names], axis=1
    ).reshape(len(samples), spec.num_dense)
    lengths = np.empty((len(samples), len(spec.sparse_names)), np.int64)
    per_feature = []
    for f, name in enumerate(spec.sparse_names):
        column = transformed.column(name).combine_chunks()
        if name in roles.multi_hot:
            offsets = column.offsets.to_numpy()
            lengths[:, f] = np.diff(offsets)
            flat = column.values.to_numpy()
            per_feature.append([flat[offsets[b] : offsets[b + 1]] for b in range(len(samples))])
        else:
            lengths[:, f] = 1
            per_feature.append([v[None] for v in column.to_numpy()])
    values = [per_feature[f][b] for b in range(len(samples)) for f in range(len(per_feature))]
    flat = np.concatenate(values).astype(np.int64) if values else np.zeros(0, np.int64)
    return _checked_ids(Rows(dense, lengths, flat), spec)


def _raw_value(value: Any, where: str) -> Any:
    """A raw categorical value: a string, an integer or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{where}: {value!r} is not a string, an integer or null")
    if not INT64_MIN <= value <= INT64_MAX:
        raise RequestError(f"{where}: {value} does not fit int64")
    return value


def rows_from_tensors(
    tensors: dict[str, tuple[str, Sequence[int], np.ndarray]], spec: DatasetSpec, max_ids: int
) -> Rows:
    """Open Inference Protocol tensors (name -> (datatype, shape, data)) as :class:`Rows`.

    Raises:
        RequestError: a missing or unknown input, a datatype or shape that does not match the
            model (named with what was expected), a NaN or infinite dense value, a negative
            length, a bag of more than ``max_ids`` ids, values that do not add up to the
            lengths, an id outside its table.
    """
    num_sparse = len(spec.sparse_names)
    expected = {
        "dense": (("FP32", "FP64"), f"[B, {spec.num_dense}]"),
        "lengths": (("INT64", "INT32"), f"[B, {num_sparse}]"),
        "values": (("INT64",), "[L]"),
    }
    _check_keys(tensors, tuple(expected), "input ", "", "the request's inputs")
    for name, (datatypes, shape) in expected.items():
        datatype = tensors[name][0]
        if datatype not in datatypes:
            raise RequestError(
                f"input '{name}' has datatype {datatype}; expected {' or '.join(datatypes)} "
                f"{shape}"
            )
    dense = _shaped(tensors, "dense", (None, spec.num_dense), expected)
    lengths = _shaped(tensors, "lengths", (dense.shape[0], num_sparse), expected)
    values = _shaped(tensors, "values", (None,), expected)
    if dense.shape[0] < 1:
        raise RequestError("input 'dense' has 0 rows; a request scores at least one sample")
    bad = ~np.isfinite(dense)
    if bad.any():
        b, i = np.argwhere(bad)[0]
        raise RequestError(
            f"input 'dense' row {b}, feature '{spec.dense_names[i]}' is {dense[b, i]}; "
            "expected a finite number"
        )
    lengths = lengths.astype(np.int64)
    for check, what in ((lengths < 0, "negative"), (lengths > max_ids, f"more than {max_ids}")):
        if check.any():
            b, f = np.argwhere(check)[0]
            raise RequestError(
                f"input 'lengths' row {b}, feature '{spec.sparse_names[f]}' is {lengths[b, f]} "
                f"({what}); a bag holds 0 to {max_ids} ids"
            )
    if len(values) != lengths.sum():
        raise RequestError(
            f"input 'values' holds {len(values)} ids; input 'lengths' adds up to {lengths.sum()}"
        )
    return _checked_ids(Rows(dense.astype(np.float32), lengths, values), spec)


def _check_keys(given: dict, names: Sequence[str], kind: str, at: str, what: str) -> None:
    """Every one of ``names`` in ``given`` and nothing else. An unknown key is named first,
    with the closest of the missing names (a typo points to what it should be, never the
    other way round)."""
    missing = [name for name in names if name not in given]
    unknown = [name for name in given if name not in names]
    if unknown:
        raise RequestError(
            f"{at}{what} has unknown {kind}{quoted_with_hints(unknown, missing or list(names))}; "
            f"expected {', '.join(repr(n) for n in names)}"
        )
    if missing:
        raise RequestError(
            f"{at}{kind}{', '.join(repr(n) for n in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {what}; expected "
            f"{', '.join(repr(n) for n in names)}"
        )


def _section(sample: dict, key: str, names: Sequence[str], at: str) -> dict:
    given = sample[key]
    if not isinstance(given, dict):
        raise RequestError(f"{at}'{key}' must be an object of feature name -> value")
    _check_keys(given, names, f"{key} feature ", at, f"'{key}'")
    return given


def _dense_value(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{where} is {value!r}; expected a number")
    if not math.isfinite(value):
        raise RequestError(f"{where} is {value}; expected a finite number")
    return value


def _int64(values: list[int], what: str) -> np.ndarray:
    for value in values:
        if not INT64_MIN <= value <= INT64_MAX:
            raise RequestError(f"{what}: {value} does not fit int64")
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _shaped(
    tensors: dict[str, tuple[str, Sequence[int], np.ndarray]],
    name: str,
    shape: tuple[int | None, ...],
    expected: dict[str, tuple[tuple[str, ...], str]],
) -> np.ndarray:
    _, given, data = tensors[name]
    fits = len(given) == len(shape) and all(
        want is None or have == want for have, want in zip(given, shape, strict=True)
    )
    if not fits or data.size != math.prod(given):
        raise RequestError(
            f"input '{name}' has shape {list(given)} ({data.size} values); expected "
            f"{expected[name][1]}"
        )
    return data.reshape(given)


def _checked_ids(rows: Rows, spec: DatasetSpec) -> Rows:
    """Every id in its feature's table (index encoding) or not reserved (raw)."""
    if not rows.values.size:
        return rows
    feature = np.repeat(np.tile(np.arange(len(spec.sparse_names)), len(rows)), rows.lengths.ravel())
    if spec.id_encoding == "raw":
        bad = rows.values <= RESERVED_KEY
        expected = f"any int64 id but the reserved {RESERVED_KEY - 1} and {RESERVED_KEY}"
    else:
        cardinality = np.asarray(spec.cardinalities, np.int64)[feature]
        bad = (rows.values < 0) | (rows.values >= cardinality)
        expected = None
    if bad.any():
        i = int(np.argmax(bad))
        sample = int(np.searchsorted(np.cumsum(rows.lengths.sum(1)), i, side="right"))
        name = spec.sparse_names[feature[i]]
        if expected is None:
            expected = f"an id in [0, {spec.cardinalities[feature[i]]}) (its table's rows)"
        raise RequestError(
            f"sample {sample}, sparse feature '{name}': id {rows.values[i]}; expected {expected}"
        )
    return rows
