"""Mixed precision: autocast, the fp16 loss scaler and its skipped steps (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.checkpoint.io import checkpoint_shapes, load_model
from recsys.config import load_config
from recsys.data.batch import Batch
from recsys.distributed import planner as P
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import SGD, Adagrad
from recsys.train.metrics import read_metrics
from recsys.train.precision import LossScaler, autocast, precision_note
from recsys.train.progress import StepTimer
from recsys.train.step import TrainStep
from recsys.train.trainer import train
from tests.distributed.spawn import run_ranks
from tests.distributed.test_pipeline import local_state
from tests.train.test_resume import TINY, train_losses


class TinyModel(nn.Module):
    """Two fused tables, pooled and fed to a linear layer."""

    def __init__(self, optimizer) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=8, num_embeddings=20, feature_names=[f"f{i}"]
            )
            for i in range(2)
        ]
        self.sparse = EmbeddingBagCollection(tables, optimizer=optimizer)
        self.dense = nn.Linear(16 + 3, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(sparse).values()
        return self.dense(torch.cat([pooled, dense], dim=1))


def batch(seed: int, size: int = 16) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (2 * size,), generator=generator)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=ids, lengths=torch.ones(2 * size, dtype=torch.int64)
    )
    dense = torch.randn(size, 3, generator=generator)
    labels = torch.randint(0, 2, (size, 1), generator=generator).float()
    return Batch(dense=dense, sparse=sparse, labels=labels)


def timer() -> StepTimer:
    return StepTimer(torch.device("cpu"), lambda: 0.0)


def stepper(model: nn.Module, precision: str) -> TrainStep:
    optimizers = {"dense": torch.optim.Adam(model.dense.parameters(), lr=1e-2)}
    return TrainStep(model, optimizers, precision, torch.device("cpu"), None)


def everything(model: nn.Module, step: TrainStep) -> dict[str, torch.Tensor]:
    state = {key: value.clone() for key, value in local_state(model).items()}
    for name, opt in step.optimizers.items():
        for i, s in enumerate(opt.state.values()):
            state |= {f"{name}.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()}
    return state


def test_a_forced_overflow_leaves_tables_optimizer_state_and_dense_layers_untouched():
    torch.manual_seed(0)
    model = TinyModel(Adagrad(lr=0.1))
    step = stepper(model, "fp16")
    step(batch(0), timer())  # a clean step first: the optimizers have state to keep
    before = everything(model, step)
    scale = step.scaler.scale
    step.scaler.scale = 1e38  # the scaled loss overflows fp32: inf in every gradient
    loss = step(batch(1), timer())
    assert torch.isfinite(loss)
    after = everything(model, step)
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} moved on an overflowed step"
    assert step.scaler.scale == 1e38 * 0.5 and step.scaler.skipped_steps == 1
    step.scaler.scale = scale
    step(batch(2), timer())  # and the next clean step trains again
    assert not torch.equal(
        everything(model, step)["sparse.optimizer_step"], before["sparse.optimizer_step"]
    )


def test_the_fused_update_sees_unscaled_gradients():
    # SGD is not scale-invariant: an update from scaled gradients would be 1024x too large
    torch.manual_seed(0)
    reference = TinyModel(SGD(lr=0.5))
    scaled = copy.deepcopy(reference)
    plain_step, scaled_step = stepper(reference, "fp16"), stepper(scaled, "fp16")
    plain_step.scaler.scale, scaled_step.scaler.scale = 1.0, 1024.0
    for seed in range(3):
        plain_step(batch(seed), timer())
        scaled_step(batch(seed), timer())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(scaled.state_dict()[key], value, rtol=1e-3, atol=1e-5)
    initial = TinyModel(SGD(lr=0.5)).sparse.state_dict()  # same seed order: the start
    assert not torch.equal(
        reference.sparse.state_dict()["embedding_bags.t0.weight"],
        initial["embedding_bags.t0.weight"],
    )


def test_fp32_and_bf16_steps_match_the_plain_sequence():
    torch.manual_seed(0)
    model = TinyModel(Adagrad(lr=0.1))
    twin = copy.deepcopy(model)
    step = stepper(model, "fp32")
    optimizer = torch.optim.Adam(twin.dense.parameters(), lr=1e-2)
    for seed in range(3):
        b = batch(seed)
        loss = step(b, timer())
        expected = nn.functional.binary_cross_entropy_with_logits(twin(b.dense, b.sparse), b.labels)
        optimizer.zero_grad()
        expected.backward()
        optimizer.step()
        assert torch.equal(loss, expected.detach())
    bf16 = stepper(copy.deepcopy(model), "bf16")
    assert torch.isfinite(bf16(batch(5), timer()))


def test_loss_scaler_backs_off_grows_and_round_trips():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    scaler.update(overflowed=True)
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 8.0 and scaler.clean_steps == 0
    scaler.update(False)
    grads = [torch.tensor([8.0, 16.0]), torch.tensor([float("inf")])]
    assert scaler.unscale(grads[:1], torch.device("cpu")).item() == 0.0
    assert torch.equal(grads[0], torch.tensor([1.0, 2.0]))
    assert scaler.unscale(grads[1:], torch.device("cpu")).item() == 1.0
    copy_ = LossScaler()
    copy_.load_state_dict(scaler.state_dict())
    assert (copy_.scale, copy_.clean_steps, copy_.skipped_steps) == (8.0, 1, 1)


def test_bad_precision_is_a_clear_error():
    with pytest.raises(
        ValueError, match="train.precision = 'fp8'; expected one of fp32, bf16, fp16"
    ):
        autocast("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="precision"):
        load_config(None, ["--train.precision=fp8"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_runs_at_low_precision_and_resumes_exactly(tmp_path, precision):
    args = [*TINY, "--train.max_steps=8", "--checkpoint.every_steps=4", "--checkpoint.keep=0"]
    args += [f"--train.precision={precision}"]
    straight = train(load_config(None, [f"--run.dir={tmp_path / 'a'}", *args]))
    losses = train_losses(tmp_path / "a")
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    middle = tmp_path / "a" / "checkpoints" / "step_00000004"
    assert ("loss_scale.scale" in checkpoint_shapes(middle)) == (precision == "fp16")
    resumed = train(
        load_config(None, [f"--run.dir={tmp_path / 'b'}", *args, f"--checkpoint.resume={middle}"])
    )
    assert {s: losses[s] for s in range(5, 9)} == train_losses(tmp_path / "b")
    for key, value in load_model(straight.checkpoint).state_dict().items():
        assert torch.equal(load_model(resumed.checkpoint).state_dict()[key], value), key


def test_fp16_logs_its_loss_scale_and_skipped_steps_and_warns_on_cpu(tmp_path, monkeypatch, capsys):
    """The first step overflows (forced): the train events carry the halved scale and one
    skipped step; a fp32 run's events have neither. On CPU, fp16 warns once at start."""
    unscale, calls = LossScaler.unscale, []

    def first_step_overflows(self, grads, device):
        found_inf = unscale(self, grads, device)
        calls.append(1)
        return found_inf + 1 if len(calls) == 1 else found_inf

    monkeypatch.setattr(LossScaler, "unscale", first_step_overflows)
    args = [*TINY, "--train.max_steps=4", "--train.log_every_steps=2"]
    train(load_config(None, [f"--run.dir={tmp_path / 'fp16'}", *args, "--train.precision=fp16"]))
    out = capsys.readouterr().out
    assert out.count("warning: train.precision = fp16 on CPU is slow") == 1
    assert (
        "measured 1.6x the fp32 one" in out and "on CPU use bf16 (no loss scaling) or fp32" in out
    )
    events = [e for e in read_metrics(tmp_path / "fp16" / "metrics.jsonl") if e["split"] == "train"]
    assert [(e["step"], e["loss_scale"], e["skipped_steps"]) for e in events] == [
        (2, 2.0**15, 1),
        (4, 2.0**15, 1),
    ]
    train(load_config(None, [f"--run.dir={tmp_path / 'fp32'}", *args]))
    assert "warning" not in capsys.readouterr().out
    for event in read_metrics(tmp_path / "fp32" / "metrics.jsonl"):
        assert "loss_scale" not in event and "skipped_steps" not in event


