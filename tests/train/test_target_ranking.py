"""`recsys train` of the target-aware HSTU ranking recipe end to end: BCE on the synthetic click
process, AUC above chance and below the oracle's in metrics.jsonl, a checkpoint, and the config
errors."""

from pathlib import Path

import pytest

from recsys.config import load_config
from recsys.train.metrics import read_metrics
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


def test_the_recipe_learns_the_click_process_above_chance(tmp_path):
    result = train(_config(tmp_path))
    assert result.steps == 3 * (512 // 32)  # 80 % of 640 users train
    events = read_metrics(tmp_path / "metrics.jsonl")
    (test,) = [e for e in events if e["split"] == "test"]
    valid = [e for e in events if e["split"] == "valid"]
    assert [e["step"] for e in valid] == [16, 32, 48]
    assert test["num_users"] == 64 and 0.7 < test["oracle_auc"] <= 1.0
    assert 0.62 < test["auc"] < test["oracle_auc"], test
    assert any((tmp_path / "checkpoints").iterdir())


def test_other_data_and_several_processes_are_refused(tmp_path):
    from recsys.distributed.parallel import DistributedInfo
    from recsys.train.target_ranking import TargetRankingTask

    config = _config(tmp_path, f"--data.path={tmp_path}")
    with pytest.raises(ValueError, match="trains on the built-in synthetic ranking data only"):
        TargetRankingTask(config, None, DistributedInfo(0, 1, 0), print)
    config = _config(tmp_path)
    with pytest.raises(ValueError, match="trains in one process; this run has 2"):
        TargetRankingTask(config, None, DistributedInfo(0, 2, 0), print)
    config = _config(tmp_path, "--data.synthetic_sequences.id_encoding=raw")
    with pytest.raises(ValueError, match="id_encoding = 'raw'"):
        TargetRankingTask(config, None, DistributedInfo(0, 1, 0), print)
