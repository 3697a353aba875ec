"""The pipelined train step in one process: what TrainPipeline pulls and prefetches, and when;
``train.pipeline`` on vs off give the same run, bitwise (losses, evaluations, final model,
early stop); a pipelined run resumed from a checkpoint taken while the next batch was already
pulled continues exactly. The 2-rank runs, where input_dist runs ahead, are in
tests/distributed/test_pipeline.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from recsys.checkpoint.io import load_model
from recsys.config import load_config
from recsys.train import pipeline as pipeline_module
from recsys.train.metrics import read_metrics
from recsys.train.pipeline import TrainPipeline, pipeline_enabled
from recsys.train.trainer import train
from tests.train.test_resume import TINY

# What could make a run drift (dropout, a shuffled order over two epochs, a schedule), with
# validations between steps: 8 steps per epoch, 12 steps in all.
RUN = [
    *TINY,
    "--train.batch_size=1024",
    "--train.epochs=2",
    "--train.max_steps=12",
    "--train.lr_schedule=cosine",
    "--train.warmup_steps=3",
    "--model.dropout=0.2",
    "--train.eval_every_steps=5",
]


class _Batch:
    def __init__(self, index: int) -> None:
        self.index = index
        self.sparse = f"features {index}"


class _Recorder:
    """A loader and a sharded collection at once: every pull and prefetch, in order."""

    def __init__(self, num_batches: int) -> None:
        self.num_batches = num_batches
        self.events: list[str] = []
        self.closed = False

    def __iter__(self):
        try:
            for index in range(self.num_batches):
                self.events.append(f"pull {index}")
                yield _Batch(index)
        finally:
            self.closed = True

    def prefetch_input(self, features: str) -> None:
        self.events.append(f"prefetch {features.split()[-1]}")

    def drop_prefetched(self) -> None:
        self.events.append("drop")


def pipelined(recorder: _Recorder, mode: str = "on") -> TrainPipeline:
    pipeline = TrainPipeline(nn.Linear(1, 1), mode)
    if pipeline.enabled:
        pipeline.collections = [recorder]  # stands in for a sharded collection
    return pipeline


def consume(recorder: _Recorder, pipeline: TrainPipeline, **kwargs) -> list[int]:
    indices = []
    for index, batch in pipeline.batches(recorder, **kwargs):
        recorder.events.append(f"train {batch.index}")
        indices.append(index)
    return indices


def test_batch_i_plus_1_is_pulled_and_prefetched_before_batch_i_trains():
    recorder = _Recorder(3)
    assert consume(recorder, pipelined(recorder), start=5) == [5, 6, 7]
    assert recorder.events == [
        *("pull 0", "prefetch 0", "pull 1", "prefetch 1", "train 0"),
        *("pull 2", "prefetch 2", "train 1"),
        *("train 2", "drop"),  # the end of the epoch: nothing to pull ahead
    ]
    assert recorder.closed


def test_nothing_is_pulled_past_the_limit():
    recorder = _Recorder(10)
    assert consume(recorder, pipelined(recorder), limit=2) == [0, 1]
    assert recorder.events == [
        *("pull 0", "prefetch 0", "pull 1", "prefetch 1", "train 0", "train 1", "drop")
    ]
    empty = _Recorder(10)
    assert consume(empty, pipelined(empty), limit=0) == []
    assert empty.events == ["drop"]


def test_a_stop_after_a_step_drops_the_batch_run_ahead_and_closes_the_loader():
    recorder = _Recorder(10)
    batches = pipelined(recorder).batches(recorder)
    for index, _ in batches:
        if index == 1:
            break  # early stopping, a signal
    batches.close()
    assert recorder.events[-3:] == ["pull 2", "prefetch 2", "drop"]
    assert recorder.closed


def test_off_is_the_plain_loop():
    recorder = _Recorder(4)
    assert consume(recorder, pipelined(recorder, "off"), start=1, limit=3) == [1, 2, 3]
    assert recorder.events == ["pull 0", "train 0", "pull 1", "train 1", "pull 2", "train 2"]


def test_modes(monkeypatch):
    model = nn.Linear(1, 1)  # no sharded collection: auto is off
    assert [pipeline_enabled(m, model) for m in ("auto", "on", "off")] == [False, True, False]
    for device, expected in (("cpu", False), ("cuda", True)):  # auto: sharded tables on CUDA
        found = [SimpleNamespace(device=torch.device(device))]
        monkeypatch.setattr(pipeline_module, "sharded_collections", lambda model, f=found: f)
        assert pipeline_enabled("auto", model) is expected
    with pytest.raises(ValueError, match="train.pipeline = 'yes'; expected one of 'auto'"):
        TrainPipeline(model, "yes")
    with pytest.raises(ValueError, match="'train.pipeline' must be one of 'auto', 'on', 'off'"):
        load_config(None, ["--train.pipeline=true"])


def test_on_says_it_is_inactive_where_nothing_runs_ahead(tmp_path, capsys):
    model = nn.Linear(1, 1)  # one process: no collection exchanges ids, none is tiered
    assert (
        "is inactive here: no embedding collection exchanges ids" in TrainPipeline(model, "on").note
    )
    assert TrainPipeline(model, "auto").note is None and TrainPipeline(model, "off").note is None
    run(tmp_path, *TINY, "--train.max_steps=1", "--train.pipeline=on")
    out = capsys.readouterr().out
    assert out.count('train.pipeline = "on" is inactive here') == 1
    assert "(one process, or every table data_parallel) and none is tiered" in out


# --- Through the trainer ----------------------------------------------------------------------


def run(run_dir, *args):
    return train(load_config(None, [f"--run.dir={run_dir}", *args]))


def events(run_dir, split: str) -> list[dict]:
    """The run's events of ``split``, without their timings."""
    found = [e for e in read_metrics(run_dir / "metrics.jsonl") if e["split"] == split]
    return [{k: v for k, v in e.items() if not k.startswith("time")} for e in found]


