"""Evaluation: AUC / logloss of a model over a whole split, on one process or every rank of a
torchrun job. :func:`evaluate_split` is the loop the trainer's evaluations and ``recsys eval``
share; :func:`evaluate_checkpoint` is what ``recsys eval`` runs.

``recsys eval`` evaluates a checkpoint the way its run's final evaluation did: the same batches
(``train.eval_batch_size`` rows, in split order, each rank reading its share of the chunks), the
same model (rebuilt from the checkpoint's ``config.toml`` and ``spec.json``, its tables sharded
under torchrun with the run's ``[distributed]`` options) and the same metrics, so on the run's
own data it reproduces the test event of ``metrics.jsonl`` exactly in one process. Under
torchrun the plan is made for the weights alone (training's also counted the embedding
optimizer's state), so a table may be placed otherwise; only a row-wise table's pooled sums can
then differ, in float rounding.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsys.build.models import build_model, fused_embedding_optimizer
from recsys.build.registry import check_logits
from recsys.build.sharding import parallelize_from_config
from recsys.build.tiered_tables import private_storage, tiered_collections
from recsys.checkpoint.io import (
    CONFIG_FILE,
    checkpoint_shapes,
    load_checkpoint,
    read_spec,
    resolve_checkpoint,
    tensor_reader,
    verify_checkpoint,
)
from recsys.config import (
    SEQUENCE_MODELS,
    TARGET_RANKING_MODELS,
    Config,
    DataConfig,
    load_saved_config,
)
from recsys.data import build_dataset, resolve_source
from recsys.data.batch import Batch, DatasetSpec
from recsys.data.loader import BatchLoader, ChunkedDataset, default_prefetch
from recsys.distributed.parallel import (
    DistributedInfo,
    init_distributed,
    resolve_device,
    shutdown_distributed,
)
from recsys.embedding.dynamic.table import load_every_key
from recsys.embedding.interface import state_to_load
from recsys.train.metrics import BinaryMetrics, eval_line

SPLITS = ("train", "valid", "test")


@torch.no_grad()
def evaluate_split(
    model: nn.Module,
    dataset: ChunkedDataset,
    split: str,
    batch_size: int,
    device: torch.device,
    info: DistributedInfo,
    *,
    prefetch: int = 0,
    filler: Callable[[], Batch] | None = None,
) -> dict[str, Any]:
    """AUC / logloss of ``model`` over the whole ``split`` of ``dataset``, every rank scoring
    its share of the chunks (collective under torch.distributed: every rank calls it).

    Args:
        model: the model, DDP-wrapped or not; put in eval mode for the loop, then back.
        dataset: the chunked dataset.
        split: ``"train"``, ``"valid"`` or ``"test"``.
        batch_size: rows per batch on each rank.
        device: where batches go and the metric states live.
        info: this process's rank and the world size.
        prefetch: batches built ahead by a background thread.
        filler: a batch whose first row a rank with fewer batches than another runs through
            the model (output unused) until every rank ran as many forwards; default: the
            split's first row.

    Returns:
        :meth:`BinaryMetrics.compute`'s ``auc``, ``logloss`` (``auc_<task>`` per task,
        ``oracle_auc`` on synthetic data) plus ``num_samples``, over every rank's samples.
    """
    oracle = getattr(dataset, "click_probability", None)
    metrics = BinaryMetrics(dataset.spec.label_names, device, oracle is not None)
    # The unwrapped module: ranks may hold different numbers of eval batches, and DDP's
    # forward could start collectives that a rank with fewer batches never joins.
    model = model.module if isinstance(model, DistributedDataParallel) else model
    was_training = model.training
    model.eval()
    num_samples = 0
    loader = BatchLoader(
        dataset,
        split,
        batch_size,
        rank=info.rank,
        world_size=info.world_size,
        prefetch=prefetch,
        device=device,
    )
    # Sharded tables make every forward a collective: ranks with fewer batches run
    # one-sample forwards (their output unused) until every rank has had as many.
    extra = _max_over_ranks(len(loader), device) - len(loader)
    batch = None
    for batch in loader:
        logits = model(batch.dense, batch.sparse)  # [B, T]
        check_logits(model, logits, batch.labels)
        metrics.update(logits, batch.labels, oracle(batch) if oracle is not None else None)
        num_samples += batch.batch_size
    if extra:
        if batch is None:
            batch = filler() if filler is not None else dataset.chunk(split, 0).to(device)
        spare = batch.slice(0, 1)
        for _ in range(extra):
            model(spare.dense, spare.sparse)
    model.train(was_training)
    result = metrics.compute()
    result["num_samples"] = _sum_over_ranks(num_samples, device)
    return result


def prefetch_batches(config: DataConfig, device: torch.device) -> int:
    """``data.prefetch_batches`` with -1 (auto) resolved: 4 on CUDA, 0 on CPU."""
    return default_prefetch(config.prefetch_batches, device.type == "cuda")


@dataclass
class EvalResult:
    """What ``recsys eval`` reports.

    Attributes:
        checkpoint: the checkpoint directory evaluated (absolute).
        step: the training step it was saved at.
        split: the split evaluated.
        data: the data, as the trainer names it (``synthetic data``, ``parquet data 'DIR'``).
        metrics: :func:`evaluate_split`'s result.
    """

    checkpoint: Path
    step: int
    split: str
    data: str
    metrics: dict[str, Any]

    def summary(self) -> str:
        """One line: the trainer's eval line, per-task AUCs, the sample count and the data (a
        sequence model: its ranking line and the user count; hstu_ranking: the eval line and the
        user count)."""
        if "num_users" in self.metrics:
            from recsys.train.retrieval import ranking_line

            ranked = "hr@10" in self.metrics
            line = (ranking_line if ranked else eval_line)(self.split, self.step, self.metrics)
            return (
                f"{line}; {self.metrics['num_users']:,} users of {self.data}; checkpoint "
                f"{self.checkpoint}"
            )
        tasks = [
            f"{k.removeprefix('auc_')} {v:.4f}" for k, v in self.metrics.items() if k[:4] == "auc_"
        ]
        per_task = f"; auc per task: {', '.join(tasks)}" if tasks else ""
        return (
            f"{eval_line(self.split, self.step, self.metrics)}{per_task}; "
            f"{self.metrics['num_samples']:,} samples of {self.data}; checkpoint {self.checkpoint}"
        )

    def to_json(self) -> dict[str, Any]:
        """The metrics with what was evaluated: ``checkpoint``, ``step``, ``split``, ``data``."""
        return {
            "checkpoint": str(self.checkpoint),
            "step": self.step,
            "split": self.split,
            "data": self.data,
            **self.metrics,
        }


def evaluate_checkpoint(
    checkpoint: str | Path, overrides: Sequence[str] = (), split: str = "test"
) -> EvalResult:
    """Evaluate a checkpoint on ``split`` of its run's data, or of other data with the same
    features, tables and labels (``--data.path=DIR``). Works in one process and in every process
    of ``torchrun --nproc-per-node=N -m recsys eval ...`` (each rank scores its share).

    Args:
        checkpoint: a checkpoint directory, or a run directory / its ``checkpoints/`` (their
            newest checkpoint).
        overrides: ``--section.key=value`` changes to the checkpoint's ``config.toml``:
            ``data.*`` (``data.path`` alone also resets ``data.source`` to ``auto``),
            ``train.eval_batch_size``, ``run.device``, ... ; ``model.*`` is refused (the model is
            the checkpoint's).
        split: ``"train"``, ``"valid"`` or ``"test"``.

    Returns:
        The metrics, with the checkpoint, its step, the split and the data.

    Raises:
        FileNotFoundError: no checkpoint at ``checkpoint``, or the data is not found.
        CheckpointError: a file of the checkpoint is damaged.
        ValueError: a bad override or split, data whose spec differs from the checkpoint's
            (every difference named), or a split without rows.
    """
    if split not in SPLITS:
        raise ValueError(f"split = {split!r}; expected one of {', '.join(SPLITS)}")
    path = resolve_checkpoint(checkpoint)
    config = checkpoint_config(path, overrides)
    device = resolve_device(config.run.device, int(os.environ.get("LOCAL_RANK", "0")))
    joined = dist.is_initialized()  # called inside a job that set up its own process group
    info = _current_info() if joined else init_distributed(device, config.distributed.cpu_binding)
    try:
        verify_checkpoint(path)  # before its spec.json is trusted, and its tensors read
        spec = read_spec(path)
        if config.model.name in SEQUENCE_MODELS or config.model.name in TARGET_RANKING_MODELS:
            return _evaluate_histories(path, config, spec, device, info, split)
        dataset = _dataset(config, spec, path, new_data="data.path" in _keys(overrides))
        if not sum(dataset.chunk_rows(split, i) for i in range(dataset.num_chunks(split))):
            raise ValueError(f"the {split} split of {data_name(config)} has no rows")
        model, step = _load_model(path, config, spec, device, info)
        metrics = evaluate_split(
            model,
            dataset,
            split,
            config.train.eval_batch_size,
            device,
            info,
            prefetch=prefetch_batches(config.data, device),
        )
        return EvalResult(path, step, split, data_name(config), metrics)
    finally:
        if not joined:
            shutdown_distributed()


def _evaluate_histories(
    path: Path,
    config: Config,
    spec: DatasetSpec,
    device: torch.device,
    info: DistributedInfo,
    split: str,
) -> EvalResult:
    """:func:`evaluate_checkpoint` of a model trained on histories, as its run evaluated: a
    sequence model's ranking (:class:`~recsys.train.retrieval.NextItemTask`) on the histories
    ``config`` names, or hstu_ranking's AUC / logloss
    (:class:`~recsys.train.target_ranking.TargetRankingTask`) on the candidates of ``split``."""
    if config.model.name in SEQUENCE_MODELS:
        from recsys.train.retrieval import NextItemTask as Task
    else:
        from recsys.train.target_ranking import TargetRankingTask as Task

    task = Task(config, device, info, lambda line: None)
    check_spec(spec, task.spec, f"{data_name(config)} and checkpoint '{path}'")
    model, step = _load_model(path, config, spec, device, info)
    return EvalResult(path, step, split, data_name(config), task.evaluate(model, split))


def checkpoint_config(path: Path, overrides: Sequence[str] = ()) -> Config:
    """A checkpoint's ``config.toml`` with ``overrides`` applied (see
    :func:`evaluate_checkpoint`)."""
    keys = _keys(overrides)
    for override, key in zip(overrides, keys, strict=True):
        if key.split(".")[0] == "model":
            raise ValueError(
                f"'{override}': the model is the checkpoint's (its config.toml); model.* keys "
                "cannot be overridden"
            )
    config = load_saved_config(path / CONFIG_FILE, overrides)
    if "data.path" in keys and "data.source" not in keys:
        config.data.source = "auto"  # the new path says what it is
    return config


def check_spec(checkpoint: DatasetSpec, data: DatasetSpec, where: str) -> None:
    """Raise a ValueError naming every difference between the spec a checkpoint was trained
    with and the data's (``where`` names the two in the message)."""
    differences = spec_differences(checkpoint, data)
    if differences:
        raise ValueError(f"{where} do not match: " + "; ".join(differences))


