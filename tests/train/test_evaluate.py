"""`recsys eval`: a checkpoint evaluated on its own data reproduces its run's eval events exactly
(one process and 2 gloo ranks); other preprocessed data is evaluated when its spec matches the
checkpoint's and refused, naming the difference, when it does not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.cli import main
from recsys.config import PreprocessConfig, load_config
from recsys.train.evaluate import evaluate_checkpoint
from recsys.train.metrics import read_metrics
from recsys.train.trainer import train
from tests.distributed.spawn import run_ranks
from tests.distributed.test_torchrun import run_torchrun

TINY = [
    "--data.synthetic.cardinalities=[50,300,1000]",
    "--data.synthetic.bag_sizes=[1,3,1]",
    "--data.synthetic.num_train_samples=8192",
    "--data.synthetic.num_valid_samples=512",
    "--data.synthetic.num_test_samples=1024",
    "--train.batch_size=512",
    "--train.eval_batch_size=384",  # batches that do not divide the splits
    "--train.log_every_steps=4",
    "--train.eval_every_steps=8",  # valid evaluations at steps 8 and 16, the last one
    "--train.progress_bar=false",
    "--run.device=cpu",
    "--data.prefetch_batches=0",
]
METRIC_KEYS = ("auc", "logloss", "num_samples")


def events(run_dir: Path, split: str) -> list[dict]:
    return [e for e in read_metrics(run_dir / "metrics.jsonl") if e["split"] == split]


def metrics_of(event: dict) -> dict:
    """An eval event without what only the log has (split, step, time)."""
    return {k: v for k, v in event.items() if k not in ("split", "step", "time")}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tiny")
    train(load_config(None, [*TINY, f"--run.dir={run_dir}"]))
    return run_dir


def test_eval_reproduces_the_final_test_event_exactly(tiny_run, tmp_path, capsys):
    output = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(tiny_run), "--output", str(output)]) == 0
    (test,) = events(tiny_run, "test")
    written = json.loads(output.read_text())
    assert {k: written[k] for k in metrics_of(test)} == metrics_of(test)  # ==, not approx
    assert set(metrics_of(test)) == {*METRIC_KEYS, "oracle_auc"}
    checkpoint = tiny_run.resolve() / "checkpoints" / "step_00000016"
    assert written["checkpoint"] == str(checkpoint)
    assert (written["step"], written["split"], written["data"]) == (16, "test", "synthetic data")
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"recsys: eval test step 16: auc {test['auc']:.4f} logloss ")
    assert line.endswith(f"1,024 samples of synthetic data; checkpoint {checkpoint}")


def test_valid_split_reproduces_the_last_valid_event(tiny_run):
    result = evaluate_checkpoint(tiny_run / "checkpoints" / "latest", split="valid")
    assert [e["step"] for e in events(tiny_run, "valid")] == [8, 16]
    assert result.metrics == metrics_of(events(tiny_run, "valid")[-1])
    assert result.step == 16


def test_another_eval_batch_size_gives_the_same_auc(tiny_run):
    (test,) = events(tiny_run, "test")
    result = evaluate_checkpoint(tiny_run, ["--train.eval_batch_size=1000"])
    assert result.metrics["num_samples"] == 1024
    assert result.metrics["auc"] == pytest.approx(test["auc"], abs=1e-6)
    assert result.metrics["logloss"] == pytest.approx(test["logloss"], rel=1e-5)


def test_multi_task_metrics_per_task(tmp_path):
    run_dir = tmp_path / "mmoe"
    overrides = ["--model.name=mmoe", "--data.synthetic.num_tasks=2", "--train.max_steps=4"]
    train(load_config(None, [*TINY, *overrides, f"--run.dir={run_dir}"]))
    (test,) = events(run_dir, "test")
    result = evaluate_checkpoint(run_dir)
    assert {"auc_task_0", "auc_task_1", "oracle_auc_task_1"} <= set(result.metrics)
    assert result.metrics == metrics_of(test)
    assert "auc per task: task_0 " in result.summary()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "--data.synthetic.cardinalities=[50,300,999]",
            "synthetic data and checkpoint '.*' do not match: table sizes "
            r"\(checkpoint -> data\): cat_2 1,000 -> 999$",
        ),
        (
            "--data.synthetic.num_tasks=2",
            "labels: 1 in the checkpoint, 2 in the data, missing from the data: click, not in "
            "the checkpoint: task_0, task_1$",
        ),
        (
            "--data.synthetic.num_dense=4",
            "dense features: 13 in the checkpoint, 4 in the data, missing from the data: int_4, "
            "int_5, int_6, int_7, int_8 and 4 more$",
        ),
        ("--model.embedding_dim=4", "model.* keys cannot be overridden"),
        ("--train.eval_batch_sise=4", "did you mean 'train.eval_batch_size'"),
    ],
)
def test_bad_data_or_overrides_are_one_error_line(tiny_run, override, message, capsys):
    assert main(["eval", "--checkpoint", str(tiny_run), "--split", "valid", override]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("recsys: error: ")
    assert re.search(message, line), line


def test_missing_checkpoint_data_or_output_directory(tiny_run, tmp_path, capsys):
    def error(*argv) -> str:
        assert main(["eval", *argv]) == 2
        return capsys.readouterr().err

    assert "checkpoint not found" in error("--checkpoint", str(tmp_path))
    assert "directory" in error("--checkpoint", str(tiny_run), "--output", f"{tmp_path}/no/x")
    assert "data.path not found" in error(
        "--checkpoint", str(tiny_run), f"--data.path={tmp_path}/nothing"
    )


# --- Preprocessed data -------------------------------------------------------------------------


def _write_events(path: Path, rows: int, seed: int) -> None:
    """A CSV click log: odd users click more, so a model has something to learn."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        f.write("user,item,price,click\n")
        for _ in range(rows):
            user, item = rng.integers(30), rng.integers(200)
            click = int(rng.random() < 0.2 + 0.5 * (user % 2))
            f.write(f"u{user},i{item},{rng.random() * 10:.2f},{click}\n")


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory) -> tuple[Path, Path]:
    """(a preprocessed CSV log, new rows transformed with its vocabulary by --apply, without a
    valid split)."""
    from recsys.data.etl import preprocess

    root = tmp_path_factory.mktemp("events")
    _write_events(root / "day_0.csv", 3000, seed=0)
    _write_events(root / "day_1.csv", 2000, seed=1)
    roles = {"categorical": ["user", "item"], "dense": ["price"], "label": ["click"]}
    day_0 = preprocess(
        PreprocessConfig(
            format="csv", input=str(root / "day_0.csv"), output=str(root / "d0"), **roles
        )
    ).output
    day_1 = preprocess(
        PreprocessConfig(
            format="csv",
            input=str(root / "day_1.csv"),
            output=str(root / "d1"),
            apply=str(day_0),
            valid_fraction=0,
        )
    ).output
    return Path(day_0), Path(day_1)