def test_fp16_warns_on_cpu_only():
    assert precision_note("fp16", torch.device("cpu")).startswith("warning: ")
    for precision, device in [("fp16", "cuda"), ("bf16", "cpu"), ("fp32", "cpu")]:
        assert precision_note(precision, torch.device(device)) is None


def _overflow_on_one_rank(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = TinyModel(Adagrad(lr=0.1))
    plan = {f"t{i}": P.row_wise(20, 8, world) for i in range(2)}
    model.sparse = ShardedEmbeddingBagCollection(model.sparse, plan)
    step = stepper(model, "fp16")
    step(batch(rank), timer())
    before = everything(model, step)
    if rank == 1:
        step.scaler.scale = 1e38  # only this rank's gradients overflow
    step(batch(10 + rank), timer())
    for key, value in before.items():
        assert torch.equal(everything(model, step)[key], value), f"rank {rank}: {key} moved"
    assert step.scaler.skipped_steps == 1, f"rank {rank} did not skip"


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    run_ranks(2, _overflow_on_one_rank)


@pytest.mark.slow
def test_bf16_reaches_the_test_auc_of_fp32_on_the_default_recipe(tmp_path):
    # A quarter of the recipe's data (one pass over all of it: fp32 0.8603, bf16 0.8605)
    args = ["--data.synthetic.num_train_samples=500000", "--train.progress_bar=false"]
    results = {
        precision: train(
            load_config(
                "configs/dlrm_synthetic.toml",
                [f"--run.dir={tmp_path / precision}", *args, f"--train.precision={precision}"],
            )
        )
        for precision in ("fp32", "bf16")
    }
    assert abs(results["bf16"].test["auc"] - results["fp32"].test["auc"]) < 0.01
