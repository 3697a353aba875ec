"""Evaluation metrics against brute-force references, and the writer of metrics.jsonl and
TensorBoard event files (read back with TensorBoard's own reader).

The gather across ranks (torchmetrics' sync on compute) needs several processes; it is covered
by the multi-rank trainer tests, not here. The README's ``tensorboard --logdir runs/`` is run as a
user runs it, from the venv, and asked for a scalar over HTTP."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recsys.train.metrics import TENSORBOARD_DIR, BinaryMetrics, MetricsLogger, read_metrics

CPU = torch.device("cpu")


def pairwise_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties counting 1/2: every pair, float64."""
    scores, labels = scores.double(), labels.bool()
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins) / (pos.numel() * neg.numel())


def float64_logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over samples and tasks of -(y log p + (1 - y) log(1 - p)), p = sigmoid(x)."""
    x, y = logits.double(), labels.double()
    p = 1.0 / (1.0 + torch.exp(-x))
    return float((-(y * torch.log(p) + (1 - y) * torch.log(1 - p))).mean())


def random_eval(seed: int, num_samples: int, num_tasks: int, tied: bool):
    """Logits (on a coarse grid when ``tied``: many equal logits), labels and oracle
    probabilities."""
    g = torch.Generator().manual_seed(seed)
    if tied:
        logits = torch.randint(-8, 9, (num_samples, num_tasks), generator=g) / 4.0
    else:
        logits = torch.randn(num_samples, num_tasks, generator=g) * 2.0
    rates = torch.linspace(0.1, 0.6, num_tasks)  # a different positive rate per task
    labels = (torch.rand(num_samples, num_tasks, generator=g) < rates).float()
    # The oracle's probabilities on a grid of exact binary fractions: many exact ties.
    probability = (torch.randint(0, 12, (num_samples, num_tasks), generator=g) + 4 * labels) / 16
    return logits, labels, probability


SIZES = (7, 0, 250, 1)  # uneven batches, an empty one included, then the rest


def batches(num_samples: int) -> list[slice]:
    starts = [0, *torch.tensor(SIZES).cumsum(0).tolist()]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], num_samples], strict=True)]


def update_in_batches(metrics, logits, labels, probability=None):
    for rows in batches(logits.shape[0]):
        metrics.update(
            logits[rows], labels[rows], None if probability is None else probability[rows]
        )


def scores_of(logits: torch.Tensor) -> torch.Tensor:
    """sigmoid(logits) batch by batch, as the metric computes them: torch's CPU sigmoid may round
    one logit differently (by an ulp) at different positions of a tensor, so equal logits of
    different batches are not always tied scores."""
    return torch.cat([torch.sigmoid(logits[rows].float()) for rows in batches(logits.shape[0])])


@pytest.mark.parametrize("tied", [True, False])
def test_one_task_auc_and_logloss_match_the_references(tied):
    logits, labels, _ = random_eval(1, 600, 1, tied)
    metrics = BinaryMetrics(("click",), CPU)
    update_in_batches(metrics, logits, labels)
    result = metrics.compute()
    assert set(result) == {"auc", "logloss"}  # no per-task keys for one task
    expected_auc = pairwise_auc(scores_of(logits)[:, 0], labels[:, 0])
    assert result["auc"] == pytest.approx(expected_auc, abs=1e-6)
    assert result["logloss"] == pytest.approx(float64_logloss(logits, labels), rel=1e-6)
    if tied:  # the ties matter: counting them as wins or losses moves the AUC
        scores, positive = scores_of(logits)[:, 0], labels[:, 0].bool()
        strict = pairwise_auc(scores + 1e-4 * positive, labels[:, 0])
        assert abs(strict - expected_auc) > 1e-3


def test_per_task_keys_mean_auc_and_oracle():
    names = ("click", "like", "share")
    logits, labels, probability = random_eval(2, 500, 3, tied=True)
    metrics = BinaryMetrics(names, CPU, with_oracle=True)
    update_in_batches(metrics, logits, labels, probability)
    result = metrics.compute()
    aucs = [pairwise_auc(scores_of(logits)[:, t], labels[:, t]) for t in range(3)]
    oracle = [pairwise_auc(probability[:, t], labels[:, t]) for t in range(3)]
    for t, name in enumerate(names):
        assert result[f"auc_{name}"] == pytest.approx(aucs[t], abs=1e-6)
        assert result[f"oracle_auc_{name}"] == pytest.approx(oracle[t], abs=1e-6)
    assert result["auc"] == pytest.approx(sum(aucs) / 3, abs=1e-6)
    assert result["oracle_auc"] == pytest.approx(sum(oracle) / 3, abs=1e-6)
    assert result["logloss"] == pytest.approx(float64_logloss(logits, labels), rel=1e-6)
    assert set(result) == {"auc", "logloss", "oracle_auc"} | {
        f"{kind}_{n}" for kind in ("auc", "oracle_auc", "logloss") for n in names
    }


def test_oracle_of_one_task_has_no_per_task_key():
    logits, labels, probability = random_eval(3, 200, 1, tied=False)
    metrics = BinaryMetrics(("click",), CPU, with_oracle=True)
    metrics.update(logits, labels, probability)
    result = metrics.compute()
    assert set(result) == {"auc", "logloss", "oracle_auc"}
    assert result["oracle_auc"] == pytest.approx(pairwise_auc(probability, labels), abs=1e-6)


def test_low_precision_logits_are_scored_in_fp32():
    logits, labels, _ = random_eval(4, 300, 2, tied=False)
    half = logits.bfloat16()
    low, full = BinaryMetrics(("a", "b"), CPU), BinaryMetrics(("a", "b"), CPU)
    low.update(half, labels)
    full.update(half.float(), labels)
    assert low.compute() == full.compute()


def test_a_task_with_one_class_scores_auc_0_with_torchmetrics_warning():
    """Undefined AUC (no positives, or no negatives): torchmetrics warns and returns 0, which
    then enters the mean over tasks."""
    logits, labels, _ = random_eval(5, 200, 2, tied=False)
    labels[:, 1] = 0.0
    metrics = BinaryMetrics(("a", "b"), CPU)
    metrics.update(logits, labels)
    with pytest.warns(UserWarning, match="No positive samples"):
        result = metrics.compute()
    assert result["auc_b"] == 0.0
    assert result["auc"] == pytest.approx(pairwise_auc(logits[:, 0], labels[:, 0]) / 2, abs=1e-6)
    assert result["logloss"] == pytest.approx(float64_logloss(logits, labels), rel=1e-6)
    only_positive = BinaryMetrics(("a",), CPU)
    only_positive.update(logits[:, :1], torch.ones(200, 1))
    with pytest.warns(UserWarning, match="No negative samples"):
        assert only_positive.compute()["auc"] == 0.0


def test_logger_writes_one_json_object_per_event(tmp_path):
    path = tmp_path / "deep" / "run" / "metrics.jsonl"  # parents are created
    logger = MetricsLogger(path)
    first = logger.log("train", 10, loss=0.5, samples_per_s=1234.5)
    second = logger.log("valid", 20, auc=0.75, logloss=float("nan"), bad=float("inf"))
    assert list(first) == ["split", "step", "loss", "samples_per_s", "time"]
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [first, second]
    assert read_metrics(path) == [first, second]
    # non-finite numbers are written as strings: the file stays strict JSON
    assert second["logloss"] == "nan" and second["bad"] == "inf"
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    assert 0.0 <= first["time"] <= second["time"] < 60.0


def test_logger_disabled_writes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    event = MetricsLogger(path, enabled=False).log("train", 1, loss=1.0)
    assert event["split"] == "train" and event["loss"] == 1.0
    assert not path.exists()
    assert not (tmp_path / TENSORBOARD_DIR).exists()


def test_logger_on_resume_keeps_events_up_to_the_step_and_continues_the_clock(tmp_path):
    path = tmp_path / "metrics.jsonl"
    old = [{"split": "train", "step": s, "loss": 1.0 / s, "time": 100.0 * s} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(e) + "\n" for e in old) + "\n")  # a trailing blank line
    assert read_metrics(path) == old
    logger = MetricsLogger(path, resume_step=2)
    assert read_metrics(path) == old[:2]
    event = logger.log("train", 3, loss=0.3)
    assert 200.0 <= event["time"] < 260.0  # continues from the last kept event's time
    assert read_metrics(path) == [*old[:2], event]


def test_logger_without_resume_starts_a_new_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"split": "train", "step": 1, "time": 5.0}) + "\n")
    logger = MetricsLogger(path)
    assert path.read_text() == ""
    assert logger.log("test", 0, auc=0.5)["time"] < 60.0
    assert [e["split"] for e in read_metrics(path)] == ["test"]


def test_logger_values_keep_their_types(tmp_path):
    path = tmp_path / "metrics.jsonl"
    MetricsLogger(path).log("train", 3, epoch=1, loss=math.pi, note="x", flags=[1, 2])
    (event,) = read_metrics(path)
    assert event["epoch"] == 1 and isinstance(event["epoch"], int)
    assert event["loss"] == math.pi and event["note"] == "x" and event["flags"] == [1, 2]


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``run_dir/tensorboard``, as TensorBoard shows them
    (purged steps hidden): tag -> [(step, value)]."""
    reader = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }


