"""train.compile: the dense part under torch.compile, the tables eager (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from recsys.build.models import build_model
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.loader import BatchLoader
from recsys.embedding.interface import embedding_collections
from recsys.ops.interaction.dot import dot_interaction
from recsys.train.compiled import compile_dense, dense_modules
from recsys.train.optimizers import build_optimizers, configure_embedding_optimizer
from recsys.train.progress import StepTimer
from recsys.train.step import TrainStep
from recsys.train.trainer import train
from tests.train.test_resume import TINY, train_losses

RECIPES = ["dlrm", "dcn", "deepfm", "wide_deep", "xdeepfm", "pnn", "mmoe", "dlrm_dcn"]
SMALL = [
    "--data.synthetic.num_train_samples=2048",
    "--data.synthetic.num_valid_samples=256",
    "--data.synthetic.num_test_samples=256",
]


def recipe(name: str, *overrides: str):
    config = load_config(f"configs/{name}_synthetic.toml", [*SMALL, *overrides])
    dataset = build_dataset(config.data, 0)
    model = build_model(config.model, dataset.spec, torch.device("cpu"), seed=0)
    return config, dataset, model


@pytest.mark.parametrize("name", RECIPES)
def test_the_dense_part_is_every_parameter_outside_the_tables(name):
    _, _, model = recipe(name)
    dense = dense_modules(model)
    tables = {id(p) for c in embedding_collections(model).values() for p in c.parameters()}
    in_dense = {id(p) for module in dense.values() for p in module.parameters()}
    assert not tables & in_dense
    assert tables | in_dense == {id(p) for p in model.parameters()}
    for module in dense.values():
        assert not embedding_collections(module)


@pytest.mark.parametrize(
    "name",  # ~10 s each on 2 cores: two in the default run, every recipe in the slow one
    [
        "dlrm",
        "mmoe",
        *(pytest.param(n, marks=pytest.mark.slow) for n in RECIPES[1:6] + RECIPES[7:]),
    ],
)
def test_no_graph_break_in_the_dense_part(name, monkeypatch):
    monkeypatch.setenv("RECSYS_BACKEND", "triton")  # eager would take the Triton kernels
    _, dataset, model = recipe(name)
    batch = next(iter(BatchLoader(dataset, "train", 64, shuffle=False, seed=0)))
    inputs = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, args, path=path: inputs.setdefault(path, args))
        for path, module in dense_modules(model).items()
    ]
    model(batch.dense, batch.sparse)
    for hook in hooks:
        hook.remove()
    for path, module in dense_modules(model).items():
        explained = torch._dynamo.explain(module)(*inputs[path])
        assert explained.graph_break_count == 0, (path, explained.break_reasons)


def test_compiling_the_interaction_warns_of_no_cache(recwarn):
    """Dynamo warns of every lru_cache it traces through (a "potential" silent incorrectness):
    the dot interaction's pair indices, a pure function of their sizes, are computed without
    their cache under torch.compile, so no such warning reaches the user, and the values are
    the eager ones."""
    warned = getattr(torch._dynamo.utils, "warn_once_cache", set())
    for message in [m for m in warned if "lru_cache" in m]:
        warned.discard(message)  # warned once per process: let an earlier test's not hide it
    torch._dynamo.reset()
    dense, sparse = torch.randn(8, 4), torch.randn(8, 5, 4)
    compiled = torch.compile(dot_interaction, backend="eager", fullgraph=True)
    for pair_order in ("torchrec", "mlperf"):
        expected = dot_interaction(dense, sparse, pair_order=pair_order, backend="torch")
        got = compiled(dense, sparse, pair_order=pair_order, backend="torch")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not [w for w in recwarn if "lru_cache" in str(w.message)]


def test_compiled_training_equals_eager():
    # aot_eager: Dynamo's capture and AOT autograd, no code generation (fast on CPU); the
    # inductor run is the slow test below
    config, dataset, eager = recipe("dlrm", "--model.dropout=0.0")
    configure_embedding_optimizer(config.train, eager)
    compiled = copy.deepcopy(eager)
    assert compile_dense(compiled, backend="aot_eager") == ["dense_arch", "inter_arch", "over_arch"]
    steps = [
        TrainStep(m, build_optimizers(config.train, m), "fp32", torch.device("cpu"), None)
        for m in (eager, compiled)
    ]
    timer = StepTimer(torch.device("cpu"), lambda: 0.0)
    for batch in list(BatchLoader(dataset, "train", 256, shuffle=False, seed=0))[:4]:
        losses = [step(batch, timer) for step in steps]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[key], value, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_train_compile_matches_eager_through_the_trainer(tmp_path):
    # inductor's generated kernels sum in their own order: equal to ~1e-5, not bitwise
    args = [*TINY, "--train.max_steps=8"]
    eager = train(load_config(None, [f"--run.dir={tmp_path / 'eager'}", *args]))
    compiled = train(
        load_config(None, [f"--run.dir={tmp_path / 'compiled'}", *args, "--train.compile=true"])
    )
    expected, losses = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert expected.keys() == losses.keys()
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-4), step
    assert compiled.test["auc"] == pytest.approx(eager.test["auc"], abs=1e-3)
