"""Evaluation metrics (AUC, logloss per task, via torchmetrics) and the writer of a run's events:
``metrics.jsonl`` and TensorBoard event files.

torchmetrics gathers its states across ranks on ``compute()`` when torch.distributed is
initialized, so an evaluation that every rank runs over its own share of a split yields the
metrics of the whole split on every rank.
"""

from __future__ import annotations

import json
import math
import numbers
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

TENSORBOARD_DIR = "tensorboard"
"""Where :class:`MetricsLogger` writes TensorBoard event files: this folder beside
``metrics.jsonl`` (``<run dir>/tensorboard/``)."""
EVENT_FILE_PATTERN = "events.out.tfevents.*"
"""The names of TensorBoard event files (those a new run's logger deletes)."""


class BinaryMetrics:
    """Accumulates AUC and logloss of T binary tasks over batches.

    Args:
        label_names: the T task names (used for per-task keys when T > 1).
        device: where the metric states live.
        with_oracle: also accumulate the AUC of a given click probability (the synthetic
            teacher's), reported as ``oracle_auc``.
    """

    def __init__(
        self, label_names: tuple[str, ...], device: torch.device, with_oracle: bool = False
    ) -> None:
        self.label_names = label_names
        self.auc = [BinaryAUROC().to(device) for _ in label_names]
        self.oracle = [BinaryAUROC().to(device) for _ in label_names] if with_oracle else []
        self.logloss = MeanMetric().to(device)
        # per task, when there are several (the mean over tasks is ``logloss``)
        num_task_losses = len(label_names) if len(label_names) > 1 else 0
        self.task_logloss = [MeanMetric().to(device) for _ in range(num_task_losses)]
        self.device = device
        self.updated = False

    @torch.no_grad()
    def update(
        self, logits: torch.Tensor, labels: torch.Tensor, probability: torch.Tensor | None = None
    ) -> None:
        """logits, labels (and the oracle probability): [B, T]."""
        self.updated = True
        losses = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")
        self.logloss.update(losses.flatten())
        for t, metric in enumerate(self.task_logloss):
            metric.update(losses[:, t])
        targets = labels.long()
        scores = torch.sigmoid(logits.float())
        for t, metric in enumerate(self.auc):
            metric.update(scores[:, t], targets[:, t])
        if probability is not None:
            for t, metric in enumerate(self.oracle):
                metric.update(probability[:, t].to(scores.device), targets[:, t])

    def compute(self) -> dict[str, Any]:
        """``auc`` (mean over tasks), ``logloss``, per-task ``auc_<task>`` and
        ``logloss_<task>`` when T > 1, and ``oracle_auc`` when tracked; over every rank's
        samples (collective when distributed)."""
        if not self.updated:
            # A rank without samples still joins the metrics' gathers (torchmetrics skips the
            # sync of a metric never updated, and the other ranks would wait for it).
            empty = torch.empty(0, len(self.label_names), device=self.device)
            self.update(empty, empty, empty if self.oracle else None)
        with warnings.catch_warnings():
            # torchmetrics' cross-rank gather indexes with a list, which torch deprecates.
            warnings.filterwarnings("ignore", message="Using a non-tuple sequence")
            return self._compute()

    def _compute(self) -> dict[str, Any]:
        aucs = [float(m.compute()) for m in self.auc]
        result: dict[str, Any] = {
            "auc": sum(aucs) / len(aucs),
            "logloss": float(self.logloss.compute()),
        }
        if len(aucs) > 1:
            result.update(
                {f"auc_{name}": a for name, a in zip(self.label_names, aucs, strict=True)}
            )
            for name, metric in zip(self.label_names, self.task_logloss, strict=True):
                result[f"logloss_{name}"] = float(metric.compute())
        if self.oracle:
            oracle = [float(m.compute()) for m in self.oracle]
            result["oracle_auc"] = sum(oracle) / len(oracle)
            if len(oracle) > 1:
                result.update(
                    {f"oracle_auc_{n}": a for n, a in zip(self.label_names, oracle, strict=True)}
                )
        return result