def assert_same_run(run_dir, other, result, other_result) -> None:
    for split in ("valid", "test", "early_stop"):
        assert events(run_dir, split) == events(other, split), split
    losses = {e["step"]: e["loss"] for e in events(run_dir, "train")}
    assert losses == {e["step"]: e["loss"] for e in events(other, "train")}
    assert result.steps == other_result.steps
    ours, theirs = load_model(result.checkpoint), load_model(other_result.checkpoint)
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """RUN pipelined, with a checkpoint at step 6."""
    run_dir = tmp_path_factory.mktemp("straight")
    return run_dir, run(run_dir, *RUN, "--checkpoint.every_steps=6", "--train.pipeline=on")


def test_pipelined_run_equals_the_plain_loop(straight, tmp_path):
    run_dir, result = straight
    plain = run(tmp_path, *RUN, "--train.pipeline=off")
    assert len(events(tmp_path, "train")) == 12  # into the second epoch
    assert_same_run(run_dir, tmp_path, result, plain)


def test_resume_from_a_step_whose_next_batch_was_pulled_continues_exactly(straight, tmp_path):
    run_dir, result = straight
    middle = run_dir / "checkpoints" / "step_00000006"  # batch 7 was pulled when it was saved
    resumed = run(tmp_path, *RUN, "--train.pipeline=on", f"--checkpoint.resume={middle}")
    losses = {e["step"]: e["loss"] for e in events(tmp_path, "train")}
    assert sorted(losses) == list(range(7, 13))
    assert losses == {e["step"]: e["loss"] for e in events(run_dir, "train") if e["step"] > 6}
    assert resumed.test == result.test
    ours, theirs = load_model(resumed.checkpoint), load_model(result.checkpoint)
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def test_early_stopping_stops_at_the_same_step(tmp_path):
    stopping = [
        *TINY,
        "--train.epochs=20",
        "--train.eval_every_steps=1",
        "--train.dense_lr=0.05",
        "--train.early_stopping_patience=2",
        "--train.early_stopping_metric=valid_logloss",
    ]
    piped = run(tmp_path / "on", *stopping, "--train.pipeline=on")
    plain = run(tmp_path / "off", *stopping, "--train.pipeline=off")
    assert events(tmp_path / "on", "early_stop"), "the run never stopped: the test proves nothing"
    assert_same_run(tmp_path / "on", tmp_path / "off", piped, plain)
