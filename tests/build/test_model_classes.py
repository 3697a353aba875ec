"""Model classes of the user's in `recsys train`: the models guide's DLRMModule from a file in the
working directory (one process, kill -9 and resume bitwise, 2 gloo ranks, `recsys eval`,
export and `recsys serve`), TorchRec's DLRM by name, and every misfit refused in one line
before training (the example package's entry point: tests/build/test_model_package.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.build.models import build_model
from recsys.build.registry import resolve_model
from recsys.config import ModelConfig, load_config
from recsys.data.batch import DatasetSpec
from recsys.serve.export import load_exported
from recsys.train.metrics import read_metrics
from recsys.train.trainer import train
from tests.kill_9 import kill_9_after

REPO = Path(__file__).resolve().parents[2]
RECSYS = [sys.executable, "-c", "import sys; from recsys.cli import main; sys.exit(main())"]
"""`recsys` as its console script runs it: the working directory is not on sys.path."""
SMALL = [
    "--data.synthetic.num_train_samples=16384",
    "--data.synthetic.num_valid_samples=2048",
    "--data.synthetic.num_test_samples=4096",
    "--train.batch_size=512",
    "--train.log_every_steps=1",
    "--train.eval_every_steps=0",
    "--train.progress_bar=false",
    "--run.device=cpu",
    "--run.tensorboard=false",
    "--data.prefetch_batches=0",
]
SPEC = DatasetSpec(("d0", "d1"), ("a", "b", "c"), (5, 7, 3), ("click",))


def readme_model_source() -> str:
    """The models guide's ``DLRMModule`` example, as a user copies it into a file."""
    blocks = re.findall(
        r"```python\n(.*?)```", (REPO / "docs" / "guides" / "models.md").read_text(), re.S
    )
    (source,) = [b for b in blocks if "class DLRMModule(nn.Module)" in b]
    return source


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user's directory holding ``mymodels.py`` (the README's model) and nothing else."""
    directory = tmp_path_factory.mktemp("project")
    (directory / "mymodels.py").write_text(readme_model_source())
    return directory


def recsys_cli(project: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [*RECSYS, *args], cwd=project, env=env, capture_output=True, text=True, timeout=timeout
    )


def losses(run_dir: Path) -> dict[int, float]:
    events = read_metrics(run_dir / "metrics.jsonl")
    return {e["step"]: e["loss"] for e in events if e["split"] == "train"}


README_RUN = [
    "train",
    "--config",
    str(REPO / "configs" / "dlrm_synthetic.toml"),
    "--model.name=mymodels:DLRMModule",
    *SMALL,
]


def test_the_readme_model_trains_resumes_after_kill_9_exports_and_serves(project):
    reference = recsys_cli(project, *README_RUN, "--run.dir=reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "recsys: training mymodels:DLRMModule on synthetic data for 32 steps" in (
        reference.stdout
    )
    expected = losses(project / "reference")
    assert sorted(expected) == list(range(1, 33))

    # kill -9 after the checkpoint of step 8, then resume = "latest"
    command = [*RECSYS, *README_RUN, "--run.dir=killed", "--checkpoint.every_steps=8"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    kill_9_after(
        command, project / "killed" / "checkpoints" / "step_00000008", cwd=project, env=env
    )
    resumed = recsys_cli(project, *README_RUN, "--run.dir=killed", "--checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(project / "killed") == expected  # bitwise, every step

    # recsys eval and export import mymodels from the working directory too
    evaluated = recsys_cli(project, "eval", "--checkpoint", "reference")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "auc" in evaluated.stdout
    exported = recsys_cli(project, "export", "--checkpoint", "reference", "--output", "model.pt2")
    assert exported.returncode == 0, exported.stderr[-3000:]
    module, spec = load_exported(project / "model.pt2")  # no import of mymodels needed
    assert spec.num_dense == 13 and len(spec.sparse_names) == 26

    from tests.serve.test_server import Server

    server = Server(project, "--model", str(project / "model.pt2"))
    try:
        rng = np.random.default_rng(0)
        dense = rng.standard_normal((3, 13)).astype(np.float32)
        lengths = np.ones((3, 26), np.int64)
        values = rng.integers(0, 3, 3 * 26)  # sample-major, every feature has ids 0..2
        columns = {
            "dense": ("FP32", dense),
            "lengths": ("INT64", lengths),
            "values": ("INT64", values),
        }
        body = {
            "inputs": [
                {
                    "name": name,
                    "datatype": kind,
                    "shape": list(data.shape),
                    "data": data.ravel().tolist(),
                }
                for name, (kind, data) in columns.items()
            ]
        }
        status, answer = server.post("/v2/models/recsys/infer", body)
        assert status == 200, answer
        key_major = values.reshape(3, 26).T.ravel()
        with torch.no_grad():
            expected_scores = module(
                torch.from_numpy(dense),
                torch.from_numpy(key_major),
                torch.from_numpy(lengths.T.ravel()),
            )
        (output,) = answer["outputs"]
        np.testing.assert_allclose(output["data"], expected_scores.ravel().numpy(), rtol=1e-5)
    finally:
        assert server.stop() == 0


def test_the_readme_model_trains_on_two_ranks(project, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", "-m", "recsys", *README_RUN, f"--run.dir={tmp_path}"]
    command.append("--distributed.print_plan=true")
    done = subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # 16384 / (2 ranks x 512) = 16 steps; the model's tables were sharded over the ranks
    assert sorted(losses(tmp_path)) == list(range(1, 17))
    plan = [line for line in done.stdout.splitlines() if "t_cat_" in line]
    assert len(plan) == 26 and any("TABLE_WISE" in line for line in plan)
    config = tomllib.loads(
        (tmp_path / "config.toml").read_text()
    )  # mymodels is not importable here
    assert config["model"]["name"] == "mymodels:DLRMModule"
    resumed_on_one = recsys_cli(
        project, *README_RUN, f"--run.dir={tmp_path}", "--checkpoint.resume=latest",
        "--train.epochs=2",
    )  # fmt: skip
    assert resumed_on_one.returncode == 0, resumed_on_one.stderr[-3000:]
    assert max(losses(tmp_path)) == 16 + 32  # the second epoch on one process


def test_torchrec_dlrm_trains_by_name(tmp_path):
    overrides = [*SMALL, "--model.name=torchrec.models.dlrm:DLRM", f"--run.dir={tmp_path}"]
    result = train(load_config(REPO / "configs" / "dlrm_synthetic.toml", overrides))
    assert result.steps == 32 and result.test["auc"] > 0.6
    model = build_model(load_config(tmp_path / "config.toml").model, SPEC, torch.device("cpu"))
    assert type(model).__module__ == "torchrec.models.dlrm"
    dcn = ModelConfig(
        name="torchrec.models.dlrm:DLRM_DCN", args={"dcn_num_layers": 2, "dcn_low_rank_dim": 4}
    )
    assert type(build_model(dcn, SPEC, torch.device("cpu"))).__name__ == "DLRM_DCN"


class NoTables(torch.nn.Module):
    def __init__(self, dense_in_features: int, num_tasks: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dense_in_features, num_tasks)

    def forward(self, dense_features, sparse_features):
        return self.linear(dense_features)


class NeedsWidth(torch.nn.Module):
    def __init__(self, embedding_bag_collection, width: int, depth: int = 1) -> None:
        super().__init__()
        self.tables = embedding_bag_collection

    def forward(self, dense_features, sparse_features):
        return dense_features[:, :1]


class ThreeInputs(NoTables):
    def forward(self, dense_features, sparse_features, mask):
        return self.linear(dense_features)


class FlatLogits(NoTables):
    def forward(self, dense_features, sparse_features):
        return self.linear(dense_features)[:, 0]  # [B], not [B, 1]


def _build(name: str, **args) -> torch.nn.Module:
    config = dataclasses.replace(ModelConfig(), name=name, args=args)
    return build_model(config, SPEC, torch.device("cpu"))


HERE = "tests.build.test_model_classes"


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        (f"{HERE}:NeedsWidth", {}, r"NeedsWidth.__init__ needs 'width', which the trainer does "
         r"not pass; set it in \[model.args\] \(--model.args.width=\.\.\.\)"),
        (f"{HERE}:NeedsWidth", {"width": 4, "dept": 2}, r"takes no argument 'dept' \(from "
         r"\[model.args\]; it takes embedding_bag_collection, width, depth\); did you mean "
         r"'depth'\?"),
        (f"{HERE}:NeedsWidth", {"width": 4, "embedding_bag_collection": 1}, r"\[model.args\] "
         r"sets 'embedding_bag_collection', which the trainer passes"),
        (f"{HERE}:ThreeInputs", {}, r"ThreeInputs.forward\(self, dense_features, "
         r"sparse_features, mask\) cannot be called as forward\(dense_features, sparse_features\)"),
        ("dlrm", {"product": "inner"}, r"DLRM.__init__ takes no argument 'product'"),
        ("dlrm_dcn", {"dcn_num_layers": 2}, r"sets 'dcn_num_layers', which this built-in model "
         r"reads from its own section"),
        (f"{HERE}:NoTable", {}, r"has no 'NoTable'; did you mean tests.build.test_model_classes:"
         r"NoTables\?"),
        (f"{HERE}:SPEC", {}, r"SPEC is a DatasetSpec, not an nn.Module class"),
        ("no_such_module:Model", {}, r"no module 'no_such_module' in the installed packages or "
         r"the working directory"),
    ],
)  # fmt: skip
def test_a_class_that_does_not_fit_is_refused_in_one_line(name, args, message):
    with pytest.raises(ValueError, match=message) as error:
        _build(name, **args)
    assert "\n" not in str(error.value)


def test_a_wrong_output_shape_and_a_model_without_tables(tmp_path):
    overrides = [*SMALL, f"--run.dir={tmp_path / 'flat'}", f"--model.name={HERE}:FlatLogits"]
    message = r"FlatLogits.forward returned logits of shape \(512,\); the trainer expects \[B, T\]"
    with pytest.warns(UserWarning, match="no embedding"), pytest.raises(ValueError, match=message):
        train(load_config(None, overrides))
    assert not (tmp_path / "flat" / "checkpoints").exists()  # refused at the first batch
    with pytest.warns(UserWarning, match="holds no embedding collection: it trains"):
        model = _build(f"{HERE}:NoTables")
    assert model(torch.ones(4, 2), None).shape == (4, 1)


def test_config_round_trips_model_args_and_names_the_class(tmp_path):
    config = load_config(
        None,
        [
            f"--model.name={HERE}:NeedsWidth",
            "--model.args.width=8",
            '--model.args.names=["a", "b"]',
            "--model.args.inner.depth=2",
        ],
    )
    assert config.model.args == {"width": 8, "names": ["a", "b"], "inner": {"depth": 2}}
    (tmp_path / "c.toml").write_text("[model]\nname = 'dlrm'\n[model.args]\nfoo = {bar = 1}\n")
    assert load_config(tmp_path / "c.toml").model.args == {"foo": {"bar": 1}}
    from recsys.config import to_toml

    (tmp_path / "again.toml").write_text(to_toml(config))
    assert load_config(tmp_path / "again.toml").model == config.model
    assert resolve_model(config.model.name).origin.startswith(f"{HERE}:NeedsWidth (")
