"""Exact resume and fine-tuning through the trainer (single process, CPU)."""

from __future__ import annotations

import pytest
import torch

from recsys.checkpoint.io import checkpoint_shapes, latest_checkpoint, load_model
from recsys.config import load_config
from recsys.train import trainer as trainer_module
from recsys.train.metrics import read_metrics
from recsys.train.trainer import train

TINY = [
    "--data.synthetic.cardinalities=[50,300,1000]",
    "--data.synthetic.bag_sizes=[1,3,1]",
    "--data.synthetic.num_train_samples=8192",
    "--data.synthetic.num_valid_samples=512",
    "--data.synthetic.num_test_samples=1024",
    "--train.batch_size=512",
    "--train.eval_batch_size=1024",
    "--train.log_every_steps=1",
    "--train.progress_bar=false",
    "--run.device=cpu",
]
# Everything that could make a resumed run drift: a decaying schedule with warmup, dropout
# (RNG), Adam moments, fused Adagrad state on the tables, a shuffled multi-epoch data order.
EXACT = [
    *TINY,
    "--train.epochs=2",
    "--train.max_steps=24",
    "--train.lr_schedule=cosine",
    "--train.warmup_steps=5",
    "--model.dropout=0.2",
    "--data.shuffle_buffer_chunks=2",
    "--checkpoint.every_steps=5",
    "--checkpoint.keep=0",
]


def run(run_dir, *args):
    return train(load_config(None, [f"--run.dir={run_dir}", *args]))


def train_losses(run_dir) -> dict[int, float]:
    events = [e for e in read_metrics(run_dir / "metrics.jsonl") if e["split"] == "train"]
    steps = [e["step"] for e in events]
    assert steps == sorted(set(steps)), "a step logged twice or out of order"
    return {e["step"]: e["loss"] for e in events}


def final_state(checkpoint) -> dict[str, torch.Tensor]:
    return load_model(checkpoint).state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run(run_dir, *EXACT)
    return run_dir, result


def test_resume_from_a_checkpoint_continues_bitwise(uninterrupted, tmp_path):
    reference_dir, reference = uninterrupted
    # step 20: second epoch (16 steps per epoch), mid-way through the cosine decay
    middle = reference_dir / "checkpoints" / "step_00000020"
    result = run(tmp_path, *EXACT, f"--checkpoint.resume={middle}")
    losses, expected = train_losses(tmp_path), train_losses(reference_dir)
    assert sorted(losses) == list(range(21, 25))
    assert {s: expected[s] for s in losses} == losses  # bitwise
    assert result.test == reference.test
    ours, theirs = final_state(result.checkpoint), final_state(reference.checkpoint)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_crash_then_resume_latest_matches_the_uninterrupted_run(
    uninterrupted, tmp_path, monkeypatch
):
    reference_dir, reference = uninterrupted
    original = trainer_module._Run._train_step

    def crash_at_step_13(self, batch, timer):
        if self.step == 12:
            raise RuntimeError("node lost")
        return original(self, batch, timer)

    monkeypatch.setattr(trainer_module._Run, "_train_step", crash_at_step_13)
    with pytest.raises(RuntimeError, match="node lost"):
        run(tmp_path, *EXACT, "--checkpoint.resume=latest")  # no checkpoint yet: fresh start
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000010"
    monkeypatch.setattr(trainer_module._Run, "_train_step", original)
    result = run(tmp_path, *EXACT, "--checkpoint.resume=latest")

    events = read_metrics(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in events if e["split"] == "resume"] == [10]
    assert train_losses(tmp_path) == train_losses(reference_dir)  # steps 1..24, each once
    assert result.steps == reference.steps == 24
    ours, theirs = final_state(result.checkpoint), final_state(reference.checkpoint)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_resume_with_another_batch_size_keeps_the_sample_count(uninterrupted, tmp_path, capsys):
    reference_dir, _ = uninterrupted
    checkpoint = reference_dir / "checkpoints" / "step_00000010"
    run(
        tmp_path,
        *EXACT,
        "--train.batch_size=1024",
        "--train.max_steps=12",
        f"--checkpoint.resume={checkpoint}",
    )
    out = capsys.readouterr().out
    assert (
        "resuming epoch 0 on 1 rank(s) x batch 1024 (saved on 1 x 512 after 10 batches): the "
        "3,072 samples of this epoch not yet trained, in 3 batches per rank; none dropped"
    ) in out
    assert "train.batch_size: 512 -> 1024" in out  # the config change is reported
    assert sorted(train_losses(tmp_path)) == [11, 12]