def spec_differences(checkpoint: DatasetSpec, data: DatasetSpec) -> list[str]:
    """One line per field of :class:`DatasetSpec` that differs between a checkpoint's and the
    data's: feature and label names, table sizes (cardinalities), vocabulary fingerprint, id
    encoding."""
    lines = []
    for what, name in (
        ("dense features", "dense_names"),
        ("categorical features", "sparse_names"),
        ("labels", "label_names"),
    ):
        expected, found = getattr(checkpoint, name), getattr(data, name)
        if expected != found:
            lines.append(f"{what}: {_names_difference(expected, found)}")
    if checkpoint.sparse_names == data.sparse_names:
        sizes = zip(
            checkpoint.sparse_names, checkpoint.cardinalities, data.cardinalities, strict=True
        )
        grown = [f"{n} {a:,} -> {b:,}" for n, a, b in sizes if a != b]
        if grown:
            lines.append(f"table sizes (checkpoint -> data): {_first(grown)}")
    if checkpoint.fingerprint != data.fingerprint:
        lines.append(
            f"vocabulary fingerprint: checkpoint {checkpoint.fingerprint[:12] or 'none'}, data "
            f"{data.fingerprint[:12] or 'none'} (its ids would mean other rows)"
        )
    if checkpoint.id_encoding != data.id_encoding:
        lines.append(
            f"id encoding: checkpoint {checkpoint.id_encoding}, data {data.id_encoding} (raw "
            "64-bit keys and table rows are different ids)"
        )
    return lines


