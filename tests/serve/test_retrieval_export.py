"""recsys export / predict of a sequence model: the top-K items of each history, from a
torch.export program that agrees with the trained model's ranking."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys.checkpoint.io import latest_checkpoint, load_model
from recsys.config import load_config
from recsys.data.keys import value_keys
from recsys.distributed.parallel import DistributedInfo
from recsys.models.next_item import corpus_keys
from recsys.serve.export import export_model, load_exported, predict
from recsys.serve.retrieval_export import TopKModule, load_item_encoding, load_retrieval
from recsys.serve.triton_export import export_triton
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
        predict(model_path, tmp_path, tmp_path / "out.parquet", transform=True, format="csv")
    pq.write_table(pa.table({"user": ["a"]}), tmp_path / "no_items.parquet")
    with pytest.raises(ValueError, match="has no 'items' column"):
        predict(model_path, tmp_path / "no_items.parquet", tmp_path / "out.parquet")
    with pytest.raises(ValueError, match="item ids span \\[3, 99\\]"):
        predict(model_path, _histories(tmp_path, [[3, 99]]), tmp_path / "out.parquet")
    raw = pa.table({"user": ["a"], "items": pa.array([["item-188", "item-7"]])})
    pq.write_table(raw, tmp_path / "raw.parquet")
    with pytest.raises(ValueError, match="hold string values, not the item ids .* --transform"):
        predict(model_path, tmp_path / "raw.parquet", tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_a_sequence_export_is_refused_where_a_ctr_program_is_loaded(exported):
    # (recsys serve and load_exported score CTR rows, not histories)
    _, _, model_path = exported
    with pytest.raises(ValueError, match=r"sequence model's export \(retrieval.json inside\)"):
        load_exported(model_path)


def test_top_k_is_an_export_and_predict_option(exported, tmp_path):
    root, _, model_path = exported
    corpus = load_retrieval(model_path)[1]["corpus"]
    for bad in (0, corpus + 1):
        with pytest.raises(ValueError, match=f"top_k = {bad}; expected 1 <= top_k <= {corpus}"):
            export_model(root / "run", tmp_path / "bad.pt2", top_k=bad)
    five = export_model(root / "run", tmp_path / "five.pt2", top_k=5)
    assert load_retrieval(five)[1]["top_k"] == 5
    histories = _histories(tmp_path, [[5, 9, 4], [7]])
    predict(model_path, histories, tmp_path / "all.parquet")
    predict(five, histories, tmp_path / "three.parquet", top_k=3)
    every = pq.read_table(tmp_path / "all.parquet")["top_items"].to_pylist()
    three = pq.read_table(tmp_path / "three.parquet")["top_items"].to_pylist()
    assert three == [top[:3] for top in every]
    with pytest.raises(
        ValueError, match="top_k = 6; .* export the checkpoint again with --top-k 6"
    ):
        predict(five, histories, tmp_path / "six.parquet", top_k=6)
    with pytest.raises(ValueError, match=f"top_k = 0; .* the model ranks {corpus} items"):
        predict(five, histories, tmp_path / "none.parquet", top_k=0)


def test_predict_from_raw_item_histories(exported, tmp_path):
    """Raw item values go through the training data's encoding: the same top items as the
    encoded histories, given back as the items' own values (categorify)."""
    _, _, model_path = exported
    encoding = load_item_encoding(model_path)
    assert encoding.encoding == "categorify"
    rows = [[5, 9, 4], [], [12, 3, 3, 40, 2]]  # 2: the rare id, an item unseen in training
    predict(model_path, _histories(tmp_path, rows), tmp_path / "ids.parquet", top_k=7)
    unseen = "an item no one saw"
    names = [
        [encoding.decode(np.array([i])).to_pylist()[0] if i >= 3 else unseen for i in r]
        for r in rows
    ]
    pq.write_table(pa.table({"items": pa.array(names)}), tmp_path / "raw.parquet")
    predict(
        model_path, tmp_path / "raw.parquet", tmp_path / "raw_top.parquet", transform=True, top_k=7
    )
    by_id = pq.read_table(tmp_path / "ids.parquet")["top_items"].to_pylist()
    by_name = pq.read_table(tmp_path / "raw_top.parquet")["top_items"].to_pylist()
    assert by_name == [encoding.decode(np.array(top)).to_pylist() for top in by_id]
    assert all(isinstance(item, str) and item.startswith("i") for top in by_name for item in top)


