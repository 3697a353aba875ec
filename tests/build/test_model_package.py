"""The example model package (examples/custom_model), installed as a user installs it: its
``recsys.models`` entry point is listed by `recsys config --models` and trains by its short
name, in one process and on 2 gloo ranks; it resumes bitwise, fine-tunes from its own
checkpoint and from a built-in DLRM's, writes deltas of its dynamic tables, exports, and is
scored by what `recsys serve` runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.checkpoint.io import load_model
from recsys.config import load_config
from recsys.serve.export import export_model
from recsys.serve.online.served import ServedModel
from recsys.train.trainer import train
from tests.build.test_model_classes import RECSYS, REPO, losses

EXAMPLE = REPO / "examples" / "custom_model"
RECIPE = EXAMPLE / "gated_dlrm.toml"
SMALL = [
    "--data.synthetic.num_train_samples=16384",
    "--data.synthetic.num_valid_samples=1024",
    "--data.synthetic.num_test_samples=2048",
    "--train.batch_size=512",
    "--train.log_every_steps=1",
    "--train.eval_every_steps=0",
    "--train.progress_bar=false",
    "--run.device=cpu",
    "--run.tensorboard=false",
    "--data.prefetch_batches=0",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example package installed (pip, no network) into a directory of its own."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "custom_model"
    shutil.copytree(EXAMPLE, source)  # pip's build files stay out of the repository
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    pip += ["--no-build-isolation", "--target", str(tmp / "site"), str(source)]
    subprocess.run(pip, check=True, capture_output=True)
    return tmp / "site"


@pytest.fixture
def installed(site, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(site))
    return site


def test_the_entry_point_is_listed_and_trains_by_its_short_name(site, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*RECSYS, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
        )

    listed = cli("config", "--models")
    assert listed.returncode == 0, listed.stderr
    (line,) = [line for line in listed.stdout.splitlines() if line.startswith("gated_dlrm ")]
    assert "gated_dlrm.model:GatedDLRM" in line and "recsys-gated-dlrm 0.1.0" in line
    assert "dlrm" in listed.stdout.split() and "mmoe" in listed.stdout.split()
    trained = cli("train", "--config", str(RECIPE), *SMALL, "--run.dir=run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "recsys: training gated_dlrm on synthetic data for 32 steps" in trained.stdout
    missing = cli("train", "--config", str(RECIPE), "--model.args.cross_layer=3")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "recsys: error: model.name 'gated_dlrm': GatedDLRM.__init__ takes no argument "
        "'cross_layer' (from [model.args]; it takes embedding_bag_collection, "
        "dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, cross_layers); did "
        "you mean 'cross_layers'?"
    ]

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", "-m", "recsys", "train", "--config", str(RECIPE), *SMALL]
    command.append(f"--run.dir={tmp_path / 'two'}")
    two = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert sorted(losses(tmp_path / "two")) == list(range(1, 17))  # 16384 / (2 x 512)


def test_it_resumes_bitwise_and_fine_tunes(installed, tmp_path, capsys):
    run = [*SMALL, "--checkpoint.every_steps=6"]
    whole = train(load_config(RECIPE, [*run, f"--run.dir={tmp_path / 'whole'}"]))
    assert whole.steps == 32
    part = [*run, f"--run.dir={tmp_path / 'part'}"]
    train(load_config(RECIPE, [*part, "--train.max_steps=6"]))
    train(load_config(RECIPE, [*part, "--checkpoint.resume=latest"]))
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")

    tuned = [
        *SMALL,
        f"--run.dir={tmp_path / 'tuned'}",
        f"--checkpoint.init_from={whole.checkpoint}",
    ]
    own = train(load_config(RECIPE, tuned))
    assert "fine-tuning from" in capsys.readouterr().out
    assert own.test["auc"] > whole.test["auc"] - 0.02

    builtin = [*SMALL, "--model.name=dlrm", "--model.args={}", f"--run.dir={tmp_path / 'd'}"]
    dlrm = train(load_config(RECIPE, builtin))
    from_builtin = [
        *SMALL,
        f"--run.dir={tmp_path / 'from_dlrm'}",
        f"--checkpoint.init_from={dlrm.checkpoint}",
        '--checkpoint.new_modules=["cross_arch", "over_arch"]',
        "--train.max_steps=1",
    ]
    train(load_config(RECIPE, from_builtin))
    report = capsys.readouterr().out
    assert "started fresh" in report or "fresh" in report
    tuned = load_model(tmp_path / "from_dlrm")
    reference = load_model(dlrm.checkpoint)
    with torch.no_grad():
        name = "dense_arch.layers.0.weight"  # the bottom MLP came from the built-in DLRM
        trained_step = tuned.state_dict()[name] - reference.state_dict()[name]
    assert trained_step.abs().max() < 0.01  # one step of Adam at lr 1e-3 away from it


def test_deltas_export_and_serving(installed, tmp_path):
    raw = [
        *SMALL,
        f"--run.dir={tmp_path / 'run'}",
        "--data.synthetic.id_encoding=raw",  # dynamic tables
        "--model.dynamic.initial_capacity=1024",
        "--model.dynamic.max_capacity=1024",  # the exported map holds every later key
        "--checkpoint.every_steps=4",
        "--checkpoint.delta_every_steps=2",
        "--checkpoint.keep=0",
        '--checkpoint.freeze=["dense_arch", "cross_arch", "over_arch"]',
    ]
    train(load_config(RECIPE, raw))
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    base = export_model(checkpoint, tmp_path / "base.pt2")
    served = ServedModel(base, deltas=tmp_path / "run")
    assert served.step == 4
    served.refresh()
    assert served.step == 32  # brought forward by the run's deltas
    latest = load_model(tmp_path / "run")
    rng = np.random.default_rng(0)
    spec = served.spec
    dense = rng.standard_normal((4, spec.num_dense)).astype(np.float32)
    lengths = np.ones((4, len(spec.sparse_names)), np.int64)
    keys = latest.sparse_arch.live_keys  # ids the tables hold
    held = [keys(f"t_{name}").numpy() for name in spec.sparse_names]
    values = np.concatenate([k[np.arange(4) % len(k)] for k in held])  # key-major
    scores, step = served.score(dense, lengths, values.reshape(-1, 4).T.ravel())
    from torchrec import KeyedJaggedTensor

    sparse = KeyedJaggedTensor(
        keys=list(spec.sparse_names),
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(lengths.T.ravel()),
    )
    with torch.no_grad():
        expected = torch.sigmoid(latest(torch.from_numpy(dense), sparse)).numpy()
    assert step == 32
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)


def test_its_bf16_step_makes_no_host_sync(installed, tmp_path):
    """The step audit of the default recipe, on this model under bf16 autocast: no sync."""
    from recsys.train.step_audit import audit_training

    options = [
        f"--run.dir={tmp_path / 'run'}",
        "--run.device=cpu",
        "--train.progress_bar=false",
        "--train.log_every_steps=1000",
        "--train.eval_every_steps=0",
        "--checkpoint.save_final=false",
        "--data.prefetch_batches=2",
        "--data.synthetic.num_train_samples=8192",
        "--train.batch_size=1024",
        '--train.id_checks="async"',
        "--train.precision=bf16",
    ]
    report = audit_training(load_config(RECIPE, options), warmup=3, steps=1)
    assert report.num_syncs == 0, report.describe()


@pytest.mark.slow  # ~40 s of inductor on 2 cores
def test_it_compiles_and_trains_as_eager(installed, tmp_path):
    def run(name: str, *extra: str) -> dict[int, float]:
        overrides = [*SMALL, f"--run.dir={tmp_path / name}", "--train.max_steps=4", *extra]
        train(load_config(RECIPE, overrides))
        return losses(tmp_path / name)

    eager, compiled = run("eager"), run("compiled", "--train.compile=true")
    assert eager.keys() == compiled.keys()
    np.testing.assert_allclose(list(compiled.values()), list(eager.values()), rtol=1e-4)