def _keys(overrides: Sequence[str]) -> list[str]:
    """The config keys ``--section.key=value`` overrides set."""
    return [override.removeprefix("--").partition("=")[0] for override in overrides]


def _names_difference(expected: tuple[str, ...], found: tuple[str, ...]) -> str:
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    if not missing and not extra:
        return "the same names in another order"
    parts = [f"{len(expected)} in the checkpoint, {len(found)} in the data"]
    if missing:
        parts.append(f"missing from the data: {_first(missing)}")
    if extra:
        parts.append(f"not in the checkpoint: {_first(extra)}")
    return ", ".join(parts)


def _first(items: list[str], count: int = 5) -> str:
    more = f" and {len(items) - count} more" if len(items) > count else ""
    return ", ".join(items[:count]) + more


def _dataset(
    config: Config, spec: DatasetSpec, checkpoint: Path, *, new_data: bool
) -> ChunkedDataset:
    """The data ``config`` names (``new_data``: given on the command line, else the
    checkpoint's own), checked against the checkpoint's spec."""
    path = config.data.path
    if path and not new_data and not Path(path).exists():
        raise FileNotFoundError(
            f"the checkpoint's data.path '{path}' is not found (moved, or relative to another "
            "directory?); give the data with --data.path=DIR"
        )
    dataset = build_dataset(config.data, config.run.seed)
    check_spec(spec, dataset.spec, f"{data_name(config)} and checkpoint '{checkpoint}'")
    return dataset