@pytest.mark.slow
def test_a_dynamic_item_table_exports_its_keys_and_reads_raw_items(tmp_path):
    """Raw item keys: the corpus is the keys the table held at the checkpoint; raw item values
    and their keys give the same top items; an item never trained reads the zero row."""
    result = train(
        load_config(
            None,
            [*TINY, "--data.synthetic_sequences.id_encoding=raw", f"--run.dir={tmp_path / 'run'}"],
        )
    )
    model_path = export_model(tmp_path / "run", tmp_path / "model.pt2", top_k=10)
    info = load_retrieval(model_path)[1]
    assert info["dynamic"] and info["corpus"] == 60 and result.test["hr@10"] > 0
    names = [["i3", "i17", "i4"], ["i8", "never seen"], []]
    pq.write_table(pa.table({"items": pa.array(names)}), tmp_path / "raw.parquet")
    keys = [value_keys(pa.array(n, pa.string())).tolist() for n in names]
    predict(model_path, tmp_path / "raw.parquet", tmp_path / "by_name.parquet", transform=True)
    predict(model_path, _histories(tmp_path, keys), tmp_path / "by_key.parquet")
    other_unknown = [[keys[1][0], int(value_keys(pa.array(["another unseen one"]))[0])]]
    predict(model_path, _histories(tmp_path, other_unknown), tmp_path / "unknown.parquet")
    by_name = pq.read_table(tmp_path / "by_name.parquet").to_pydict()
    by_key = pq.read_table(tmp_path / "by_key.parquet").to_pydict()
    unknown = pq.read_table(tmp_path / "unknown.parquet").to_pydict()
    assert by_name["top_items"] == by_key["top_items"]
    corpus = set(value_keys(pa.array([f"i{i}" for i in range(60)])).tolist())
    assert all(len(top) == 10 and set(top) <= corpus for top in by_key["top_items"])
    # Items never trained read the zero row: one unknown item is as good as another.
    assert by_key["top_items"][1] == unknown["top_items"][0]
    np.testing.assert_allclose(by_key["top_scores"][1], unknown["top_scores"][0], rtol=1e-5)
    assert by_key["top_scores"][2] == [0.0] * 10  # an empty history: the zero user vector


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_a_tiered_item_table_exports_its_rows_into_the_program(dynamic, tmp_path):
    """A disk-tier item table (fixed, or dynamic: raw item keys) behind a cache smaller than
    it: the export reads its rows from the checkpoint's store into the program, whose top
    items and scores are the trained model's (the checkpoint loaded with its tiered table)."""
    from recsys.checkpoint.io import latest_checkpoint, load_model
    from recsys.models.next_item import corpus_keys
    from recsys.serve.retrieval_export import TopKModule

    tiered = ["--model.storage.tier=disk", "--model.storage.cache_rows=58"]
    if dynamic:
        tiered.append("--data.synthetic_sequences.id_encoding=raw")
    run_dir = tmp_path / "run"
    train(load_config(None, [*TINY, *tiered, f"--run.dir={run_dir}"]))
    model_path = export_model(run_dir, tmp_path / "model.pt2", top_k=10)
    info = load_retrieval(model_path)[1]
    assert info["dynamic"] == dynamic and info["corpus"] == 60
    run = load_config(run_dir / "config.toml")
    task = NextItemTask(run, torch.device("cpu"), DistributedInfo(0, 1, 0), print)
    test = task.data.splits["test"]
    ends = list(zip(test.offsets[:-1], test.offsets[1:], strict=True))[:40]
    rows = [test.values[a:b].tolist()[-10:] for a, b in ends] + [[]]
    predict(model_path, _histories(tmp_path, rows), tmp_path / "top.parquet")
    out = pq.read_table(tmp_path / "top.parquet").to_pydict()
    trained = load_model(latest_checkpoint(run_dir / "checkpoints"), device="cpu").eval()
    keys = trained.item_keys()
    first = info["first_item"]
    reference = TopKModule(trained, 10, first, None if keys is None else corpus_keys(keys, first))
    values = torch.tensor([i for r in rows for i in r], dtype=torch.int64)
    with torch.no_grad():
        top, scores = reference(values, torch.tensor([len(r) for r in rows]))
    assert out["top_items"] == top.tolist()
    np.testing.assert_allclose(out["top_scores"], scores.numpy(), rtol=1e-5, atol=1e-6)


