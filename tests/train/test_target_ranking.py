"""`recsys train` of the target-aware HSTU ranking recipe end to end: BCE on the synthetic click
process, AUC above chance and below the oracle's in metrics.jsonl, a checkpoint that `recsys
eval` scores as the run did and that exports to a program `recsys predict` scores candidates
with, training under torchrun, and the config errors."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from recsys.config import load_config
from recsys.distributed.parallel import DistributedInfo
from recsys.serve.export import export_model, load_exported, predict
from recsys.train.evaluate import evaluate_checkpoint
from recsys.train.metrics import read_metrics
from recsys.train.target_ranking import TargetRankingTask
from recsys.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--model.embedding_dim=16",
    "--model.sequence.max_len=20",
    "--model.sequence.num_candidates=6",
    "--model.sequence.num_blocks=1",
    "--data.synthetic_sequences.num_users=640",
    "--data.synthetic_sequences.num_items=100",
    "--data.synthetic_sequences.num_topics=5",
    "--data.synthetic_sequences.mean_events=10",
    "--data.synthetic_sequences.max_events=30",
    "--train.batch_size=32",
    "--train.epochs=3",
    "--train.log_every_steps=8",
    "--train.eval_every_steps=16",
    "--train.progress_bar=false",
    "--run.device=cpu",
    "--run.tensorboard=false",
]


def _config(run_dir: Path, *extra: str):
    recipe = REPO / "configs" / "hstu_ranking_synthetic.toml"
    return load_config(recipe, [*SMALL, f"--run.dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ranking")
    return run_dir, train(_config(run_dir))


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    return export_model(trained[0], tmp_path_factory.mktemp("export") / "model.pt2")


def _test_event(run_dir: Path) -> dict:
    (test,) = [e for e in read_metrics(run_dir / "metrics.jsonl") if e["split"] == "test"]
    return test


def test_the_recipe_learns_the_click_process_above_chance(trained):
    tmp_path, result = trained
    assert result.steps == 3 * (512 // 32)  # 80 % of 640 users train
    events = read_metrics(tmp_path / "metrics.jsonl")
    (test,) = [e for e in events if e["split"] == "test"]
    valid = [e for e in events if e["split"] == "valid"]
    assert [e["step"] for e in valid] == [16, 32, 48]
    assert test["num_users"] == 64 and 0.7 < test["oracle_auc"] <= 1.0
    assert 0.62 < test["auc"] < test["oracle_auc"], test
    assert any((tmp_path / "checkpoints").iterdir())


def test_recsys_eval_reproduces_the_test_event(trained):
    run_dir, _ = trained
    result = evaluate_checkpoint(run_dir)
    assert result.metrics == {k: v for k, v in _test_event(run_dir).items() if k in result.metrics}
    assert set(result.metrics) == {"auc", "logloss", "oracle_auc", "num_users"}
    assert result.data == "synthetic interaction log"
    assert result.summary().startswith(f"eval test step 48: auc {result.metrics['auc']:.4f} ")
    valid = evaluate_checkpoint(run_dir, split="valid").metrics
    assert valid["num_users"] == 64 and valid["auc"] != result.metrics["auc"]


def test_the_export_scores_the_candidates_as_the_run_did(trained, exported, tmp_path):
    run_dir, _ = trained
    model_path = exported
    config = load_config(run_dir / "config.toml")
    task = TargetRankingTask(config, torch.device("cpu"), DistributedInfo(0, 1, 0), print)
    samples, users = task.samples, task.users["test"]
    histories = [
        samples.items[samples.offsets[u] : samples.offsets[u + 1]].tolist() for u in users
    ]  # whole: predict keeps the latest max_len
    table = pa.table(
        {
            "user": [f"u{u}" for u in users],
            "items": pa.array(histories, pa.list_(pa.int64())),
            "candidates": pa.array(samples.candidates[users].tolist(), pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, tmp_path / "test.parquet")
    report = predict(model_path, tmp_path / "test.parquet", tmp_path / "scores.parquet")
    assert report.columns == ["user", "candidates", "score_click"]
    out = pq.read_table(tmp_path / "scores.parquet").to_pydict()
    assert out["user"] == table["user"].to_pylist()
    scores = torch.tensor(out["score_click"])  # [users, candidates]
    auc = float(
        binary_auroc(scores.ravel(), torch.from_numpy(samples.labels[users].ravel()).long())
    )
    assert auc == pytest.approx(_test_event(run_dir)["auc"], abs=1e-4)

    # one candidate alone scores as it did in its list
    first = [[samples.candidates[users[0]][2]]]
    alone = pa.table({"items": table["items"][:1], "candidates": first})
    pq.write_table(alone, tmp_path / "alone.parquet")
    predict(model_path, tmp_path / "alone.parquet", tmp_path / "alone_scores.parquet")
    single = pq.read_table(tmp_path / "alone_scores.parquet")["score_click"].to_pylist()[0][0]
    assert single == pytest.approx(out["score_click"][0][2], abs=1e-6)


def test_predict_refuses_what_a_ranking_export_does_not_read(trained, exported, tmp_path):
    run_dir, model_path = trained[0], exported
    with pytest.raises(ValueError, match="top_k = 5: a hstu_ranking model scores the candidates"):
        export_model(run_dir, tmp_path / "top.pt2", top_k=5)
    with pytest.raises(ValueError, match="ranking model's export: .* without top_k"):
        predict(model_path, tmp_path, tmp_path / "out.parquet", top_k=3)
    pq.write_table(pa.table({"items": [[1, 2]]}), tmp_path / "no_candidates.parquet")
    with pytest.raises(ValueError, match="has no 'candidates' column"):
        predict(model_path, tmp_path / "no_candidates.parquet", tmp_path / "out.parquet")
    rows = {"items": [[1, 2]], "candidates": [list(range(7))]}
    pq.write_table(pa.table(rows), tmp_path / "many.parquet")
    with pytest.raises(ValueError, match="row 0 has 7 candidates; the model scores at most 6"):
        predict(model_path, tmp_path / "many.parquet", tmp_path / "out.parquet")
    pq.write_table(pa.table({"items": [[1, 100]], "candidates": [[3]]}), tmp_path / "big.parquet")
    with pytest.raises(ValueError, match="items ids span \\[1, 100\\]; .* has 100 rows"):
        predict(model_path, tmp_path / "big.parquet", tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()
    # recsys serve (and load_exported) score CTR rows: a ranking export is refused there
    with pytest.raises(ValueError, match=r"sequence model's export \(ranking.json inside\)"):
        load_exported(model_path)


def test_ranks_deal_out_whole_global_batches_and_every_eval_user(tmp_path):
    config = _config(tmp_path)
    tasks = [TargetRankingTask(config, None, DistributedInfo(r, 2, r), print) for r in (0, 1)]
    one = TargetRankingTask(config, None, DistributedInfo(0, 1, 0), print)
    (one_epoch,), two = [one.loader("train").batches], [t.loader("train").batches for t in tasks]
    assert len(two[0]) == len(two[1]) == 512 // 64 and len(one_epoch) == 512 // 32
    dealt = np.concatenate([np.concatenate([a, b]) for a, b in zip(*two, strict=True)])
    assert np.array_equal(dealt, np.concatenate(one_epoch))  # the same users, the same order
    valid = [np.concatenate(t.loader("valid").batches) for t in tasks]
    assert sorted(np.concatenate(valid).tolist()) == sorted(one.users["valid"].tolist())


def test_other_data_is_refused(tmp_path):
    config = _config(tmp_path, f"--data.path={tmp_path}")
    with pytest.raises(ValueError, match="trains on the built-in synthetic ranking data only"):
        TargetRankingTask(config, None, DistributedInfo(0, 1, 0), print)
    config = _config(tmp_path, "--data.synthetic_sequences.id_encoding=raw")
    with pytest.raises(ValueError, match="id_encoding = 'raw'"):
        TargetRankingTask(config, None, DistributedInfo(0, 1, 0), print)


@pytest.mark.slow  # ~1-2 min on 2 cores
def test_two_rank_training_shards_the_items_and_evaluates_every_user(tmp_path):
    """Under torchrun the item table is sharded, each rank trains its slice of every global
    batch and scores its share of the users; the checkpoint evaluates in one process to the
    run's test metrics."""
    from tests.distributed.test_torchrun import run_torchrun

    run_dir = tmp_path / "two"
    overrides = [o for o in SMALL if not o.startswith("--train.batch_size")]
    recipe = REPO / "configs" / "hstu_ranking_synthetic.toml"
    done = run_torchrun(
        [
            *("--nproc-per-node=2", "-m", "recsys", "train", "--config", str(recipe)),
            *overrides,
            "--data.synthetic_sequences.num_users=650",  # 65 valid / test users
            "--train.batch_size=16",
            "--train.eval_batch_size=16",  # 33 users on rank 0, 32 on rank 1: a batch fewer
            f"--run.dir={run_dir}",
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(kind in done.stdout for kind in ("COLUMN_WISE", "ROW_WISE", "TABLE_WISE"))
    test = _test_event(run_dir)
    assert test["num_users"] == 65 and 0.6 < test["auc"] < test["oracle_auc"]
    again = evaluate_checkpoint(run_dir).metrics  # in this one process
    assert again["auc"] == pytest.approx(test["auc"], abs=1e-6)
    assert again["logloss"] == pytest.approx(test["logloss"], rel=1e-5)
