"""train.cuda_graphs: the dense part compiled in torch.compile's mode "reduce-overhead" (CUDA
graph trees), each train step a new graph generation; on CPU compiled without graphs, and said."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from recsys.build.models import build_model
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.loader import BatchLoader
from recsys.train.compiled import compile_dense, compile_line, compile_options
from recsys.train.optimizers import build_optimizers, configure_embedding_optimizer
from recsys.train.progress import StepTimer
from recsys.train.step import TrainStep
from tests.train.test_resume import TINY, run, train_losses

SMALL = [
    "--data.synthetic.num_train_samples=2048",
    "--data.synthetic.num_valid_samples=256",
    "--data.synthetic.num_test_samples=256",
    "--model.dropout=0.0",
]


def test_the_config_key_is_a_bool_off_by_default():
    assert load_config(None, []).train.cuda_graphs is False
    assert load_config(None, ["--train.cuda_graphs=true"]).train.cuda_graphs is True
    with pytest.raises(ValueError, match="'train.cuda_graphs' expects bool, got str 'yes'"):
        load_config(None, ["--train.cuda_graphs=yes"])


def test_the_mode_and_what_a_run_says_of_it():
    assert compile_options(False) == {}
    assert compile_options(True) == {"mode": "reduce-overhead"}
    paths = ["dense_arch", "over_arch"]
    assert compile_line(paths, False, torch.device("cpu")) == "torch.compile: dense_arch, over_arch"
    on_gpu = compile_line(paths, True, torch.device("cuda", 0))
    assert on_gpu.endswith('(mode "reduce-overhead": forward and backward replayed as CUDA graphs)')
    on_cpu = compile_line(paths, True, torch.device("cpu"))
    assert "no CUDA device (cpu)" in on_cpu and "without CUDA graphs" in on_cpu


def test_a_cuda_graphs_run_compiles_the_dense_part_in_that_mode_and_trains_as_eager(
    tmp_path, monkeypatch, capsys
):
    """Through the trainer: every dense module compiled with mode "reduce-overhead" (here run
    by aot_eager, Dynamo and AOT autograd without code generation: fast), each step begins a
    graph generation, the CPU run says it has no graphs, and the losses are the eager run's."""
    modes, steps_begun = [], []
    original = torch.nn.Module.compile

    def compile(module, **options):
        modes.append((type(module).__name__, options))
        original(module, backend="aot_eager")

    monkeypatch.setattr(torch.nn.Module, "compile", compile)
    monkeypatch.setattr(
        torch.compiler, "cudagraph_mark_step_begin", lambda: steps_begun.append(True)
    )
    args = [*TINY, "--train.max_steps=3", "--model.dropout=0.0"]
    run(tmp_path / "eager", *args)
    assert modes == [] and steps_begun == []
    run(tmp_path / "graphs", *args, "--train.cuda_graphs=true")
    assert [options for _, options in modes] == [{"mode": "reduce-overhead"}] * 3
    assert len(steps_begun) == 3
    out = capsys.readouterr().out
    assert "train.cuda_graphs: no CUDA device (cpu)" in out
    expected, losses = train_losses(tmp_path / "eager"), train_losses(tmp_path / "graphs")
    assert losses.keys() == expected.keys()
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step


def graphs_and_eager(
    device: torch.device, steps: int
) -> tuple[list[float], list[float], torch.nn.Module, torch.nn.Module]:
    """Train the small default recipe ``steps`` steps eager and with the dense part compiled in
    mode "reduce-overhead" (inductor); the losses of each and the two models."""
    config = load_config("configs/dlrm_synthetic.toml", SMALL)
    dataset = build_dataset(config.data, 0)
    eager = build_model(config.model, dataset.spec, device, seed=0)
    configure_embedding_optimizer(config.train, eager)
    graphs = copy.deepcopy(eager)
    assert compile_dense(graphs, **compile_options(True)) == [
        "dense_arch",
        "inter_arch",
        "over_arch",
    ]
    timer = StepTimer(device, lambda: 0.0)
    losses: tuple[list, list] = ([], [])
    for model, cuda_graphs, out in ((eager, False, losses[0]), (graphs, True, losses[1])):
        step = TrainStep(
            model, build_optimizers(config.train, model), "fp32", device, None, cuda_graphs
        )
        loader = BatchLoader(dataset, "train", 256, shuffle=False, seed=0, device=device)
        for batch in list(loader)[:steps]:
            out.append(float(step(batch, timer)))
    return *losses, eager, graphs


@pytest.mark.slow
def test_reduce_overhead_on_cpu_compiles_without_graphs_and_trains_as_eager():
    counters.clear()
    expected, losses, eager, graphs = graphs_and_eager(torch.device("cpu"), 4)
    assert losses == pytest.approx(expected, rel=1e-5)
    assert counters["inductor"]["cudagraph_skips"] > 0  # "skipping cudagraphs due to cpu device"
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(graphs.state_dict()[key], value, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_cuda_graphs_are_recorded_and_replayed_and_train_as_eager(recwarn):
    counters.clear()
    expected, losses, eager, graphs = graphs_and_eager(torch.device("cuda"), 8)
    assert counters["inductor"]["cudagraph_skips"] == 0  # every dense graph is a CUDA graph
    assert not [w for w in recwarn if "CUDAGraphs" in str(w.message)]  # no slow path
    assert losses == pytest.approx(expected, rel=1e-3)
    tables = {name for name, _ in eager.named_parameters() if "embedding" in name}
    assert tables
    for key, value in eager.state_dict().items():
        if key not in tables:
            torch.testing.assert_close(graphs.state_dict()[key], value, rtol=1e-3, atol=1e-5)
            continue
        # Element-wise Adagrad moves an element by lr * g / sqrt(sum of its g^2): where an
        # element's gradients nearly cancel (a row's samples pulling both ways), g is a small
        # difference of large terms, and the compiled dense backward's other summation order
        # changes it in relative terms by far more than float rounding. Seen on an H200: 1 of
        # 160,000 elements 2.4e-4 apart after 8 steps. So: all but a few elements close, and none
        # further apart than a hundredth of the steps' largest moves.
        far = ~torch.isclose(graphs.state_dict()[key], value, rtol=1e-3, atol=1e-5)
        assert int(far.sum()) <= max(1, value.numel() // 10_000), (key, int(far.sum()))
        largest_moves = 8 * load_config("configs/dlrm_synthetic.toml", SMALL).train.embedding_lr
        torch.testing.assert_close(
            graphs.state_dict()[key], value, rtol=0, atol=largest_moves / 100
        )
