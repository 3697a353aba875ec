"""recsys predict on data that was never preprocessed: refused, or transformed with the model's
own vocabulary (--transform); never scored with raw ids read as table rows."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.cli import main
from recsys.config import PreprocessConfig, load_config
from recsys.data.etl import preprocess
from recsys.serve.export import export_model, predict
from recsys.train.trainer import train

ROLES = {"categorical": ["user", "item"], "multi_hot": ["genres"], "dense": ["price"]}


def raw_events(rows: int, seed: int) -> pa.Table:
    """A raw event log: 64-bit user ids, string items, genre bags, signed prices, clicks that
    depend on the user."""
    rng = np.random.default_rng(seed)
    users = 10**12 + rng.integers(0, 300, rows)
    items = np.array([f"item-{i}" for i in rng.integers(0, 80, rows)])
    genres = [[f"g{g}" for g in rng.integers(0, 9, rng.integers(0, 4))] for _ in range(rows)]
    price = rng.normal(0.0, 3.0, rows)
    click = (rng.random(rows) < np.where(users % 3 == 0, 0.6, 0.1)).astype(np.int64)
    return pa.table(
        {"user": users, "item": items, "genres": genres, "price": price, "click": click}
    )


def prepare(tmp, name: str, seed: int):
    raw = tmp / f"{name}.parquet"
    pq.write_table(raw_events(4000, seed), raw)
    report = preprocess(
        PreprocessConfig(
            format="parquet", input=str(raw), output=str(tmp / name), label=["click"], **ROLES
        )
    )
    return raw, report.output


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A DLRM trained a few steps on preprocessed raw events, exported; and its data."""
    tmp = tmp_path_factory.mktemp("raw")
    raw, data = prepare(tmp, "events", seed=0)
    overrides = [
        f"--data.path={data}",
        f"--run.dir={tmp / 'run'}",
        "--train.batch_size=256",
        "--train.max_steps=8",
        "--train.progress_bar=false",
        "--model.embedding_dim=8",
        "--model.dense_arch_layer_sizes=[8]",
        "--model.over_arch_layer_sizes=[8,1]",
        "--run.device=cpu",
    ]
    train(load_config(None, overrides))
    return tmp, raw, data, export_model(tmp / "run", tmp / "model.pt2")


def test_raw_input_is_refused_naming_the_file(model, tmp_path, capsys):
    tmp, raw, _, exported = model
    argv = ["predict", "--model", str(exported), "--input", str(raw)]
    assert main([*argv, "--output", str(tmp_path / "scores.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"'{raw}' was not written by recsys preprocess: its ids are raw values" in err
    assert "add --transform" in err
    assert not (tmp_path / "scores.parquet").exists()


def test_data_of_another_vocabulary_is_refused(model, tmp_path):
    tmp, _, _, exported = model
    _, other = prepare(tmp_path, "other", seed=1)  # fitted on other events: other ids
    with pytest.raises(ValueError, match="preprocessed with another vocabulary"):
        predict(exported, other / "test", tmp_path / "scores.parquet")


def test_transform_scores_raw_input_as_its_preprocessed_form(model, tmp_path):
    tmp, _, data, exported = model
    new = tmp_path / "new_events.parquet"
    pq.write_table(raw_events(700, seed=2).drop(["click"]), new)  # new data, no labels
    report = predict(exported, new, tmp_path / "scores.parquet", transform=True)
    assert report.rows == 700

    applied = preprocess(
        PreprocessConfig(
            apply=str(data),
            format="parquet",
            input=str(new),
            output=str(tmp_path / "applied"),
            valid_fraction=0.0,
            test_fraction=0.0,
        )
    )
    expected = predict(exported, applied.output / "train", tmp_path / "expected.parquet")
    assert expected.rows == 700
    assert pq.read_table(report.output).equals(pq.read_table(expected.output))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "applied",
        "expected.parquet",
        "new_events.parquet",
        "scores.parquet",
    ]  # the temporary transform is gone


def test_transform_finds_moved_training_data_with_data(model, tmp_path, capsys):
    tmp, raw, data, exported = model
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    shutil.move(data, tmp_path / "elsewhere")
    try:
        argv = ["predict", "--model", str(exported), "--input", str(raw), "--transform"]
        assert main([*argv, "--output", str(tmp_path / "a.parquet")]) == 2
        err = capsys.readouterr().err
        assert f"the model's training data '{data}' is not a preprocessed directory" in err
        assert "--data DIR" in err
        assert main([*argv, "--output", str(tmp_path / "b.parquet"), "--data", str(moved)]) == 0
        assert "scored 4,000 rows of 1 file(s)" in capsys.readouterr().out
        scored = pq.read_table(tmp_path / "b.parquet")
        assert scored.column("click").to_pylist() == pq.read_table(raw)["click"].to_pylist()
    finally:
        shutil.move(tmp_path / "elsewhere", data)


def test_transform_of_input_in_another_format_names_the_format_it_read(model, tmp_path, capsys):
    """The model's data was preprocessed from parquet: a CSV of the same events is read as
    parquet unless --format says otherwise, and the error says so."""
    _, raw, _, exported = model
    events = pq.read_table(raw).slice(0, 50).to_pylist()
    lines = ["user,item,genres,price,click"] + [
        f"{e['user']},{e['item']},{'|'.join(e['genres'])},{e['price']},{e['click']}" for e in events
    ]
    csv = tmp_path / "events.csv"
    csv.write_text("\n".join(lines) + "\n")
    argv = ["predict", "--model", str(exported), "--input", str(csv), "--transform"]
    assert main([*argv, "--output", str(tmp_path / "a.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a readable parquet file" in err
    assert f"--transform read '{csv}' as parquet, the format the model's training data" in err
    assert "give --format criteo, parquet or csv" in err
    assert main([*argv, "--output", str(tmp_path / "b.parquet"), "--format", "csv"]) == 0
    assert "scored 50 rows of 1 file(s)" in capsys.readouterr().out