def event_files(run_dir) -> list:
    return sorted((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))


def test_logger_writes_numeric_fields_as_tensorboard_scalars(tmp_path):
    """Tags ``<split>/<field>`` at the event's step, new fields picked up without a list of
    names; strings, bools, lists, None and the clock skipped; dicts flattened."""
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    logger.log("resume", 0, checkpoint="runs/x/checkpoints/step_00000000")
    train = {"epoch": 0, "loss": 0.6931, "samples_per_s": 12345.5, "lr_dense": 1e-3}
    train |= {"lr_embedding": 0.05, "time_data": 2e-4, "time_forward": 1.5e-3}
    logger.log("train", 10, **train, note="x", flag=True, flags=[1, 2], missing=None)
    logger.log("train", 20, **{**train, "epoch": 1, "loss": 0.5})
    valid = {"auc": 0.75, "logloss": 0.45, "num_samples": 4096, "oracle_auc": 0.8}
    valid |= {"auc_click": 0.7, "auc_like": 0.8, "oracle_auc_click": 0.79}
    logger.log("valid", 20, **valid, tables={"t0": {"evicted": 3, "name": "t0"}, "misses": 7})
    logger.log("test", 20, auc=0.74, logloss=0.46)
    logger.log("stop", 20, signal="SIGTERM", checkpoint="runs/x/checkpoints/step_00000020")
    scalars = read_scalars(tmp_path)  # before close(): every event is flushed as it is logged
    logger.close()
    expected_tags = {f"train/{key}" for key in train} | {f"valid/{key}" for key in valid}
    expected_tags |= {"valid/tables/t0/evicted", "valid/tables/misses", "test/auc", "test/logloss"}
    assert set(scalars) == expected_tags
    for key, value in train.items():
        later = 1 if key == "epoch" else 0.5 if key == "loss" else value
        assert scalars[f"train/{key}"] == [(10, pytest.approx(value)), (20, pytest.approx(later))]
    for key, value in valid.items():
        assert scalars[f"valid/{key}"] == [(20, pytest.approx(value))]
    assert scalars["valid/tables/t0/evicted"] == [(20, 3.0)]
    assert scalars["test/auc"] == [(20, pytest.approx(0.74))]
    assert read_metrics(tmp_path / "metrics.jsonl")[1]["note"] == "x"  # still in the JSON


