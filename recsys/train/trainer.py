"""The training loop: data -> model -> BCE loss -> two optimizers, with logging, evaluation and
checkpoints. :func:`train` is what ``recsys train`` runs, on one process or under torchrun.

Events go to ``<run dir>/metrics.jsonl``:

- train: ``{"split": "train", "step", "epoch", "loss", "samples_per_s", "time"}``, the loss
  averaged over the steps since the previous train event, samples/s over all ranks, plus the
  mean seconds per step of each part (``time_<part>``), ``compile_s``, the seconds the window
  spent compiling under torch.compile (left out of samples/s and the parts), and with fp16
  ``loss_scale`` and ``skipped_steps``;
- eval: ``{"split": "valid" | "test", "step", "auc", "logloss", "num_samples", "time"}`` plus
  ``oracle_auc`` on synthetic data and per-task ``auc_<task>`` for multi-task models;
- delta (``checkpoint.delta_every_steps``): ``{"split": "delta", "step", "since", "rows",
  "deletions", "bytes", "path"}``, what the delta of the dynamic tables holds (over all ranks).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from recsys.build.dynamic_tables import dropped_note, dynamic_stat_fields, key_balance
from recsys.build.registry import check_model_class
from recsys.build.tiered_tables import (
    TieredLog,
    cache_note,
    close_stores,
    disk_note,
    tiered_collections,
)
from recsys.checkpoint.delta_writer import DeltaWriter
from recsys.checkpoint.deltas import DELTAS_DIR
from recsys.checkpoint.io import (
    checkpoint_shapes,
    latest_checkpoint,
    load_checkpoint,
    point_best,
    read_config,
    remove_uncommitted,
    rng_state,
    save_checkpoint,
    set_rng_state,
    tensor_reader,
)
from recsys.config import CheckpointConfig, Config, config_differences
from recsys.data.batch import Batch
from recsys.data.layout import DataPosition
from recsys.distributed.parallel import (
    DistributedInfo,
    init_distributed,
    resolve_device,
    shutdown_distributed,
)
from recsys.distributed.ranks import from_first_rank, on_first_rank
from recsys.distributed.replicas import replica_tensors, sync_replicas
from recsys.embedding.interface import (
    embedding_collections,
    state_to_load,
)
from recsys.ops.input_checks import INPUT_ERRORS
from recsys.train.best import best_validation
from recsys.train.evaluate import data_name
from recsys.train.metrics import MetricsLogger
from recsys.train.model_setup import setup_model
from recsys.train.optimizers import (
    build_optimizers,
    learning_rates,
    optimizer_states,
    task_loss_weights,
)
from recsys.train.pipeline import TrainPipeline
from recsys.train.precision import precision_note
from recsys.train.progress import StepTimer, TrainWindow, input_bound_note, summary_line
from recsys.train.resume import data_position, find_resume, resumed_end, session_lineage
from recsys.train.run_dir import (
    METRICS_FILE,
    check_run_dir,
    continuing,
    seed_everything,
    write_run_dir,
)
from recsys.train.schedule import LRSchedule
from recsys.train.step import TrainStep
from recsys.train.stop import StopSignals, TrainingStopped
from recsys.train.tasks import build_task


@dataclass
class TrainResult:
    """What a finished run reports (also printed as the summary line). ``samples_per_s`` is
    over the steps this process trained (None when it resumed at the last step)."""

    run_dir: Path
    steps: int
    samples_per_s: float | None
    test: dict[str, Any]
    checkpoint: Path | None


def train(config: Config) -> TrainResult:
    """Train ``config``'s model on its data; evaluate on the test split; save a checkpoint.

    Works in one process or in each process of ``torchrun --nproc-per-node=N -m recsys train``.
    """
    with _opened(config) as run:
        return run.fit()


def train_steps(config: Config) -> Iterator[int]:
    """The steps of ``config``'s run, one per ``next()``: each trains a step (and what follows
    it: a log event, an evaluation, a checkpoint) and yields its number. For tools that look
    at single steps (``recsys.train.step_audit``); no test evaluation or final checkpoint.
    Closing the generator closes the run."""
    with _opened(config) as run, StopSignals(run.info.world_size) as signals:
        try:
            yield from run._steps(run._window(), tqdm(disable=True), signals)
        finally:
            run.logger.close()


@contextmanager
def _opened(config: Config) -> Iterator[_Run]:
    """The run of ``config`` in this process, its process group and stores closed after."""
    device = resolve_device(config.run.device, int(os.environ.get("LOCAL_RANK", "0")))
    info = init_distributed(device, config.distributed.cpu_binding)
    run = None
    try:
        run = _Run(config, device, info)
        yield run
    finally:
        if run is not None:
            close_stores(run.model)
        shutdown_distributed()


class _Run:
    def __init__(self, config: Config, device: torch.device, info: DistributedInfo) -> None:
        self.config = config
        self.device = device
        self.info = info
        self.run_dir = Path(config.run.dir)
        ckpt = config.checkpoint
        # Decided before anything is written, the same on every rank.
        on_first_rank(
            lambda: check_run_dir(
                self.run_dir, continuing=continuing(config), overwrite=config.run.overwrite
            )
        )
        resume = find_resume(config, self.run_dir, self._print) if ckpt.resume else None
        check_model_class(config.model.name, config.model.args)  # before the data is read
        seed_everything(config.run.seed)
        self.task = build_task(config, device, info, self._print)  # data, loss, evaluation
        self._loader = self.task.loader
        self.model = setup_model(
            config, self.task.spec, device, info.world_size, self.run_dir, resume, self._print
        )
        sizes = (config.train.batch_size, info.world_size, self.task.max_ids_per_sample)
        for note in (cache_note(self.model, *sizes), disk_note(_unwrap(self.model))):
            if note:
                self._print(note)
        self.optimizers = build_optimizers(config.train, self.model)
        task_weights = task_loss_weights(config.train, self.task.spec.num_tasks, device)
        graphs = config.train.cuda_graphs
        self.train_step = TrainStep(
            self.model,
            self.optimizers,
            config.train.precision,
            device,
            task_weights,
            graphs,
            loss=self.task.loss,
        )
        if note := precision_note(config.train.precision, device):
            self._print(note)
        self.steps_per_epoch = self.task.steps_per_epoch()
        self.total_steps = self.steps_per_epoch * config.train.epochs
        if config.train.max_steps > 0:
            self.total_steps = min(self.total_steps, config.train.max_steps)
        self.schedule = LRSchedule(
            config.train,
            self.total_steps,
            list(self.optimizers.values()),
            [c.optimizer for c in embedding_collections(self.model).values() if c.optimizer],
        )
        self.best = best_validation(config)
        self.stopped_early = False
        self.step = 0
        self._synced_step = 0  # 2D: the last step the replicas were averaged at
        self.data_position = DataPosition()  # where the next step's batch comes from
        self.last_checkpoint: Path | None = None
        if resume is not None:
            self._restore(resume)
        self.start_step = self.step  # steps before it were trained by an earlier process
        lineage = session_lineage(config.checkpoint, resume, self.step)
        self.lineage = from_first_rank(lineage)  # one id on every rank
        # Everything above can fail on a bad config or data: only now is the run dir written.
        if info.is_main:
            write_run_dir(config, self._print)
        self.logger = MetricsLogger(
            self.run_dir / METRICS_FILE,
            enabled=info.is_main,
            resume_step=self.step if resume is not None else None,
            tensorboard=config.run.tensorboard,
        )
        if resume is not None:
            self.logger.log("resume", self.step, checkpoint=str(resume))
        if info.world_size > 1:  # rank 0's tables and their state: what recsys plan predicts
            held = [
                t for c in embedding_collections(self.model).values() for t in replica_tensors(c)
            ]
            table_bytes = sum(t.numel() * t.element_size() for t in held)
            self.logger.log("sharding", self.step, table_bytes=table_bytes)
        self.tiered_log = TieredLog(_unwrap(self.model))
        self._train_windows = 0  # closed this session: the first (warm-up) is not judged
        self._said_input_bound = False
        self.deltas = DeltaWriter(self.run_dir / DELTAS_DIR, ckpt.delta_every_steps, self.lineage)
        if stale := self.deltas.start(_unwrap(self.model), self.step):  # written after step
            self._print(f"removed {len(stale)} stale delta(s) after step {self.step}")

    def fit(self) -> TrainResult:
        """Train to ``total_steps``, evaluate on the test split, save the final checkpoint.

        Raises:
            TrainingStopped: SIGINT or SIGTERM arrived; a checkpoint of the step reached was
                saved first (every rank stops at the same step).
        """
        try:
            with StopSignals(self.info.world_size) as signals:
                try:
                    return self._fit(signals)
                except BaseException as error:  # after a second Ctrl-C: whatever it broke raised
                    if signals.interrupted and not isinstance(error, TrainingStopped):
                        self._interrupted()
                    raise
        finally:
            self.logger.close()

    def _fit(self, signals: StopSignals) -> TrainResult:
        cfg, train_cfg = self.config, self.config.train
        total_steps = self.total_steps
        resumed = f", from step {self.step}" if self.step else ""
        cores = len(self.info.cores)
        bound = (
            f"; each rank of this node on its own {cores} CPU core{'s' * (cores > 1)} "
            "(distributed.cpu_binding)"
            if cores
            else ""
        )
        self._print(
            f"recsys: training {cfg.model.name} on {data_name(cfg)} for "
            f"{total_steps} steps{resumed} "
            f"(batch {train_cfg.batch_size} x {self.info.world_size} rank(s), {self.device}); "
            f"run dir {self.run_dir}{bound}"
        )
        progress = tqdm(
            total=total_steps,
            initial=self.step,
            disable=not (self.info.is_main and train_cfg.progress_bar and sys.stderr.isatty()),
            dynamic_ncols=True,
        )
        window = self._window()
        for _ in self._steps(window, progress, signals):
            pass
        progress.close()
        return self._finish(window)

    def _window(self) -> TrainWindow:
        collections = list(embedding_collections(self.model).values())
        stats = [c.comm_stats for c in collections if hasattr(c, "comm_stats")]

        def comm_bytes() -> dict[str, int]:
            return {k: sum(s.bytes[k] for s in stats) for k in stats[0].bytes} if stats else {}

        seconds = lambda: sum(c.communication_seconds() for c in collections)  # noqa: E731
        return TrainWindow(self.device, seconds, comm_bytes=comm_bytes)

    def _steps(self, window: TrainWindow, progress: tqdm, signals: StopSignals) -> Iterator[int]:
        """Train to ``total_steps``, yielding the step number after each step (and what follows
        it: a log event, an evaluation, a checkpoint)."""
        train_cfg, total_steps = self.config.train, self.total_steps
        self.model.train()
        pipeline = TrainPipeline(self.model, train_cfg.pipeline)  # batch i+1 ready during step i
        if pipeline.note:
            self._print(pipeline.note)
        first = self.data_position
        for epoch in range(first.epoch, train_cfg.epochs):
            position = first if epoch == first.epoch else DataPosition(epoch)  # fresh layout
            loader = self._loader("train", epoch, position.batch, position.reshards)
            limit = total_steps - self.step
            for index, batch in pipeline.batches(loader, position.batch, limit=limit):
                window.timer.mark("data")
                self.schedule.apply(self.step)  # before forward: fused updates run in backward
                INPUT_ERRORS.tag = self.step + 1  # what an "async" input check's error names
                window.add(self._train_step(batch, window.timer))
                self.step += 1
                self.data_position = DataPosition(epoch, index + 1, position.reshards)
                progress.update(1)
                self._after_step(epoch, window, progress, signals)
                yield self.step
                if self.stopped_early:
                    break
            if self.step == total_steps or self.stopped_early:
                break

    def _after_step(
        self, epoch: int, window: TrainWindow, progress: tqdm, signals: StopSignals
    ) -> None:
        """What a step may be followed by: a train log line, an evaluation, a checkpoint, and
        a stop when a signal arrived."""
        cfg, train_cfg, total_steps = self.config, self.config.train, self.total_steps
        if self.step % train_cfg.log_every_steps == 0 or self.step == total_steps:
            INPUT_ERRORS.raise_first()  # a bad batch since the last event ("async" checks)
            steps = window.steps
            loss, rate, times = window.close(train_cfg.batch_size * self.info.world_size)
            tiered = self.tiered_log.fields(steps)
            self.logger.log(
                "train",
                self.step,
                epoch=epoch,
                loss=loss,
                samples_per_s=rate,
                **learning_rates(self.optimizers, self.model),
                **self.train_step.log_fields(),
                **times,
                **dynamic_stat_fields(_unwrap(self.model)),
                **tiered,
            )
            progress.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rate:,.0f}")
            if progress.disable:  # no bar: a log line instead
                self._print(
                    f"step {self.step}/{total_steps}  loss {loss:.4f}  {rate:,.0f} "
                    f"{self.task.rate_unit}/s"
                    f"  {self.tiered_log.summary(tiered)}".rstrip()
                )
            self._say_if_input_bound(times)
        if self.step % cfg.distributed.sync_every == 0:  # after the log: the next window's time
            self._sync_replicas()
        if train_cfg.eval_every_steps and self.step % train_cfg.eval_every_steps == 0:
            window.pause(self._validate)
        if self._checkpoint_due(cfg.checkpoint) and self._saved_now() is None:
            window.pause(self.save)
        if self.deltas.due(self.step):
            window.pause(self._write_delta)
        if signals.requested():
            progress.close()
            self._stop(signals.name)

    def _say_if_input_bound(self, times: dict[str, float]) -> None:
        """Once a run: a line when a train window (not the first: warm-up) waited for its
        batches much of its time, naming what makes them."""
        self._train_windows += 1
        if self._train_windows == 1 or self._said_input_bound:
            return
        if note := input_bound_note(times, self.task.batch_makers()):
            self._print(note)
            self._said_input_bound = True

    def _sync_replicas(self) -> None:
        """2D sparse parallelism: average the replicas' shards, once per step at most."""
        if self.config.distributed.sparse_replicas > 1 and self._synced_step != self.step:
            sync_replicas(list(embedding_collections(self.model).values()))
            self._synced_step = self.step

    def _validate(self) -> None:
        """Evaluate on the valid split; keep the checkpoint of a new best validation
        (checkpoint.keep_best), and stop early after early_stopping_patience validations
        without a new best."""
        self._sync_replicas()
        result = self.evaluate("valid")
        if self.best is None:
            return
        cfg = self.config
        if self.best.update(self.step, result):
            if cfg.checkpoint.keep_best:
                point_best(self._saved_now() or self.save())
            return
        patience = cfg.train.early_stopping_patience
        if patience and self.best.since >= patience:
            self.stopped_early = True
            self.logger.log("early_stop", self.step, best_step=self.best.step)
            self._print(
                f"early stop at step {self.step}: {patience} validation(s) without improving "
                f"on {self.best.metric} = {self.best.value:.4f} at step {self.best.step}"
            )

    def _finish(self, window: TrainWindow) -> TrainResult:
        """After the last step: the test evaluation, the final checkpoint, the summary."""
        cfg, train_cfg = self.config, self.config.train
        test = self.evaluate("test")
        checkpoint = None
        if cfg.checkpoint.save_final:
            checkpoint = self._saved_now() or self.save()
        if self.deltas.due(self.step, now=True):
            self._write_delta()
        balance = key_balance(_unwrap(self.model)) if self.info.world_size > 1 else ""
        if balance:
            self._print(balance)
        trained = self.step - self.start_step  # this process's steps, not the resumed ones
        samples_per_s = (
            trained * train_cfg.batch_size * self.info.world_size / window.train_time
            if trained and window.train_time > 0
            else None
        )
        result = TrainResult(self.run_dir, self.step, samples_per_s, test, checkpoint)
        what = f"{cfg.model.name} on {data_name(cfg)}"
        compile_s = window.compile_time
        line = summary_line(what, self.step, test, samples_per_s, trained, self.run_dir, compile_s)
        self._print(line)
        return result

    def _stop(self, signal_name: str) -> None:
        """Save the step reached (unless just saved) and raise :class:`TrainingStopped`."""
        checkpoint = self._saved_now() or self.save()
        self.logger.log("stop", self.step, signal=signal_name, checkpoint=str(checkpoint))
        raise TrainingStopped(signal_name, self.step, checkpoint)

    def _interrupted(self) -> None:
        """A second Ctrl-C stopped the run wherever it was (a checkpoint save's DCP traceback is
        not the user's business): log the stop, remove the save it cut short (one process: no
        other rank writes there; under torchrun the next save or resume does) and raise
        :class:`TrainingStopped` naming the latest committed checkpoint."""
        directory = self.run_dir / "checkpoints"
        if self.info.world_size == 1:
            remove_uncommitted(directory)
        latest = latest_checkpoint(directory)
        checkpoint = str(latest) if latest else None
        self.logger.log("stop", self.step, signal="SIGINT", checkpoint=checkpoint, interrupted=True)
        raise TrainingStopped("SIGINT", self.step, latest, interrupted=True) from None

    def _saved_now(self) -> Path | None:
        """The checkpoint of the current step, when there is one already."""
        last = self.last_checkpoint
        return last if last is not None and last.name == f"step_{self.step:08d}" else None

    def _train_step(self, batch: Batch, timer: StepTimer) -> torch.Tensor:
        return self.train_step(batch, timer)

    @torch.no_grad()
    def evaluate(self, split: str) -> dict[str, Any]:
        """The task's metrics over the whole split (all ranks: AUC / logloss, or the ranking
        metrics of a sequence model), logged as an eval event."""
        INPUT_ERRORS.raise_first()  # a bad training batch first, named by its step
        INPUT_ERRORS.tag = 0
        result = self.task.evaluate(self.model, split)
        INPUT_ERRORS.raise_first()
        self.logger.log(split, self.step, **result)
        self._print(self.task.eval_line(split, self.step, result))
        return result

    def _checkpoint_due(self, config: CheckpointConfig) -> bool:
        return config.every_steps > 0 and self.step % config.every_steps == 0

    def _write_delta(self) -> None:
        """Write the dynamic tables' changes since the previous delta (collective); log a
        ``delta`` event: since, rows, deletions, bytes, path."""
        report = self.deltas.write(_unwrap(self.model), self.step)
        self.logger.log("delta", self.step, **report.fields())

    def save(self) -> Path:
        """Checkpoint everything a resumed run needs to continue exactly (see
        :meth:`_training_state`) under <run dir>/checkpoints. With deltas, the delta of this
        step goes first: the deltas of a run resumed from any checkpoint chain on."""
        INPUT_ERRORS.raise_first()  # never save a run that trained on a bad batch
        self._sync_replicas()  # 2D: every replica saves the same shards
        if self.deltas.due(self.step, now=True):
            self._write_delta()
        path = save_checkpoint(
            self.run_dir / "checkpoints",
            self.step,
            self._training_state(),
            keep=self.config.checkpoint.keep,
            config=self.config,
            spec=self.task.spec,
            protect=self.best.step if self.best and self.config.checkpoint.keep_best else None,
            write_files=self._save_tiered,
            lineage=self.lineage,
        )
        self._print(f"saved checkpoint {path}")
        self.last_checkpoint = path
        return path

    def _save_tiered(self, directory: Path) -> None:
        """Stream the tiered tables' rows into the checkpoint being written."""
        for collection in tiered_collections(_unwrap(self.model)):
            collection.tiered_files().save(directory)

    def _training_state(self) -> dict[str, Any]:
        """The model (sharded tables as ShardedTensors of their full shape, with their fused
        optimizer states: the layout does not depend on the plan), the torch optimizers (by
        parameter name), the LR schedule, the step, the data position (epoch, batches done in
        the epoch's layout of this batch size x world size, the layouts the epoch was read in
        before: ``BatchLoader(..., epoch=e, start_batch=b, reshards=r)`` continues from it) and
        this rank's RNG states. The config is the checkpoint's ``config.toml`` (written by
        save_checkpoint)."""
        return {
            "model": _unwrap(self.model).state_dict(),
            "optimizers": optimizer_states(self.model, self.optimizers)[0],
            "schedule": self.schedule.state_dict(),
            "step": self.step,
            "data_epoch": self.data_position.epoch,
            "data_batch": self.data_position.batch,
            "data_reshards": [list(r) for r in self.data_position.reshards],
            "batch_size": self.config.train.batch_size,
            "world_size": self.info.world_size,
            "rng": {f"rank_{self.info.rank}": rng_state(self.device)},
            **({"loss_scale": scale} if (scale := self.train_step.state_dict()) else {}),
            **({"best": self.best.state_dict()} if self.best else {}),
        }

    def _restore(self, path: Path) -> None:
        """Resume from checkpoint ``path``: what :meth:`_training_state` saved, read back into
        this run's model, optimizers and plan (any world size and sharding)."""
        state = self._training_state()
        rng_key, saved = f"rank_{self.info.rank}", checkpoint_shapes(path)  # keys: one read
        if not any(k.startswith(f"rng.{rng_key}.") for k in saved):
            del state["rng"]  # a rank the saving run did not have: keeps its seeded RNG
        if "best" in state and "best.step" not in saved:
            del state["best"]  # saved without keep_best / early stopping: the best starts over
        if "data_reshards" not in saved:
            del state["data_reshards"]  # saved before reshards were recorded
        if "loss_scale" in state and "loss_scale.scale" not in saved:
            del state["loss_scale"]  # saved by a run without fp16: the scale starts over
        state["optimizers"], live = optimizer_states(self.model, self.optimizers)
        state["model"] = state_to_load(_unwrap(self.model), saved, "model.", tensor_reader(path))
        load_checkpoint(path, state, verify=False)  # verified by find_resume
        _unwrap(self.model).load_state_dict(state["model"])
        for collection in tiered_collections(_unwrap(self.model)):
            collection.tiered_files().load(path)
        for name, optimizer in self.optimizers.items():
            # load_checkpoint filled the live state in place, through the saved view of it
            set_optimizer_state_dict(self.model, [optimizer], live[name])
        if "best" in state:
            self.best.load_state_dict(state["best"])
        if "loss_scale" in state:
            self.train_step.load_state_dict(state["loss_scale"])
        if "rng" in state:
            set_rng_state(state["rng"][rng_key], self.device)
        self.step = state["step"]
        self.last_checkpoint = path  # a run resumed at its last step has nothing left to save
        self._print(f"resumed from {path} at step {self.step}")
        if note := dropped_note(_unwrap(self.model)):
            self._print(note)
        self.data_position = position = data_position(
            state,
            self.info.world_size,
            self.config.train.batch_size,
            lambda epoch, reshards: self._loader("train", epoch, 0, reshards).layout,
            self._print,
        )
        this_epoch = self.steps_per_epoch  # batches of this run's size
        if position.reshards:
            this_epoch = len(self._loader("train", position.epoch, 0, position.reshards))
        total, note = resumed_end(
            self.config, self.info.world_size, self.step, position, this_epoch, self.steps_per_epoch
        )
        if total != self.total_steps:
            self._print(note)
            self.total_steps = self.schedule.total_steps = total
        differences = config_differences(read_config(path), self.config)
        differences = [d for d in differences if not d.startswith("checkpoint.resume:")]
        if differences:
            self._print("config changed since the checkpoint: " + "; ".join(differences))

    def _print(self, message: str) -> None:
        if self.info.is_main:
            tqdm.write(message)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