class MetricsLogger:
    """Appends one JSON object per event to ``<run dir>/metrics.jsonl`` and writes the event's
    numbers to TensorBoard event files in ``<run dir>/tensorboard/`` (rank 0 only).

    Every event carries ``split``, ``step`` and ``time`` (seconds since the run started, a
    resumed run continuing the clock of the events it keeps). Non-finite floats are written to
    metrics.jsonl as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (the file stays strict JSON),
    and to TensorBoard as they are (its scalars hold NaN and infinities).

    TensorBoard tags are ``<split>/<field>`` at the event's step: ``train/loss``,
    ``train/lr_dense``, ``train/time_forward``, ``valid/auc``, ``valid/auc_<task>``,
    ``test/oracle_auc``, ... Every int or float field becomes a scalar, with no list of names to
    keep up to date; a dict field (counters, say) becomes ``<split>/<field>/<key>`` for each of
    its numbers, nested dicts likewise. Skipped: ``split``, ``step``, ``time`` (TensorBoard
    records each event's wall time itself), bools, strings (checkpoint paths, signal names),
    lists and None; so ``resume`` and ``stop`` events appear in metrics.jsonl only. Scalars are
    float32 in TensorBoard. The event files are flushed after every event, like metrics.jsonl,
    so a crashed run loses neither. View them with ``tensorboard --logdir runs``.

    Args:
        path: the metrics.jsonl file.
        enabled: write (rank 0) or only build the events.
        resume_step: a run resumed from the checkpoint of this step keeps the file's events up
            to that step and drops later ones (logged by the attempt that crashed, and about to
            be redone), so the file reads as one uninterrupted run; TensorBoard hides the later
            steps of the earlier event files likewise (``purge_step``). None: start a new file,
            and delete the event files an earlier run left in ``tensorboard/``.
        tensorboard: also write TensorBoard event files (``run.tensorboard``). False: nothing
            under ``tensorboard/`` is written or deleted.

    Call :meth:`close` at the end of the run: it closes the event file (events logged after
    it go to metrics.jsonl only).
    """

    def __init__(
        self,
        path: Path,
        enabled: bool = True,
        resume_step: int | None = None,
        tensorboard: bool = True,
    ) -> None:
        self.path = path
        self.enabled = enabled
        self.start = time.perf_counter()
        self._writer: SummaryWriter | None = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step is not None and path.is_file():
                kept = [e for e in read_metrics(path) if e["step"] <= resume_step]
            # A resumed run's clock continues from its last kept event.
            self.start -= max((float(e.get("time", 0.0)) for e in kept), default=0.0)
            path.write_text("".join(json.dumps(e) + "\n" for e in kept))
            if tensorboard:
                self._writer = _open_tensorboard(path.parent / TENSORBOARD_DIR, resume_step)

    def log(self, split: str, step: int, **values: Any) -> dict[str, Any]:
        """Write one event (when enabled) and return it as metrics.jsonl holds it."""
        event = {
            "split": split,
            "step": step,
            **values,
            "time": round(time.perf_counter() - self.start, 3),
        }
        for key, value in event.items():
            if isinstance(value, float) and not math.isfinite(value):
                event[key] = str(value)
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(event) + "\n")
        if self._writer is not None:
            # Not "time": TensorBoard records each event's wall time itself.
            fields = {key: value for key, value in values.items() if key != "time"}
            for tag, value in _scalars(split, fields):
                self._writer.add_scalar(tag, value, step)
            self._writer.flush()
        return event

    def close(self) -> None:
        """Flush and close the TensorBoard event file (a no-op without one, or when closed)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _open_tensorboard(directory: Path, resume_step: int | None) -> SummaryWriter:
    """A writer of a new event file in ``directory``. A resumed run's writer hides the steps
    after ``resume_step`` that earlier event files hold; a new run deletes them."""
    # Imported here: only rank 0 with TensorBoard on pays for it.
    from torch.utils.tensorboard import SummaryWriter

    if resume_step is None:
        for old in directory.glob(EVENT_FILE_PATTERN):
            old.unlink()
    # purge_step P hides every step >= P of the earlier files; steps <= resume_step are kept.
    purge_step = None if resume_step is None else resume_step + 1
    return SummaryWriter(str(directory), purge_step=purge_step)


def _scalars(prefix: str, values: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(``<prefix>/<key>``, value) for each int or float of ``values`` (bools excluded), dicts
    flattened into ``<prefix>/<key>/<inner key>``; non-finite floats as they are."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _scalars(f"{prefix}/{key}", value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            yield f"{prefix}/{key}", float(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All events of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def eval_line(split: str, step: int, result: dict[str, Any]) -> str:
    """The line an evaluation prints: ``eval test step 292: auc 0.7650 logloss 0.4711`` (plus
    the oracle's AUC on synthetic data)."""
    line = f"eval {split} step {step}: auc {result['auc']:.4f} logloss {result['logloss']:.4f}"
    if "oracle_auc" in result:
        line += f" (oracle auc {result['oracle_auc']:.4f})"
    return line