def test_tensorboard_keeps_non_finite_values(tmp_path):
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    event = logger.log("train", 5, loss=float("nan"), grad=float("inf"), low=float("-inf"))
    logger.close()
    assert (event["loss"], event["grad"], event["low"]) == ("nan", "inf", "-inf")  # JSON
    scalars = read_scalars(tmp_path)
    assert math.isnan(scalars["train/loss"][0][1])
    assert scalars["train/grad"] == [(5, math.inf)] and scalars["train/low"] == [(5, -math.inf)]


def test_resumed_logger_hides_the_later_steps_in_tensorboard(tmp_path):
    """The attempt that crashed logged steps 1-4; the run resumes from the checkpoint of step 2:
    TensorBoard shows steps 1-2 of the first attempt and 3-4 of the second, nothing twice."""
    path = tmp_path / "metrics.jsonl"
    crashed = MetricsLogger(path)  # never closed: it crashed
    for step in (1, 2, 3, 4):
        crashed.log("train", step, loss=1.0 / step)
    crashed.log("valid", 2, auc=0.6)
    crashed.log("valid", 4, auc=0.7)
    resumed = MetricsLogger(path, resume_step=2)
    resumed.log("resume", 2, checkpoint="checkpoints/step_00000002")
    resumed.log("train", 3, loss=0.3)
    resumed.log("train", 4, loss=0.2)
    resumed.close()
    assert len(event_files(tmp_path)) == 2  # the crashed attempt's file is kept
    scalars = read_scalars(tmp_path)
    expected = [(1, 1.0), (2, 0.5), (3, 0.3), (4, 0.2)]  # TensorBoard's scalars are float32
    assert scalars["train/loss"] == [(step, pytest.approx(loss)) for step, loss in expected]
    assert scalars["valid/auc"] == [(2, pytest.approx(0.6))]  # step 4's is not redone yet
    assert [e["step"] for e in read_metrics(path) if e["split"] == "train"] == [1, 2, 3, 4]