@pytest.fixture(scope="module")
def parquet_run(preprocessed, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("parquet_run")
    day_0, _ = preprocessed
    overrides = [f"--data.path={day_0}", "--train.batch_size=256", "--train.eval_batch_size=64"]
    overrides += ["--model.embedding_dim=4", "--model.dense_arch_layer_sizes=[8,4]"]
    overrides += ["--model.over_arch_layer_sizes=[8,1]", "--train.eval_every_steps=0"]
    overrides += ["--train.epochs=3"]
    train(load_config(None, [*TINY[-3:], *overrides, f"--run.dir={run_dir}"]))
    return run_dir


def test_preprocessed_data_reproduces_its_test_event(parquet_run, preprocessed):
    (test,) = events(parquet_run, "test")
    result = evaluate_checkpoint(parquet_run)
    assert result.metrics == metrics_of(test)
    assert "oracle_auc" not in result.metrics
    assert result.data == f"parquet data '{preprocessed[0]}'"


def test_new_data_of_the_same_vocabulary(parquet_run, preprocessed):
    _, day_1 = preprocessed
    meta = json.loads((day_1 / "metadata.json").read_text())
    result = evaluate_checkpoint(parquet_run, [f"--data.path={day_1}"])
    assert result.metrics["num_samples"] == meta["splits"]["test"]["rows"]
    assert result.metrics["auc"] > 0.6  # what the model learned on day 0 holds on day 1
    assert result.data == f"parquet data '{day_1}'"
    with pytest.raises(ValueError, match=f"the valid split of parquet data '{day_1}' has no rows"):
        evaluate_checkpoint(parquet_run, [f"--data.path={day_1}"], split="valid")


def test_data_of_another_spec_is_refused_naming_the_differences(tiny_run, preprocessed):
    day_0, _ = preprocessed
    with pytest.raises(ValueError) as raised:
        evaluate_checkpoint(tiny_run, [f"--data.path={day_0}"])
    message = str(raised.value)
    assert message.startswith(f"parquet data '{day_0}' and checkpoint '")
    assert "dense features: 13 in the checkpoint, 1 in the data" in message
    assert (
        "categorical features: 3 in the checkpoint, 2 in the data, missing from the data: "
        "cat_0, cat_1, cat_2, not in the checkpoint: user, item"
    ) in message
    assert "vocabulary fingerprint: checkpoint none, data " in message


# --- Several ranks -----------------------------------------------------------------------------


def _two_rank_eval(rank: int, world_size: int, run_dir: str, out: str) -> None:
    result = evaluate_checkpoint(run_dir)  # joins the process group run_ranks set up
    assert torch.distributed.is_initialized()  # and leaves it to its owner
    Path(out, f"rank{rank}.json").write_text(json.dumps(result.to_json()))


@pytest.mark.slow
def test_two_ranks_in_a_process_group_of_the_caller(tiny_run, tmp_path):
    """evaluate_checkpoint inside a job that set up its own process group (here run_ranks's):
    it joins that group and leaves it up. The test split is one chunk: rank 1 has no batch and
    runs the filler forwards that the sharded tables' collectives need."""
    run_ranks(2, _two_rank_eval, str(tiny_run), str(tmp_path))
    (test,) = events(tiny_run, "test")
    for rank in (0, 1):
        metrics = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert metrics["num_samples"] == 1024
        assert metrics["auc"] == pytest.approx(test["auc"], abs=1e-6)
        assert metrics["logloss"] == pytest.approx(test["logloss"], rel=1e-5)


def test_torchrun_two_ranks_reproduce_the_one_process_metrics(tiny_run, tmp_path):
    """The valid split is one chunk: rank 1 has no batch and runs the filler forwards that the
    sharded tables' collectives need; the metrics are gathered over both ranks, rank 0 prints
    and writes. (Approx: a row-wise sharded table sums its partial poolings in another order.)"""
    output = tmp_path / "eval.json"
    done = run_torchrun(
        [
            *("--nproc-per-node=2", "-m", "recsys", "eval", "--checkpoint", str(tiny_run)),
            *("--split", "valid", "--output", str(output)),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("recsys: eval valid step 16") == 1
    expected = metrics_of(events(tiny_run, "valid")[-1])
    written = json.loads(output.read_text())
    assert written["auc"] == pytest.approx(expected["auc"], abs=1e-6)
    assert written["logloss"] == pytest.approx(expected["logloss"], rel=1e-5)
    assert written["num_samples"] == expected["num_samples"]
