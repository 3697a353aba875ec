"""Every recipe in configs/ trains, as it is, on data of other shapes than its own: a
categorical-only log (no dense feature, one id per feature: Avazu-like), a multi-hot one (bags
of 0..m ids, empty ones included), one label, and two for the multi-task recipes."""

import math
from pathlib import Path

import pytest
import torch

from recsys.checkpoint.io import load_model
from recsys.config import SEQUENCE_MODELS, TARGET_RANKING_MODELS, load_config
from recsys.data import build_dataset
from recsys.serve.export import export_model, load_exported
from recsys.train.metrics import read_metrics
from recsys.train.trainer import train

# The click-log recipes (sequence models' recipes train on user histories:
# tests/train/test_sequence_training.py and tests/train/test_target_ranking.py).
RECIPES = [
    recipe
    for recipe in sorted(Path(__file__).parents[2].glob("configs/*.toml"))
    if load_config(recipe).model.name not in (*SEQUENCE_MODELS, *TARGET_RANKING_MODELS)
]
MULTI_TASK = {"mmoe_synthetic"}  # recipes whose model takes its number of tasks from the data

TINY = [
    "--data.synthetic.num_train_samples=512",
    "--data.synthetic.num_valid_samples=128",
    "--data.synthetic.num_test_samples=256",
    "--train.batch_size=128",
    "--train.max_steps=3",
    "--train.log_every_steps=1",
    "--train.eval_every_steps=0",
    "--train.progress_bar=false",
    "--run.device=cpu",
]
SHAPES = {
    "categorical_only": [
        "--data.synthetic.num_dense=0",
        "--data.synthetic.cardinalities=[40,30,20,10]",
        "--data.synthetic.bag_sizes=[]",
    ],
    "multi_hot": [
        "--data.synthetic.num_dense=3",
        "--data.synthetic.cardinalities=[40,30,20,10]",
        "--data.synthetic.bag_sizes=[1,3,2,4]",
    ],
}
CASES = [
    (recipe, shape, num_tasks)
    for recipe in RECIPES
    for shape in SHAPES
    for num_tasks in ([1, 2] if recipe.stem in MULTI_TASK else [1])
]


def overrides(shape, num_tasks, run_dir, *extra):
    return [
        *TINY,
        *SHAPES[shape],
        f"--data.synthetic.num_tasks={num_tasks}",
        f"--run.dir={run_dir}",
        "--checkpoint.save_final=false",
        *extra,
    ]


def train_losses(run_dir):
    return [
        e["loss"] for e in read_metrics(Path(run_dir) / "metrics.jsonl") if e["split"] == "train"
    ]


def test_every_recipe_is_covered():
    assert len(RECIPES) >= 8 and {r.stem for r in RECIPES} >= {"dlrm_synthetic", *MULTI_TASK}


@pytest.mark.parametrize(
    ("recipe", "shape", "num_tasks"),
    CASES,
    ids=[f"{r.stem}-{s}-{t}label" for r, s, t in CASES],
)
def test_recipe_trains_on_other_data_shapes(recipe, shape, num_tasks, tmp_path):
    config = load_config(recipe, overrides(shape, num_tasks, tmp_path))
    result = train(config)
    losses = train_losses(tmp_path)
    assert result.steps == 3 and len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses), losses
    assert 0.0 <= result.test["auc"] <= 1.0 and result.test["num_samples"] == 256
    if num_tasks > 1:
        assert {"auc_task_0", "auc_task_1"} <= set(result.test)


def test_mmoe_recipe_weighs_its_tasks_equally(tmp_path):
    """The recipe leaves train.task_loss_weights empty (so one-label data runs): the same loss
    as the [1.0, 1.0] it used to set, up to rounding (a mean over [B, T] against a weighted sum
    of per-task means)."""
    recipe = Path(__file__).parents[2] / "configs/mmoe_synthetic.toml"
    assert load_config(recipe).train.task_loss_weights == []
    weighted = [
        *overrides("multi_hot", 2, tmp_path / "weighted"),
        "--train.task_loss_weights=[1,1]",
    ]
    train(load_config(recipe, overrides("multi_hot", 2, tmp_path / "equal")))
    train(load_config(recipe, weighted))
    equal, weighted = train_losses(tmp_path / "equal"), train_losses(tmp_path / "weighted")
    assert equal == pytest.approx(weighted, rel=1e-5)


def test_categorical_only_checkpoint_exports(tmp_path):
    recipe = Path(__file__).parents[2] / "configs/dlrm_synthetic.toml"
    config = load_config(
        recipe, [*overrides("categorical_only", 1, tmp_path), "--checkpoint.save_final=true"]
    )
    result = train(config)
    exported, spec = load_exported(export_model(tmp_path, tmp_path / "model.pt2"))
    assert spec.num_dense == 0
    reference = load_model(result.checkpoint)
    test = build_dataset(config.data, config.run.seed).chunk("test", 0)
    for size in (1, 2, 37, 256):
        batch = test.slice(0, size)
        assert batch.dense.shape == (size, 0)
        got = exported(batch.dense, batch.sparse.values(), batch.sparse.lengths().long())
        with torch.no_grad():
            expected = torch.sigmoid(reference(batch.dense, batch.sparse))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
