"""checkpoint.keep_best and train.early_stopping_patience: the best validation's checkpoint is
kept and linked as ``best``, and training stops after N validations without a new best."""

from __future__ import annotations

import math

import pytest

from recsys.checkpoint.io import list_checkpoints, load_model, resolve_checkpoint
from recsys.config import load_config
from recsys.train.best import BestValidation, best_validation
from recsys.train.metrics import read_metrics
from recsys.train.trainer import train
from tests.train.test_resume import TINY


def run(run_dir, *args):
    return train(load_config(None, [f"--run.dir={run_dir}", *args]))


def events(run_dir, split):
    return [e for e in read_metrics(run_dir / "metrics.jsonl") if e["split"] == split]


def test_tracker_improves_strictly_and_counts_since():
    auc = BestValidation("valid_auc")
    assert auc.update(1, {"auc": 0.6})
    assert not auc.update(2, {"auc": 0.6})  # a tie is no improvement
    assert not auc.update(3, {"auc": math.nan})
    assert auc.since == 2 and auc.step == 1
    assert auc.update(4, {"auc": 0.7}) and auc.since == 0
    logloss = BestValidation("valid_logloss")
    assert logloss.update(1, {"logloss": 0.5}) and logloss.update(2, {"logloss": 0.4})
    assert not logloss.update(3, {"logloss": 0.45}) and logloss.step == 2
    copy = BestValidation("valid_logloss")
    copy.load_state_dict(logloss.state_dict())
    assert copy == logloss
    with pytest.raises(ValueError, match="tracked the best valid_logloss"):
        BestValidation("valid_auc").load_state_dict(logloss.state_dict())
    with pytest.raises(ValueError, match="metric = 'auc'"):
        BestValidation("auc")


def test_keep_best_keeps_the_best_validation_beside_the_latest(tmp_path):
    run(
        tmp_path,
        *TINY,
        "--train.max_steps=12",
        "--train.eval_every_steps=2",
        "--model.dense_arch_layer_sizes=[8,16]",
        "--train.dense_lr=0.05",  # noisy enough that valid AUC does not rise every time
        "--checkpoint.every_steps=3",
        "--checkpoint.keep=1",
        "--checkpoint.keep_best=valid_auc",
    )
    valid = events(tmp_path, "valid")
    best = max(valid, key=lambda e: (e["auc"], -e["step"]))  # the first of equal bests
    link = tmp_path / "checkpoints" / "best"
    assert link.is_symlink() and link.resolve().name == f"step_{best['step']:08d}"
    assert resolve_checkpoint("best", tmp_path) == link.resolve()
    steps = [int(p.name[5:]) for p in list_checkpoints(tmp_path / "checkpoints")]
    assert steps == sorted({best["step"], 12})  # keep=1 pruned all but the latest and best
    load_model(resolve_checkpoint(str(link)))  # export and fine-tuning read it like any other


def test_early_stopping_stops_after_patience_validations_without_a_new_best(tmp_path):
    patience = 2
    result = run(
        tmp_path,
        *TINY,
        "--train.epochs=20",
        "--train.eval_every_steps=1",
        "--train.dense_lr=0.05",
        f"--train.early_stopping_patience={patience}",
        "--train.early_stopping_metric=valid_logloss",
    )
    valid = events(tmp_path, "valid")
    best, since, expected = math.inf, 0, None
    for event in valid:
        if event["logloss"] < best:
            best, since = event["logloss"], 0
        else:
            since += 1
            if since == patience:
                expected = event["step"]
                break
    assert expected is not None, "the run never stalled: the test proves nothing"
    assert result.steps == expected
    (stop,) = events(tmp_path, "early_stop")
    assert stop["step"] == expected
    assert events(tmp_path, "test")  # the test evaluation still ran


def test_watching_needs_validations_and_one_metric(tmp_path):
    with pytest.raises(ValueError, match="keep_best needs validations"):
        run(tmp_path, *TINY, "--checkpoint.keep_best=valid_auc")
    with pytest.raises(ValueError, match="watch one metric for both"):
        run(
            tmp_path,
            *TINY,
            "--train.eval_every_steps=1",
            "--checkpoint.keep_best=valid_auc",
            "--train.early_stopping_patience=1",
            "--train.early_stopping_metric=valid_logloss",
        )


def test_ranking_metrics_are_higher_better_and_belong_to_sequence_models():
    hr = BestValidation("valid_hr@10")
    assert hr.update(1, {"hr@10": 0.3, "mrr": 0.1})
    assert not hr.update(2, {"hr@10": 0.29, "mrr": 0.2})
    assert hr.update(3, {"hr@10": 0.31, "mrr": 0.0}) and hr.step == 3
    ctr = ["--train.eval_every_steps=1", "--checkpoint.keep_best=valid_mrr"]
    with pytest.raises(ValueError, match="'dlrm' is evaluated by a CTR metric: pick one of"):
        best_validation(load_config(None, ctr))
    sequence = ["--model.name=hstu", "--train.eval_every_steps=1"]
    patience = [*sequence, "--train.early_stopping_patience=2"]
    with pytest.raises(ValueError, match="train.early_stopping_metric = 'valid_auc'"):
        best_validation(load_config(None, patience))
    metric = "--train.early_stopping_metric=valid_ndcg@10"
    assert best_validation(load_config(None, [*patience, metric])).metric == "valid_ndcg@10"


def test_a_resumed_run_keeps_comparing_with_the_best_before_the_resume(tmp_path):
    common = [
        *TINY,
        "--train.eval_every_steps=2",
        "--train.dense_lr=0.5",  # diverges: the best validation comes before the resume
        "--train.embedding_lr=0.5",
        "--checkpoint.every_steps=2",
        "--checkpoint.keep=1",
        "--checkpoint.keep_best=valid_auc",
    ]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(whole, *common, "--train.max_steps=12")
    run(parts, *common, "--train.max_steps=6")
    run(parts, *common, "--train.max_steps=12", "--checkpoint.resume=latest")
    best_whole = (whole / "checkpoints" / "best").resolve().name
    assert int(best_whole[5:]) <= 6, "the best came after the resume: the test proves nothing"
    assert (parts / "checkpoints" / "best").resolve().name == best_whole
    assert [e["auc"] for e in events(parts, "valid")] == [e["auc"] for e in events(whole, "valid")]
