"""`recsys train` of a sequence model whose item table is dynamic (raw item keys, or
model.dynamic.tables), tiered (on disk behind a cache) or both: it trains and ranks, a resumed run
continues exactly, and `recsys eval` of its checkpoint reproduces the test ranking."""

import pytest

from recsys.train.evaluate import evaluate_checkpoint
from recsys.train.metrics import read_metrics
from tests.train.test_sequence_training import RANKING, _run

TABLES = {
    "raw_keys": ["--data.synthetic_sequences.id_encoding=raw"],
    "dynamic": ["--model.dynamic.tables=['all']", "--model.dynamic.initial_capacity=16"],
    "tiered": ["--model.storage.tier=disk", "--model.storage.cache_rows=58"],
    "tiered_dynamic": [
        "--model.storage.tier=disk",
        "--model.storage.cache_rows=58",
        "--model.dynamic.tables=['all']",
        "--model.dynamic.initial_capacity=16",
    ],
}


@pytest.mark.parametrize(
    "kind",
    [
        "dynamic",
        pytest.param("raw_keys", marks=pytest.mark.slow),
        pytest.param("tiered", marks=pytest.mark.slow),
        pytest.param("tiered_dynamic", marks=pytest.mark.slow),
    ],
)
def test_trains_resumes_exactly_and_evaluates(kind, tmp_path):
    options = TABLES[kind]
    whole = _run(tmp_path / "whole", *options)
    assert whole.steps == 14 and set(whole.test) >= RANKING  # 7 batches of windows, 2 epochs
    events = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    train_events = [e for e in events if e["split"] == "train"]
    if kind.startswith("tiered"):
        assert train_events[-1]["tiered/item/cache_rows"] == 58
    else:  # every item trained has a row: the corpus ranked
        assert train_events[-1]["dynamic/item/size"] >= 50
    _run(tmp_path / "split", *options, "--train.max_steps=6")
    resumed = _run(tmp_path / "split", *options, "--checkpoint.resume=latest")
    after = [e for e in read_metrics(tmp_path / "split" / "metrics.jsonl") if e["step"] > 6]
    expected = [e for e in events if e["step"] > 6]
    losses = [e["loss"] for e in after if e["split"] == "train"]
    assert losses and losses == [e["loss"] for e in expected if e["split"] == "train"]
    assert resumed.test == whole.test
    assert evaluate_checkpoint(tmp_path / "whole").metrics == whole.test