def samples(batch) -> list[tuple]:
    """Each sample of ``batch`` as a hashable tuple: its dense values and bags of ids."""
    dense = batch.dense.tolist()
    bags = [
        (bag.values().tolist(), bag.offsets().tolist()) for bag in batch.sparse.to_dict().values()
    ]
    return [
        (*dense[i], *(tuple(values[offsets[i] : offsets[i + 1]]) for values, offsets in bags))
        for i in range(batch.batch_size)
    ]


def test_resumes_with_other_batch_sizes_train_each_sample_once(tmp_path, monkeypatch, capsys):
    """Batches of 512 (5 of 16, saved without the reshards field, as before it existed), then
    of 1024 (2 of the 5 left: the 512 samples past them are dropped), then of 256 (the 12
    left): each sample is trained once, and each resume says what it reads."""
    trained = []
    original_step, original_state = (
        trainer_module._Run._train_step,
        trainer_module._Run._training_state,
    )

    def recording(self, batch, timer):
        trained.extend(samples(batch))
        return original_step(self, batch, timer)

    def without_reshards(self):
        state = original_state(self)
        state.pop("data_reshards", None)
        return state

    monkeypatch.setattr(trainer_module._Run, "_train_step", recording)
    monkeypatch.setattr(trainer_module._Run, "_training_state", without_reshards)
    once = [*TINY, "--train.epochs=1", "--data.shuffle_buffer_chunks=2"]
    run(tmp_path, *once, "--train.max_steps=5")
    monkeypatch.setattr(trainer_module._Run, "_training_state", original_state)
    resume = "--checkpoint.resume=latest"
    run(tmp_path, *once, "--train.batch_size=1024", "--train.max_steps=7", resume)
    second = capsys.readouterr().out
    result = run(tmp_path, *once, "--train.batch_size=256", resume)
    third = capsys.readouterr().out

    assert len(set(trained)) == len(trained)  # no sample twice
    assert len(trained) == 5 * 512 + 2 * 1024 + 12 * 256 == 8192 - 512
    assert result.steps == 19
    assert (
        "(saved on 1 x 512 after 5 batches): the 5,632 samples of this epoch not yet trained, in "
        "5 batches per rank; the last 512 of them (fewer than 1 x 1024) are dropped (the "
        "checkpoint records no earlier reshard: epoch 0 is taken to have been read on 1 x 512 "
        "from its start)"
    ) in second
    assert (
        "(saved on 1 x 1024 after 2 batches): the 3,072 samples of this epoch not yet trained, "
        "in 12 batches per rank; none dropped\n"
    ) in third


def test_resume_of_a_missing_path_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        run(tmp_path, *TINY, f"--checkpoint.resume={tmp_path / 'nope'}")


# ------------------------------------------------------------------------------------------
# Fine-tuning


