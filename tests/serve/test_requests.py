"""The checks ``recsys serve`` runs on a request before it joins a batch: both forms give the
same rows, and each bad field is named (index ids against their table, raw ids against the
reserved keys)."""

import numpy as np
import pytest

from recsys.data.batch import DatasetSpec
from recsys.serve.online.requests import RequestError, rows_from_json, rows_from_tensors

INDEX = DatasetSpec(("d0", "d1"), ("a", "b"), (10, 100), ("click",))
RAW = DatasetSpec(("d0", "d1"), ("a", "b"), (0, 0), ("click",), id_encoding="raw")


def _sample(a, b, d0=0.5):
    return {"dense": {"d0": d0, "d1": -1}, "sparse": {"a": a, "b": b}}


def _tensors(dense, lengths, values):
    return {
        "dense": ("FP32", list(np.shape(dense)), np.asarray(dense, np.float32).ravel()),
        "lengths": ("INT64", list(np.shape(lengths)), np.asarray(lengths, np.int64).ravel()),
        "values": ("INT64", [len(values)], np.asarray(values, np.int64)),
    }


def test_both_forms_give_the_same_sample_major_rows():
    rows = rows_from_json([_sample(3, [7, 99]), _sample([], 0, d0=2)], INDEX, 8)
    assert rows.dense.tolist() == [[0.5, -1.0], [2.0, -1.0]]
    assert rows.lengths.tolist() == [[1, 2], [0, 1]]
    assert rows.values.tolist() == [3, 7, 99, 0]
    same = rows_from_tensors(_tensors(rows.dense, rows.lengths, [3, 7, 99, 0]), INDEX, 8)
    assert np.array_equal(same.dense, rows.dense) and np.array_equal(same.values, rows.values)
    assert np.array_equal(same.lengths, rows.lengths)


def test_index_ids_are_checked_against_their_table():
    with pytest.raises(
        RequestError, match=r"sample 1, sparse feature 'b': id 100; expected an id in \[0, 100\)"
    ):
        rows_from_json([_sample(3, 1), _sample(3, [5, 100])], INDEX, 8)
    with pytest.raises(RequestError, match=r"sample 0, sparse feature 'a': id -1"):
        rows_from_tensors(_tensors([[0, 0]], [[1, 0]], [-1]), INDEX, 8)
    rows_from_json(_sample(-1, 2**62), RAW, 8)  # raw ids: any int64 key
    with pytest.raises(RequestError, match="reserved"):
        rows_from_json(_sample(-(2**63) + 1, 1), RAW, 8)
    with pytest.raises(RequestError, match="does not fit int64"):
        rows_from_json(_sample(2**63, 1), RAW, 8)


def test_bad_tensors_are_named():
    with pytest.raises(RequestError, match="input 'dense' row 0, feature 'd1' is inf"):
        rows_from_tensors(_tensors([[0, np.inf]], [[1, 0]], [1]), INDEX, 8)
    with pytest.raises(RequestError, match="input 'lengths' row 0, feature 'b' is -1"):
        rows_from_tensors(_tensors([[0, 0]], [[1, -1]], []), INDEX, 8)
    with pytest.raises(RequestError, match="input 'lengths' has shape \\[2, 2\\]"):
        rows_from_tensors(_tensors([[0, 0]], [[1, 0], [1, 0]], [1, 1]), INDEX, 8)
    extra = _tensors([[0, 0]], [[1, 0]], [1]) | {"weights": ("FP32", [1], np.ones(1))}
    with pytest.raises(RequestError, match="unknown input 'weights'"):
        rows_from_tensors(extra, INDEX, 8)


def test_a_typo_is_pointed_to_the_name_it_should_be():
    typo = {"dense": {"d0": 0.5, "d_1": -1}, "sparse": {"a": 1, "b": 2}}
    with pytest.raises(
        RequestError, match=r"'dense' has unknown dense feature 'd_1' \(did you mean 'd1'\?\)"
    ):
        rows_from_json(typo, INDEX, 8)
    tensors = _tensors([[0, 0]], [[1, 0]], [1])
    tensors["dens"] = tensors.pop("dense")
    with pytest.raises(RequestError, match=r"unknown input 'dens' \(did you mean 'dense'\?\)"):
        rows_from_tensors(tensors, INDEX, 8)
