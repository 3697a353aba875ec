"""End to end: a short run learns close to the oracle and leaves a usable run directory."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys.build.models import build_model
from recsys.checkpoint.io import latest_checkpoint, load_checkpoint
from recsys.cli import main
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.loader import BatchLoader
from recsys.train.metrics import BinaryMetrics, read_metrics
from recsys.train.trainer import train
from tests.train.test_resume import TINY
from tests.train.test_resume import run as run_tiny

SMALL = [
    "--data.synthetic.cardinalities=[100,1000,500,20,3000,50,200,800,10,2000]",
    "--data.synthetic.bag_sizes=[1,1,1,1,1,1,1,1,3,2]",
    "--data.synthetic.num_train_samples=300000",
    "--data.synthetic.num_valid_samples=16384",
    "--data.synthetic.num_test_samples=32768",
    "--train.batch_size=1024",
    "--train.log_every_steps=50",
    "--train.eval_every_steps=150",
    "--model.embedding_dim=8",
    "--model.dense_arch_layer_sizes=[32,8]",
    "--model.over_arch_layer_sizes=[64,1]",
    "--run.device=cpu",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    config = load_config(None, [*SMALL, f"--run.dir={run_dir}", "--run.name=small"])
    result = train(config)
    return config, result


def test_short_run_lands_within_003_of_oracle(finished_run):
    _, result = finished_run
    assert result.test["oracle_auc"] > 0.75
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
    assert result.samples_per_s > 0


def test_run_directory_contents(finished_run):
    config, result = finished_run
    run_dir = Path(config.run.dir)
    assert load_config(run_dir / "config.toml") == config
    events = read_metrics(run_dir / "metrics.jsonl")
    train_events = [e for e in events if e["split"] == "train"]
    assert [e["step"] for e in train_events] == [50, 100, 150, 200, 250, 292]
    for event in train_events:
        assert {"step", "loss", "samples_per_s", "epoch", "time"} <= set(event)
    assert train_events[-1]["loss"] < train_events[0]["loss"]
    valid = [e for e in events if e["split"] == "valid"]
    assert [e["step"] for e in valid] == [150]
    (test,) = [e for e in events if e["split"] == "test"]
    assert test["step"] == 292 and test["num_samples"] == 32768
    assert {"auc", "logloss", "oracle_auc"} <= set(test)
    assert test["auc"] == pytest.approx(result.test["auc"])
    assert result.checkpoint == latest_checkpoint(run_dir / "checkpoints")


def test_checkpoint_reproduces_the_test_metrics(finished_run):
    config, result = finished_run
    dataset = build_dataset(config.data, config.run.seed)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model = build_model(config.model, dataset.spec, torch.device("cpu"))
    state = {"model": model.state_dict(), "step": 0}
    load_checkpoint(result.checkpoint, state)
    model.load_state_dict(state["model"])
    assert state["step"] == 292
    metrics = BinaryMetrics(dataset.spec.label_names, torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        for batch in BatchLoader(dataset, "test", 8192):
            metrics.update(model(batch.dense, batch.sparse), batch.labels)
    assert metrics.compute()["auc"] == pytest.approx(result.test["auc"], abs=1e-6)


def test_cli_user_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["train", "--train.batchsize=4"]) == 2
    assert "did you mean 'train.batch_size'" in capsys.readouterr().err
    too_big = ["--data.synthetic.num_train_samples=100", f"--run.dir={tmp_path}", *SMALL[-1:]]
    assert main(["train", *too_big]) == 2
    assert "larger than the train split" in capsys.readouterr().err


def test_module_entry_point_prints_resolved_config():
    out = subprocess.run(
        [sys.executable, "-m", "recsys", "config", "--train.batch_size=77"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "[train]\nbatch_size = 77" in out


def test_periodic_checkpoints_keep_the_newest(tmp_path):
    config = load_config(
        None,
        [
            "--data.synthetic.cardinalities=[100,200]",
            "--data.synthetic.num_train_samples=20000",
            "--data.synthetic.num_test_samples=5000",
            "--train.batch_size=1000",
            "--checkpoint.every_steps=9",
            "--checkpoint.keep=2",
            f"--run.dir={tmp_path}",
            "--run.device=cpu",
        ],
    )
    result = train(config)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    # 9 was pruned, no temp dirs left, `latest` points at the newest
    assert names == ["latest", "step_00000018", "step_00000020"]
    assert (tmp_path / "checkpoints" / "latest").resolve().name == "step_00000020"
    assert result.checkpoint.name == "step_00000020"


def test_fused_embedding_update_equals_torch_adagrad(tmp_path):
    """The fused Adagrad touches only looked-up rows, where torch's dense Adagrad changes
    nothing else either: the two runs must agree."""
    common = [
        "--data.synthetic.cardinalities=[100,2000,300]",
        "--data.synthetic.bag_sizes=[1,1,3]",
        "--data.synthetic.num_train_samples=30000",
        "--data.synthetic.num_test_samples=8192",
        "--train.batch_size=1000",
        "--train.embedding_optimizer=adagrad",
        "--checkpoint.save_final=false",
        "--run.device=cpu",
    ]
    results = {}
    for fused in (True, False):
        config = load_config(
            None,
            [
                *common,
                f"--train.fused_embedding_update={str(fused).lower()}",
                f"--run.dir={tmp_path / str(fused)}",
            ],
        )
        results[fused] = train(config).test
    assert results[True]["auc"] == pytest.approx(results[False]["auc"], abs=1e-4)
    assert results[True]["logloss"] == pytest.approx(results[False]["logloss"], abs=1e-4)


def test_rowwise_adagrad_trains_and_needs_the_fused_update(tmp_path):
    config = load_config(
        None,
        [
            "--data.synthetic.cardinalities=[100,2000]",
            "--data.synthetic.num_train_samples=20000",
            "--data.synthetic.num_test_samples=5000",
            "--train.embedding_optimizer=rowwise_adagrad",
            "--checkpoint.save_final=false",
            f"--run.dir={tmp_path}",
            "--run.device=cpu",
        ],
    )
    assert train(config).test["auc"] > 0.6
    from recsys.train.optimizers import build_optimizers

    model = build_model(config.model, build_dataset(config.data, 0).spec, torch.device("cpu"))
    config.train.fused_embedding_update = False
    with pytest.raises(ValueError, match="rowwise_adagrad.*only exists as a fused update"):
        build_optimizers(config.train, model)


def test_task_loss_weights_are_checked_and_normalized():
    from recsys.config import TrainConfig
    from recsys.train.optimizers import task_loss_weights

    cpu = torch.device("cpu")
    assert task_loss_weights(TrainConfig(), 2, cpu) is None
    weights = task_loss_weights(TrainConfig(task_loss_weights=[1.0, 3.0]), 2, cpu)
    torch.testing.assert_close(weights, torch.tensor([0.25, 0.75]))
    with pytest.raises(ValueError, match=r"has 1 weights \[1.0\], but the data has 2 task"):
        task_loss_weights(TrainConfig(task_loss_weights=[1.0]), 2, cpu)
    with pytest.raises(ValueError, match="expected weights >= 0 with a positive sum"):
        task_loss_weights(TrainConfig(task_loss_weights=[1.0, -1.0]), 2, cpu)


def test_multi_task_run_weights_the_task_losses(tmp_path):
    """Each task learns only when its loss has weight: swapping the weights swaps which task
    gets the better AUC."""
    test = {}
    for weights in ("[1.0,0.0]", "[0.0,1.0]"):
        config = load_config(
            None,
            [
                "--data.synthetic.cardinalities=[100,2000,300]",
                "--data.synthetic.num_tasks=2",
                "--data.synthetic.num_train_samples=40000",
                "--data.synthetic.num_test_samples=8192",
                "--model.over_arch_layer_sizes=[32,2]",
                f"--train.task_loss_weights={weights}",
                "--checkpoint.save_final=false",
                f"--run.dir={tmp_path / weights}",
                "--run.device=cpu",
            ],
        )
        test[weights] = train(config).test
    assert test["[1.0,0.0]"]["auc_task_0"] > test["[0.0,1.0]"]["auc_task_0"] + 0.1
    assert test["[0.0,1.0]"]["auc_task_1"] > test["[1.0,0.0]"]["auc_task_1"] + 0.1


def test_one_seed_writes_byte_identical_checkpoints(tmp_path):
    """Every generator a checkpoint stores (torch, numpy, Python) is seeded by run.seed."""
    for name in ("a", "b"):
        run_tiny(tmp_path / name, *TINY, "--train.max_steps=3")
    first, second = (tmp_path / n / "checkpoints" / "step_00000003" for n in ("a", "b"))
    files = sorted(p.name for p in first.iterdir() if p.suffix == ".distcp")
    assert files
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