@pytest.fixture(scope="module")
def single_task_mmoe(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mmoe1")
    result = run(run_dir, *TINY, "--model.name=mmoe", "--train.max_steps=6")
    return result.checkpoint


MMOE_TWO_TASKS = [*TINY, "--model.name=mmoe", "--data.synthetic.num_tasks=2"]


def test_fine_tune_adds_a_task_head_to_an_mmoe(single_task_mmoe, tmp_path, capsys):
    before = load_model(single_task_mmoe).state_dict()
    result = run(
        tmp_path,
        *MMOE_TWO_TASKS,
        "--train.max_steps=0",
        "--train.epochs=0",
        f"--checkpoint.init_from={single_task_mmoe}",
        '--checkpoint.new_modules=["tower_arch.1"]',
        '--checkpoint.grow=["moe_arch.gates"]',
        "--checkpoint.freeze=[]",
    )
    assert "grown (checkpoint rows loaded, new rows fresh): moe_arch.gates.weight" in (
        capsys.readouterr().out
    )
    after = load_model(result.checkpoint).state_dict()  # saved at step 0: the initial model
    num_experts = 4
    for key, value in before.items():
        if key.startswith("moe_arch.gates"):
            assert after[key].shape[0] == 2 * num_experts
            assert torch.equal(after[key][:num_experts], value), key  # task 0's gate kept
        else:
            assert torch.equal(after[key], value), key
    assert set(after) - set(before) == {k for k in after if k.startswith("tower_arch.1.")}
    assert 0 < result.test["auc_task_1"] < 1  # the new task is scored


def test_fine_tune_without_the_options_lists_every_difference(single_task_mmoe, tmp_path):
    with pytest.raises(ValueError) as error:
        run(tmp_path, *MMOE_TWO_TASKS, f"--checkpoint.init_from={single_task_mmoe}")
    message = str(error.value)
    assert "not in the checkpoint: tower_arch.1." in message
    assert 'checkpoint.new_modules=["tower_arch.1' in message
    assert "shape differs: moe_arch.gates.weight: checkpoint [4, " in message
    assert 'checkpoint.grow=["moe_arch.gates"]' in message
    assert "moe_arch.gates.bias" in message


def test_fine_tune_not_strict_loads_what_matches(single_task_mmoe, tmp_path, capsys):
    run(
        tmp_path,
        *MMOE_TWO_TASKS,
        "--train.max_steps=2",
        f"--checkpoint.init_from={single_task_mmoe}",
        "--checkpoint.strict=false",
    )
    out = capsys.readouterr().out
    assert "kept fresh, not loadable (strict=false): tower_arch.1." in out
    assert "moe_arch.gates.weight [4, " in out


def test_fine_tune_with_frozen_tables_and_grown_rows(tmp_path):
    source = run(tmp_path / "a", *TINY, "--train.max_steps=4").checkpoint
    grown = [a.replace("[50,300,1000]", "[60,300,1200]") for a in TINY]
    result = run(
        tmp_path / "b",
        *grown,
        "--train.max_steps=6",
        "--train.dense_lr=0.01",
        f"--checkpoint.init_from={source.parent.parent}",  # a run directory: its newest
        '--checkpoint.grow=["embeddings"]',
        '--checkpoint.freeze=["embeddings"]',
    )
    before, after = load_model(source).state_dict(), load_model(result.checkpoint).state_dict()
    for key, value in before.items():
        if ".embedding_bags." in key:
            # frozen: the old rows are still the checkpoint's after 6 steps of training
            assert torch.equal(after[key][: value.shape[0]], value), key
        else:
            assert not torch.equal(after[key], value), f"{key} did not train"
    tables = {k: v for k, v in after.items() if ".embedding_bags." in k}
    assert [v.shape[0] for v in tables.values()] == [60, 300, 1200]
    # frozen tables carry no fused optimizer state
    assert not [k for k in checkpoint_shapes(result.checkpoint) if k.endswith(".sum")]


def test_fine_tune_without_grow_names_the_grown_tables(tmp_path):
    source = run(tmp_path / "a", *TINY, "--train.max_steps=2").checkpoint
    grown = [a.replace("[50,300,1000]", "[60,300,1000]") for a in TINY]
    with pytest.raises(ValueError, match=r"t_cat_0.weight: checkpoint \[50, 16\], model \[60, "):
        run(tmp_path / "b", *grown, f"--checkpoint.init_from={source}")


def test_freeze_errors_name_the_module(tmp_path):
    with pytest.raises(ValueError, match="no module 'dense_ach'.*did you mean 'dense_arch'"):
        run(tmp_path, *TINY, '--checkpoint.freeze=["dense_ach"]')
    with pytest.raises(ValueError, match="inside the embedding collection 'sparse_arch'"):
        run(tmp_path, *TINY, '--checkpoint.freeze=["sparse_arch.embedding_bags.t_cat_0"]')


def test_freeze_bottom_mlp_keeps_it_and_trains_the_rest(tmp_path):
    first = run(tmp_path / "a", *TINY, "--train.max_steps=0", "--train.epochs=0").checkpoint
    result = run(
        tmp_path / "b",
        *TINY,
        "--train.max_steps=3",
        f"--checkpoint.init_from={first}",
        '--checkpoint.freeze=["dense_arch"]',
    )
    before, after = load_model(first).state_dict(), load_model(result.checkpoint).state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value) == key.startswith("dense_arch."), key
