"""recsys export / predict of a sequence model: the top-K items of each history, from a
torch.export program that agrees with the trained model's ranking."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys.config import load_config
from recsys.distributed.parallel import DistributedInfo
from recsys.serve.export import export_model, predict
from recsys.serve.retrieval_export import load_retrieval
from recsys.train.retrieval import NextItemTask
from recsys.train.trainer import train
from tests.train.test_sequence_training import TINY


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    result = train(load_config(None, [*TINY, f"--run.dir={root / 'run'}"]))
    return root, result, export_model(root / "run", root / "model.pt2")


def _histories(root, rows):
    items = pa.array(rows, pa.list_(pa.int64()))
    table = pa.table({"user": [f"u{i}" for i in range(len(rows))], "items": items})
    pq.write_table(table, root / "histories.parquet")
    return root / "histories.parquet"


def test_predict_returns_the_top_items_of_each_history(exported, tmp_path):
    root, _, model_path = exported
    module, info = load_retrieval(model_path)
    # top-100 capped at the candidates: every item but the 3 reserved ids
    assert info["first_item"] == 3 and info["top_k"] == info["num_items"] - 3 < 100
    long = list(range(3, 40))  # longer than max_len 10: its last 10 items count
    rows = [[5, 9, 4], [], long]
    report = predict(model_path, _histories(tmp_path, rows), tmp_path / "top.parquet")
    assert report.rows == 3 and report.columns == ["user", "top_items", "top_scores"]
    out = pq.read_table(tmp_path / "top.parquet").to_pydict()
    assert out["user"] == ["u0", "u1", "u2"]
    for top, scores in zip(out["top_items"], out["top_scores"], strict=True):
        assert len(top) == len(set(top)) == info["top_k"] and min(top) >= 3
        assert scores == sorted(scores, reverse=True)
    cut = _histories(tmp_path, [long[-10:]])
    predict(model_path, cut, tmp_path / "cut.parquet")
    assert (
        pq.read_table(tmp_path / "cut.parquet")["top_items"].to_pylist()[0] == out["top_items"][2]
    )


def test_predicted_top_10_reproduces_the_test_hit_rate(exported, tmp_path):
    root, result, model_path = exported
    run = load_config(root / "run" / "config.toml")
    task = NextItemTask(run, torch.device("cpu"), DistributedInfo(0, 1, 0), print)
    test = task.data.splits["test"]
    ends = zip(test.offsets[:-1], test.offsets[1:], strict=True)
    rows = [test.values[a:b].tolist() for a, b in ends]
    predict(model_path, _histories(tmp_path, rows), tmp_path / "top.parquet")
    top = pq.read_table(tmp_path / "top.parquet")["top_items"].to_pylist()
    hits = [target in items[:10] for target, items in zip(test.targets, top, strict=True)]
    assert np.mean(hits) == pytest.approx(result.test["hr@10"], abs=1.5 / len(hits))


def test_predict_refuses_raw_input_and_missing_histories(exported, tmp_path):
    _, _, model_path = exported
    with pytest.raises(ValueError, match="sequence model's export"):
        predict(model_path, tmp_path, tmp_path / "out.parquet", transform=True)
    pq.write_table(pa.table({"user": ["a"]}), tmp_path / "no_items.parquet")
    with pytest.raises(ValueError, match="has no 'items' column"):
        predict(model_path, tmp_path / "no_items.parquet", tmp_path / "out.parquet")
    with pytest.raises(ValueError, match="item ids span \\[3, 99\\]"):
        predict(model_path, _histories(tmp_path, [[3, 99]]), tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()
