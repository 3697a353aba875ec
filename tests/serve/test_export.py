"""recsys export / predict: the exported program scores exactly as the trained model, at any
batch size, and predict writes those scores for parquet input."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec import KeyedJaggedTensor

from recsys.checkpoint.io import load_model
from recsys.cli import main
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.batch import Batch
from recsys.data.loader import BatchLoader
from recsys.serve.export import export_model, load_exported, predict
from recsys.train.trainer import train

TINY = [
    "--data.synthetic.cardinalities=[50,300,20,1000]",
    "--data.synthetic.bag_sizes=[1,3,1,2]",  # cat_1 and cat_3 multi-hot, with empty bags
    "--data.synthetic.num_dense=5",
    "--data.synthetic.num_train_samples=20000",
    "--data.synthetic.num_valid_samples=1024",
    "--data.synthetic.num_test_samples=2048",
    "--train.batch_size=512",
    "--train.progress_bar=false",
    "--model.embedding_dim=8",
    "--run.device=cpu",
]
MODELS = {
    "dlrm": ["--model.dense_arch_layer_sizes=[16,8]", "--model.over_arch_layer_sizes=[16,1]"],
    "deepfm": ["--model.dense_arch_layer_sizes=[16,8]", "--model.over_arch_layer_sizes=[16,1]"],
    "mmoe": [
        "--data.synthetic.num_tasks=2",
        "--model.mmoe.num_experts=2",
        "--model.mmoe.expert_layer_sizes=[16]",
        "--model.mmoe.tower_layer_sizes=[8]",
    ],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(name)``: a short run of model ``name`` (trained once per module) as
    (config, TrainResult, its exported .pt2)."""
    runs = {}

    def get(name: str):
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(name)
            overrides = [*TINY, *MODELS[name], f"--model.name={name}", f"--run.dir={run_dir}"]
            config = load_config(None, overrides)
            result = train(config)
            runs[name] = config, result, export_model(run_dir, run_dir / "model.pt2")
        return runs[name]

    return get


def _test_split(config) -> Batch:
    return Batch.concat(
        list(BatchLoader(build_dataset(config.data, config.run.seed), "test", 8192))
    )