def test_new_run_replaces_the_event_files_of_an_earlier_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    earlier = MetricsLogger(path)
    earlier.log("train", 7, loss=0.9, old_field=1.0)
    earlier.close()
    (tmp_path / TENSORBOARD_DIR / "notes.txt").write_text("mine")
    (old_file,) = event_files(tmp_path)
    logger = MetricsLogger(path)
    logger.log("train", 1, loss=0.4)
    logger.close()
    (new_file,) = event_files(tmp_path)
    assert new_file != old_file
    assert read_scalars(tmp_path) == {"train/loss": [(1, pytest.approx(0.4))]}
    assert (tmp_path / TENSORBOARD_DIR / "notes.txt").read_text() == "mine"  # only event files


def test_tensorboard_off_writes_and_deletes_no_event_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path, tensorboard=False)
    logger.log("train", 1, loss=0.4)
    logger.close()
    assert [e["loss"] for e in read_metrics(path)] == [0.4]
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    earlier = MetricsLogger(path)
    earlier.log("train", 1, loss=0.5)
    earlier.close()
    MetricsLogger(path, tensorboard=False).log("train", 1, loss=0.6)
    assert read_scalars(tmp_path) == {"train/loss": [(1, 0.5)]}  # left as it was


def test_close_is_idempotent_and_later_events_go_to_json_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path)
    logger.log("train", 1, loss=0.5)
    logger.close()
    logger.close()
    logger.log("test", 1, auc=0.5)
    assert [e["split"] for e in read_metrics(path)] == ["train", "test"]
    assert set(read_scalars(tmp_path)) == {"train/loss"}
    assert len(event_files(tmp_path)) == 1
    MetricsLogger(path, enabled=False).close()  # nothing to close


def test_per_task_logloss_of_several_tasks_and_their_mean():
    torch.manual_seed(3)
    logits, labels = torch.randn(50, 2), torch.randint(0, 2, (50, 2)).float()
    metrics = BinaryMetrics(("click", "buy"), torch.device("cpu"))
    metrics.update(logits[:20], labels[:20])
    metrics.update(logits[20:], labels[20:])
    result = metrics.compute()
    per_task = F.binary_cross_entropy_with_logits(
        logits.double(), labels.double(), reduction="none"
    ).mean(dim=0)
    assert result["logloss_click"] == pytest.approx(float(per_task[0]), rel=1e-6)
    assert result["logloss_buy"] == pytest.approx(float(per_task[1]), rel=1e-6)
    assert result["logloss"] == pytest.approx(float(per_task.mean()), rel=1e-6)
    single = BinaryMetrics(("click",), torch.device("cpu"))
    single.update(logits[:, :1], labels[:, :1])
    assert "logloss_click" not in single.compute()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensorboard_command_serves_the_run_scalars(tmp_path):
    """``tensorboard --logdir runs/`` (the README's command, from the venv's own bin) starts
    and serves what a run's logger wrote: one scalar read back over HTTP on a local port, within
    60 s. The process (and its data server) is always ended."""
    logger = MetricsLogger(tmp_path / "runs" / "tiny" / "metrics.jsonl")
    logger.log("train", 4, loss=0.625, samples_per_s=1000.0)
    logger.log("train", 8, loss=0.5, samples_per_s=1000.0)
    logger.close()
    port = free_port()
    command = [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(tmp_path / "runs")]
    command += ["--port", str(port), "--host", "127.0.0.1"]
    query = urllib.parse.urlencode({"tag": "train/loss", "run": f"tiny/{TENSORBOARD_DIR}"})
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
    log = tmp_path / "tensorboard.log"
    with log.open("wb") as output:
        # its own process group: ending it ends the data server it starts too
        server = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        points, deadline = None, time.monotonic() + 60.0
        while points is None and time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"tensorboard exited with {server.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    points = json.loads(response.read())
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                time.sleep(0.5)  # not listening yet, or the run not loaded yet
        assert points is not None, f"no answer from tensorboard in 60 s:\n{log.read_text()}"
        # [[wall time, step, value], ...]; TensorBoard's scalars are float32
        assert [(step, value) for _, step, value in points] == [(4, 0.625), (8, 0.5)]
    finally:
        end_group(server)


def end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group led by ``process`` (SIGKILL after 10 s); what already
    exited is left alone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the whole group is gone
        try:
            process.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
