"""recsys serve --transform: the JSON route takes raw values (64-bit user ids, string items,
string genre bags, signed prices, a missing price) and scores them exactly as
``recsys predict --transform`` scores the same rows from a file; a raw value the fitted
workflow cannot take is a 400 naming the feature, and the server stays up."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys.serve.export import predict
from tests.serve.test_predict_raw import model, raw_events  # noqa: F401  (the trained model)
from tests.serve.test_server import Server


def _raw_samples(table) -> list[dict]:
    return [
        {
            "dense": {"price": row["price"]},
            "sparse": {"user": row["user"], "item": row["item"], "genres": row["genres"]},
        }
        for row in table.to_pylist()
    ]


def test_raw_requests_score_as_predict_transform(model, tmp_path):  # noqa: F811
    _, _, data, exported = model
    rows = raw_events(40, seed=5).drop(["click"])
    prices = rows.column("price").to_pylist()
    prices[3] = None  # missing: the workflow fills it as in a file
    rows = rows.set_column(rows.schema.get_field_index("price"), "price", [prices])
    raw_file = tmp_path / "raw.parquet"
    pq.write_table(rows, raw_file)
    predict(exported, raw_file, tmp_path / "offline.parquet", transform=True)
    expected = pq.read_table(tmp_path / "offline.parquet").column("score_click").to_numpy()

    server = Server(tmp_path, "--model", str(exported), "--transform", "--data", str(data))
    try:
        samples = _raw_samples(rows)
        status, body = server.post("/predict", samples)
        assert status == 200, body
        np.testing.assert_array_equal(np.asarray(body["scores"]["click"], np.float32), expected)
        status, body = server.post("/predict", samples[7])  # one sample alone
        assert status == 200 and body["scores"]["click"] == [pytest.approx(expected[7], abs=0)]

        bad = dict(samples[0], sparse=dict(samples[0]["sparse"], item=1.5))
        status, body = server.post("/predict", bad)
        assert status == 400 and "sparse feature 'item'" in body["error"], body
        bad = dict(samples[0], sparse=dict(samples[0]["sparse"], user="not-a-number"))
        status, body = server.post("/predict", bad)
        assert status == 400 and "column 'user' does not convert to int64" in body["error"]
        missing = {"dense": {"price": 1.0}, "sparse": {"user": 1, "item": "item-1"}}
        status, body = server.post("/predict", missing)
        assert status == 400 and "'genres' is missing" in body["error"], body
        assert server.post("/predict", samples[1])[0] == 200  # still serving
    finally:
        assert server.stop() == 0