def _load_model(
    path: Path, config: Config, spec: DatasetSpec, device: torch.device, info: DistributedInfo
) -> tuple[nn.Module, int]:
    """The checkpoint's model with its weights, its tables sharded over the ranks with the run's
    ``[distributed]`` options (no optimizer, no DDP); and the checkpoint's step. Collective
    under torchrun."""
    tables = private_storage(config.model.storage)  # never the run's own files
    sharded = info.world_size > 1
    model = build_model(
        config.model,
        spec,
        device,
        seed=config.run.seed,
        embedding_optimizer=fused_embedding_optimizer(config.train),
        table_device=torch.device("meta") if sharded else None,  # each rank: its shards
    )
    if sharded:
        model.requires_grad_(False)  # nothing to all-reduce: parallelize skips DDP
        model = parallelize_from_config(model, config, device)
    shapes, read = checkpoint_shapes(path), tensor_reader(path)
    state = {"model": state_to_load(model, shapes, "model.", read), "step": 0}
    load_checkpoint(path, state, verify=False)  # verified by evaluate_checkpoint
    load_every_key(model)  # scores as the run did, whatever the sharding
    model.load_state_dict(state["model"])
    for collection in tiered_collections(model):  # their rows: every part, those held here
        collection.tiered_files().load(path)
    if tables is not None:
        model.tiered_directory = tables  # removed with the model
    return model.eval(), int(state["step"])


def _current_info() -> DistributedInfo:
    """This process's place in a process group set up by its caller."""
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def data_name(config: Config) -> str:
    """The data, as the trainer's summary names it."""
    histories = (*SEQUENCE_MODELS, *TARGET_RANKING_MODELS)
    source = resolve_source(config.data, sequences=config.model.name in histories)
    if source == "synthetic":
        return "synthetic data"
    if source == "synthetic_sequences":
        return "synthetic interaction log"
    return f"{source} data '{config.data.path}'"


def _max_over_ranks(value: int, device: torch.device) -> int:
    if not dist.is_initialized():
        return value
    total = torch.tensor(value, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return int(total)


def _sum_over_ranks(value: int, device: torch.device) -> int:
    if not dist.is_initialized():
        return value
    total = torch.tensor(value, device=device)
    dist.all_reduce(total)
    return int(total)
