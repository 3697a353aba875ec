"""ItemEncoding: raw item values -> the ids a sequence dataset's preprocess gave them, and back,
whole through the JSON an export carries."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.config import PreprocessConfig
from recsys.data.item_encoding import ItemEncoding
from recsys.data.keys import value_keys
from recsys.data.sequence_batches import read_histories
from recsys.data.sequences import preprocess_interactions


def _preprocess(tmp_path, encoding: str, **options):
    items = ["a", "b", "a", "c", "b", "a", "d", "a", "b", "e"]
    log = pa.table(
        {
            "user": ["u1"] * 5 + ["u2"] * 5,
            "item": items,
            "time": [float(t) for t in range(10)],
        }
    )
    pq.write_table(log, tmp_path / "log.parquet")
    output = tmp_path / encoding
    preprocess_interactions(
        PreprocessConfig(
            format="interactions",
            input=str(tmp_path / "log.parquet"),
            output=str(output),
            user="user",
            item="item",
            time="time",
            encoding=encoding,
            **options,
        )
    )
    return output


@pytest.mark.parametrize(
    ("encoding", "options"), [("categorify", {}), ("hash", {"hash_buckets": 7}), ("raw", {})]
)
def test_encodes_raw_items_as_preprocess_did(tmp_path, encoding, options):
    output = _preprocess(tmp_path, encoding, **options)
    histories = read_histories(output, "test")
    loaded = ItemEncoding.read(output)
    for codec in (loaded, ItemEncoding.from_json(loaded.to_json())):
        # u1: a b a c | b (test target b); u2: a d a b | e
        ids = codec.encode(pa.array(["a", "b", "a", "c", "a", "d", "a", "b"]))
        assert ids.tolist() == histories.values.tolist()
    assert loaded.encode(pa.array(["b", "e"])).tolist() == histories.targets.tolist()
    if encoding == "categorify":
        assert loaded.encode(pa.array(["never seen"])).tolist() == [2]  # the rare id
        # c is only a valid target: not in the vocabulary of the train events
        assert loaded.decode(loaded.encode(pa.array(["b", "a", "c"]))).to_pylist() == [
            "b",
            "a",
            None,
        ]
    elif encoding == "raw":
        keys = value_keys(pa.array(["b", "z"]))
        assert loaded.encode(pa.array(["b", "z"])).tolist() == keys.tolist()
        assert np.array_equal(loaded.decode(keys), keys)  # raw keys: no vocabulary
    with pytest.raises(ValueError, match="item 1 of the histories is null"):
        loaded.encode(pa.array(["a", None]))
