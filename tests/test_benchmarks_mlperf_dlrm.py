"""benchmarks/mlperf_dlrm.py: the dense-torch variant moves the dense layers alone, bf16 runs the
step under autocast, and a provider that cannot run here is reported skipped, not a crash."""

from __future__ import annotations

import contextlib

import pytest
import torch

from benchmarks import mlperf_dlrm
from recsys.build.models import build_model
from recsys.config import load_config
from recsys.data import build_dataset

SMALL = [
    "--data.synthetic.cardinalities=" + str([50] * 26),
    "--train.batch_size=64",
    "--data.synthetic.num_train_samples=128",
    "--data.synthetic.num_valid_samples=1",
    "--data.synthetic.num_test_samples=1",
    "--model.embedding_dim=8",
    "--model.dense_arch_layer_sizes=[16, 8]",
    "--model.over_arch_layer_sizes=[16, 1]",
    "--model.cross.low_rank=4",
]


def test_dense_torch_moves_the_dense_layers_and_leaves_the_tables_on_auto():
    recipe = load_config(mlperf_dlrm.RECIPE, SMALL)
    model = build_model(recipe.model, build_dataset(recipe.data, 0).spec, torch.device("cpu"))
    mlperf_dlrm.dense_on_torch(model)
    layers = [m for m in model.modules() if type(m).__module__ == "recsys.models.layers"]
    assert {m.backend for m in layers if hasattr(m, "backend")} == {"torch"}
    tables = [m for m in model.modules() if type(m).__module__.startswith("recsys.embedding")]
    assert [m.backend for m in tables if hasattr(m, "backend")] == ["auto"]


def test_bf16_runs_the_step_under_autocast():
    seen = []
    step = mlperf_dlrm.under_precision(
        lambda batch: seen.append(
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        ),
        "bf16",
        torch.device("cpu"),
    )
    step(None)
    plain = mlperf_dlrm.under_precision(
        lambda batch: seen.append(torch.is_autocast_enabled("cpu")), "fp32", torch.device("cpu")
    )
    plain(None)
    assert seen == [torch.bfloat16, False]


FIRST_LINE = "Could not run 'fbgemm::x' with arguments from the 'CUDA' backend."


def test_a_provider_that_cannot_run_here_is_reported_skipped():
    recipe = load_config(mlperf_dlrm.RECIPE, SMALL)

    @contextlib.contextmanager
    def no_cuda_kernels(recipe, spec, device):
        def step(batch):
            raise NotImplementedError(f"{FIRST_LINE}\nmore")

        yield step

    timed = mlperf_dlrm.time_providers(
        {"recsys": mlperf_dlrm.recsys_model, "peer": no_cuda_kernels},
        recipe,
        64,
        2,
        torch.device("cpu"),
        "fp32",
        1,
        2,
    )
    assert timed["peer"] == {"skipped": f"NotImplementedError: {FIRST_LINE}"}
    assert timed["recsys"]["timing"]["p50_ms"] > 0 and timed["recsys"]["peak_device_gib"] == 0.0


def test_a_negative_cap_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["mlperf_dlrm.py", "--max-rows", "-1"])
    with pytest.raises(SystemExit):
        mlperf_dlrm.main()
    assert "--max-rows -1: expected >= 1, or 0 for MLPerf's full tables" in capsys.readouterr().err