@pytest.mark.parametrize("name", MODELS)
def test_exported_scores_equal_the_trained_model(trained, name):
    config, result, exported = trained(name)
    model, spec = load_exported(exported)
    reference = load_model(result.checkpoint)
    test = _test_split(config)
    for size in (1, 2, 37, 512):
        batch = test.slice(100, 100 + size)
        got = model(batch.dense, batch.sparse.values(), batch.sparse.lengths().long())
        with torch.no_grad():
            expected = torch.sigmoid(reference(batch.dense, batch.sparse))
        assert got.shape == (size, spec.num_tasks)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The whole test split through the program reproduces the run's own test AUC.
    scores = model(test.dense, test.sparse.values(), test.sparse.lengths().long())
    aucs = [binary_auroc(scores[:, t], test.labels[:, t].long()) for t in range(spec.num_tasks)]
    assert float(torch.stack(aucs).mean()) == pytest.approx(result.test["auc"], abs=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_empty_bags_and_a_batch_without_ids(trained, name):
    _, result, exported = trained(name)
    model, spec = load_exported(exported)
    reference = load_model(result.checkpoint)
    num_sparse, size = len(spec.sparse_names), 3
    dense = torch.randn(size, spec.num_dense)
    # Sample 1 has no ids at all; the others have bags of 0..2 ids.
    some = torch.tensor([[1, 0, 2]] * num_sparse).reshape(-1)
    ids = torch.cat([torch.randint(n, (3,)) for n in spec.cardinalities])
    for values, lengths in ((ids, some), (ids[:0], torch.zeros_like(some))):
        sparse = KeyedJaggedTensor(list(spec.sparse_names), values, lengths=lengths)
        with torch.no_grad():
            expected = torch.sigmoid(reference(dense, sparse))
        torch.testing.assert_close(model(dense, values, lengths), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", MODELS)
def test_each_collection_is_one_lookup_and_ids_stay_in_their_table(trained, name):
    _, _, exported = trained(name)
    model, spec = load_exported(exported)
    lookups = [n for n in model.graph.nodes if "embedding_bag" in str(n.target)]
    assert len(lookups) == {"dlrm": 1, "deepfm": 2, "mmoe": 1}[name]  # deepfm: + first order
    # An id one past its feature's table fails: the packed matrix's next row is another's.
    values = torch.zeros(len(spec.sparse_names), dtype=torch.int64)
    values[0] = spec.cardinalities[0]
    with pytest.raises(RuntimeError, match="an id outside its feature's table"):
        model(torch.randn(1, spec.num_dense), values, torch.ones_like(values))


def test_the_program_runs_with_torch_alone(trained, tmp_path):
    config, result, exported = trained("dlrm")
    batch = _test_split(config).slice(0, 64)
    inputs = (batch.dense, batch.sparse.values(), batch.sparse.lengths().long())
    torch.save(inputs, tmp_path / "inputs.pt")
    code = (
        "import sys, torch\n"
        "program = torch.export.load(sys.argv[1]).module()\n"
        "torch.save(program(*torch.load(sys.argv[2])), sys.argv[3])\n"
        "assert not any(m.startswith(('recsys', 'torchrec', 'fbgemm')) for m in sys.modules)\n"
    )
    command = [sys.executable, "-c", code, str(exported), str(tmp_path / "inputs.pt")]
    subprocess.run([*command, str(tmp_path / "scores.pt")], check=True)
    with torch.no_grad():
        expected = torch.sigmoid(load_model(result.checkpoint)(batch.dense, batch.sparse))
    torch.testing.assert_close(torch.load(tmp_path / "scores.pt"), expected, rtol=0, atol=0)


def _write_parquet(
    batch: Batch, config, path, row_group_size: int, labels: bool = True, **replace
) -> None:
    """``batch`` as training columns: multi-hot features (bag size > 1) as list columns."""
    spec = build_dataset(config.data, config.run.seed).spec
    num_sparse = len(spec.sparse_names)
    lengths = batch.sparse.lengths().view(num_sparse, -1).numpy()
    values = batch.sparse.values().split(batch.sparse.length_per_key())
    columns = {name: batch.dense[:, j].numpy() for j, name in enumerate(spec.dense_names)}
    for f, name in enumerate(spec.sparse_names):
        ids = values[f].numpy()
        if config.data.synthetic.bag_sizes[f] > 1:
            offsets = np.concatenate([[0], np.cumsum(lengths[f])]).astype(np.int32)
            columns[name] = pa.ListArray.from_arrays(offsets, ids)
        else:
            columns[name] = ids
    if labels:
        columns |= {name: batch.labels[:, t].numpy() for t, name in enumerate(spec.label_names)}
    columns |= replace
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


@pytest.mark.parametrize("name", MODELS)
def test_predict_end_to_end(trained, name, tmp_path, capsys):
    config, result, _ = trained(name)
    test = _test_split(config).slice(0, 1500)
    # Two files with row groups of 450 rows, scored 300 rows at a time (150 at a group's end).
    _write_parquet(test.slice(0, 1000), config, tmp_path / "in" / "a.parquet", 450)
    _write_parquet(test.slice(1000, 1500), config, tmp_path / "in" / "b.parquet", 450)
    model = tmp_path / "model.pt2"
    assert main(["export", "--checkpoint", str(result.run_dir), "--output", str(model)]) == 0
    output = tmp_path / "out" / "scores.parquet"
    argv = ["predict", "--model", str(model), "--input", str(tmp_path / "in")]
    assert main([*argv, "--output", str(output), "--batch-size", "300"]) == 0
    assert "scored 1,500 rows of 2 file(s)" in capsys.readouterr().out
    scored = pq.read_table(output)
    spec = load_exported(model)[1]
    names = [f"score_{n}" for n in spec.label_names]
    assert scored.column_names == names + list(spec.label_names)
    with torch.no_grad():
        expected = torch.sigmoid(load_model(result.checkpoint)(test.dense, test.sparse))
    got = torch.from_numpy(np.stack([scored.column(n).to_numpy() for n in names], axis=1))
    # The program scored batches of 300 rows, the reference all 1500 at once: BLAS may block
    # the matmuls differently, so allow rounding.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    labels = np.stack([scored.column(n).to_numpy() for n in spec.label_names], axis=1)
    assert np.array_equal(labels, test.labels.numpy())
    assert sorted(p.name for p in output.parent.iterdir()) == ["scores.parquet"]


def test_predict_without_labels_writes_scores_only(trained, tmp_path):
    config, _, exported = trained("mmoe")
    test = _test_split(config).slice(0, 100)
    _write_parquet(test.slice(0, 60), config, tmp_path / "in_0.parquet", 64, labels=False)
    _write_parquet(test.slice(60, 100), config, tmp_path / "in_1.parquet", 64, labels=False)
    report = predict(exported, tmp_path / "in_*.parquet", tmp_path / "scores.parquet")
    scored = pq.read_table(report.output)
    assert scored.column_names == ["score_task_0", "score_task_1"] and scored.num_rows == 100
    model, _ = load_exported(exported)
    expected = model(test.dense, test.sparse.values(), test.sparse.lengths().long())
    got = np.stack([scored.column(n).to_numpy() for n in scored.column_names], axis=1)
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-5, atol=1e-6)


def test_user_errors_exit_2_with_one_line(trained, tmp_path, capsys):
    config, _, exported = trained("dlrm")
    test = _test_split(config).slice(0, 50)
    output = tmp_path / "scores.parquet"

    def predict_error(data) -> str:
        argv = ["predict", "--model", str(exported), "--input", str(data)]
        assert main([*argv, "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("recsys: error: ") and err.count("\n") == 1
        assert not output.exists() and list(tmp_path.glob(".tmp-*")) == []
        return err

    _write_parquet(test, config, tmp_path / "full.parquet", 64)
    without = pq.read_table(tmp_path / "full.parquet").drop(["cat_2"])
    pq.write_table(without, tmp_path / "no_cat_2.parquet")
    err = predict_error(tmp_path / "no_cat_2.parquet")
    assert "no column(s) 'cat_2'" in err and "categorical columns ['cat_0', 'cat_1'" in err

    too_big = pa.array(np.full(len(test), 50, dtype=np.int64))  # cat_0 has 50 rows
    _write_parquet(test, config, tmp_path / "ids.parquet", 64, cat_0=too_big)
    assert "cat_0 id 50 is outside its table of 50 rows" in predict_error(tmp_path / "ids.parquet")

    assert "no parquet input found" in predict_error(tmp_path / "nothing-*.parquet")

    argv = ["predict", "--model", str(tmp_path / "none.pt2"), "--input", str(tmp_path)]
    assert main([*argv, "--output", str(output)]) == 2
    assert "exported model not found" in capsys.readouterr().err
    (tmp_path / "bad.pt2").write_text("not a model")
    argv = ["predict", "--model", str(tmp_path / "bad.pt2"), "--input", str(tmp_path)]
    assert main([*argv, "--output", str(output)]) == 2
    assert "bad.pt2' was not written by recsys export" in capsys.readouterr().err

    assert main(["export", "--checkpoint", str(tmp_path), "--output", str(output)]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_a_missing_column_is_never_hinted_at_a_column_the_model_reads(trained, tmp_path, capsys):
    """A file missing cat_2 holds cat_0, cat_1 and cat_3 as themselves: none is a typo of cat_2.
    A column the model does not read (a renamed one) is the hint."""
    config, _, exported = trained("dlrm")
    _write_parquet(_test_split(config).slice(0, 50), config, tmp_path / "full.parquet", 64)
    table = pq.read_table(tmp_path / "full.parquet")
    pq.write_table(table.drop(["cat_2"]), tmp_path / "no_cat_2.parquet")
    renamed = table.rename_columns(["Cat_2" if n == "cat_2" else n for n in table.column_names])
    pq.write_table(renamed, tmp_path / "renamed.parquet")
    argv = ["predict", "--model", str(exported), "--output", str(tmp_path / "out.parquet")]
    assert main([*argv, "--input", str(tmp_path / "no_cat_2.parquet")]) == 2
    err = capsys.readouterr().err
    assert "has no column(s) 'cat_2';" in err and "did you mean" not in err
    assert main([*argv, "--input", str(tmp_path / "renamed.parquet")]) == 2
    assert "has no column(s) 'cat_2' (did you mean 'Cat_2'?)" in capsys.readouterr().err


def test_predict_never_overwrites_its_input_or_an_existing_output(trained, tmp_path, capsys):
    config, _, exported = trained("dlrm")
    data = tmp_path / "in" / "test.parquet"
    _write_parquet(_test_split(config).slice(0, 50), config, data, 64)
    original = data.read_bytes()

    def predict_error(input, output, *extra) -> str:
        argv = ["predict", "--model", str(exported), "--input", str(input)]
        assert main([*argv, "--output", str(output), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("recsys: error: ") and err.count("\n") == 1
        return err

    assert f"output '{data}' is also an input" in predict_error(data, data)
    assert "is also an input" in predict_error(data, data, "--overwrite")
    assert "is also an input" in predict_error(tmp_path / "in" / "*.parquet", data)
    assert "inside the input directory" in predict_error(
        tmp_path / "in", data.with_name("s.parquet")
    )
    assert data.read_bytes() == original

    existing = tmp_path / "scores.parquet"
    existing.write_text("yesterday's scores")
    assert "exists; pass --overwrite to replace it" in predict_error(data, existing)
    assert existing.read_text() == "yesterday's scores"
    argv = ["predict", "--model", str(exported), "--input", str(data), "--output", str(existing)]
    assert main([*argv, "--overwrite"]) == 0
    assert pq.read_table(existing).num_rows == 50

    model = tmp_path / "model.pt2"
    model.write_text("another model")
    argv = ["export", "--checkpoint", str(config.run.dir), "--output", str(model)]
    assert main(argv) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert model.read_text() == "another model"
    assert main([*argv, "--overwrite"]) == 0
    load_exported(model)


def test_a_read_only_output_is_one_line(trained, read_only_dir, tmp_path, capsys):
    config, result, exported = trained("dlrm")
    data = tmp_path / "test.parquet"
    _write_parquet(_test_split(config).slice(0, 50), config, data, 64)
    commands = [
        ["export", "--checkpoint", str(result.run_dir), "--output", f"{read_only_dir}/m.pt2"],
        ["predict", "--model", str(exported), "--input", str(data), "--output",
         f"{read_only_dir}/scores.parquet"],
    ]  # fmt: skip
    for argv in commands:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"recsys: error: cannot write '{read_only_dir}/"), err
        assert "Operation not permitted (a read-only directory or file?)" in err
        assert err.count("\n") == 1


def test_a_full_disk_is_one_line_naming_the_output(trained, small_disk, tmp_path, capsys):
    config, result, exported = trained("dlrm")
    data = tmp_path / "test.parquet"
    _write_parquet(_test_split(config), config, data, 512)  # 2048 rows: 16 KiB of scores
    commands = {
        "model.pt2": ["export", "--checkpoint", str(result.run_dir)],
        "scores.parquet": ["predict", "--model", str(exported), "--input", str(data)],
    }
    for name, argv in commands.items():
        output = small_disk / name
        (small_disk / "ballast").write_bytes(b"x" * (1024 * 1024 - 8 * 1024))  # 8 KiB left
        assert main([*argv, "--output", str(output)]) == 2  # no abort from torch's writer
        err = capsys.readouterr().err
        assert err == (
            f"recsys: error: no space left on the device of '{output}'; free some space and "
            "run again\n"
        )
        assert sorted(p.name for p in small_disk.iterdir()) == ["ballast"]  # nothing half-written