def test_a_time_bias_model_exports_with_a_times_input(tmp_path):
    """hstu with position + time bias: the program takes the events' times as a third input,
    predict reads them from the histories' ``times`` column (the test split's reproduces the
    run's test HR@10), and refuses histories without them."""
    timed = [
        "--model.name=hstu",
        "--model.sequence.relative_bias=true",
        "--model.sequence.time_bias=true",
        "--train.epochs=1",
    ]
    result = train(load_config(None, [*TINY, *timed, f"--run.dir={tmp_path / 'run'}"]))
    model_path = export_model(tmp_path / "run", tmp_path / "model.pt2")
    info = load_retrieval(model_path)[1]
    assert info["times"]
    run = load_config(tmp_path / "run" / "config.toml")
    task = NextItemTask(run, torch.device("cpu"), DistributedInfo(0, 1, 0), print)
    test = task.data.splits["test"]
    ends = list(zip(test.offsets[:-1], test.offsets[1:], strict=True))
    items = pa.array([test.values[a:b].tolist() for a, b in ends], pa.list_(pa.int64()))
    times = pa.array([test.times[a:b].tolist() for a, b in ends], pa.list_(pa.float64()))
    pq.write_table(pa.table({"items": items, "times": times}), tmp_path / "test.parquet")
    predict(model_path, tmp_path / "test.parquet", tmp_path / "top.parquet")
    top = pq.read_table(tmp_path / "top.parquet")["top_items"].to_pylist()
    hits = [target in t[:10] for target, t in zip(test.targets, top, strict=True)]
    assert np.mean(hits) == pytest.approx(result.test["hr@10"], abs=1.5 / len(hits))

    history = pa.array([[5, 9, 4]], pa.list_(pa.int64()))
    for name, seconds in (("close", [0.0, 1.0, 2.0]), ("far", [0.0, 1e6, 2e6])):
        row = pa.table({"items": history, "times": pa.array([seconds], pa.list_(pa.float64()))})
        pq.write_table(row, tmp_path / f"{name}.parquet")
        predict(model_path, tmp_path / f"{name}.parquet", tmp_path / f"{name}_top.parquet")
    scores = [
        pq.read_table(tmp_path / f"{n}_top.parquet")["top_scores"][0] for n in ("close", "far")
    ]
    assert scores[0].as_py() != scores[1].as_py()  # the times reach the model
    with pytest.raises(ValueError, match="has no 'times' column; .* reads each event's time"):
        predict(model_path, _histories(tmp_path, [[5, 9, 4]]), tmp_path / "out.parquet")
    bad = pa.table({"items": history, "times": pa.array([[0.0, 1.0]], pa.list_(pa.float64()))})
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="row 0 has 2 times and 3 items"):
        predict(model_path, tmp_path / "bad.parquet", tmp_path / "out.parquet")


@pytest.mark.slow
def test_a_triton_repository_of_a_sequence_model_returns_the_programs_top_items(exported, tmp_path):
    """export --format triton of a sasrec run: config.pbtxt names the program's arguments,
    and the AOTInductor package gives the top-K of the exported program."""
    root, _, model_path = exported
    model = export_triton(root / "run", tmp_path / "models", name="sasrec")
    text = (model / "config.pbtxt").read_text()
    assert "# INPUT__0 values, INPUT__1 lengths (the program's" in text
    assert text.count("TYPE_INT64") == 3 and "TYPE_FP32" in text  # ids, lengths, top ids
    package = torch._inductor.aoti_load_package(str(model / "1" / "model.pt2"))
    program, info = load_retrieval(model_path)
    first = info["first_item"]
    values = torch.arange(first, first + 9) % info["num_items"]
    lengths = torch.tensor([3, 0, 6])
    want, got = program(values, lengths), package(values, lengths)
    assert torch.equal(want[0], got[0])
    torch.testing.assert_close(want[1], got[1])


@pytest.mark.parametrize("encoding", ["index", "raw"])
def test_an_export_of_a_run_that_excludes_the_history_never_returns_it(encoding, tmp_path):
    """exclude_history: the program takes each whole history as ``seen`` and returns the top
    items of the rest: the model's whole ranking (an unmasked program of every item) with the
    history's items taken out."""
    run_dir = tmp_path / "run"
    options = [
        *TINY,
        "--train.next_item.exclude_history=true",
        f"--data.synthetic_sequences.id_encoding={encoding}",
        f"--run.dir={run_dir}",
    ]
    train(load_config(None, options))
    model_path = export_model(run_dir, tmp_path / "model.pt2", top_k=20)
    info = load_retrieval(model_path)[1]
    assert info["exclude_history"] and info["top_k"] == 20
    config = load_config(run_dir / "config.toml")
    task = NextItemTask(config, torch.device("cpu"), DistributedInfo(), print)
    test = task.data.splits["test"]
    ends = zip(test.offsets[:-1], test.offsets[1:], strict=True)
    rows = [test.values[a:b].tolist() for a, b in ends]
    assert max(map(len, rows)) > 10  # longer than what the model reads
    predict(model_path, _histories(tmp_path, rows), tmp_path / "top.parquet")
    top = pq.read_table(tmp_path / "top.parquet").to_pydict()
    model = load_model(latest_checkpoint(run_dir / "checkpoints"), device="cpu").eval()
    keys = model.item_keys()
    keys = None if keys is None else corpus_keys(keys, task.data.first_item)
    everything = TopKModule(model, info["corpus"], task.data.first_item, keys)
    with torch.no_grad():
        for row, items, scores in zip(rows, top["top_items"], top["top_scores"], strict=True):
            assert not set(items) & set(row)
            read = torch.tensor(row[-10:])
            ranked, all_scores = everything(read, torch.tensor([len(read)]))
            kept = [
                (i, x)
                for i, x in zip(ranked[0].tolist(), all_scores[0].tolist(), strict=True)
                if i not in row
            ]
            np.testing.assert_allclose(scores, [x for _, x in kept[:20]], rtol=1e-5, atol=1e-6)
