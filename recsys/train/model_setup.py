"""The trained model of a run, ready for its first step: built from ``[model]`` (its tables on
the ``meta`` device under torchrun, so no rank ever holds a table whole), fine-tuned from
``checkpoint.init_from``, given its fused embedding optimizer and frozen modules, compiled, and
sharded over the ranks (each rank materializing only its own shards)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsys.build.dynamic_tables import capacity_note
from recsys.build.models import build_model, fused_embedding_optimizer
from recsys.build.sharding import parallelize_from_config
from recsys.build.tiered_tables import tiered_collections
from recsys.checkpoint.finetune import freeze, init_from_checkpoint
from recsys.checkpoint.io import read_config, resolve_checkpoint
from recsys.config import SEQUENCE_MODELS, Config
from recsys.data.batch import DatasetSpec
from recsys.embedding.interface import embedding_collections
from recsys.train.compiled import compile_dense, compile_line, compile_options
from recsys.train.optimizers import configure_embedding_optimizer

__all__ = ["id_checks", "setup_model"]


def setup_model(
    config: Config,
    spec: DatasetSpec,
    device: torch.device,
    world_size: int,
    run_dir: Path,
    resume: Path | None,
    say: Callable[[str], None],
) -> nn.Module:
    """The model, fine-tuned from ``checkpoint.init_from`` (unless resuming from ``resume``),
    with its embedding optimizer, frozen modules, and sharded over ``world_size`` ranks (the
    process group is initialized); ``say`` prints a line on the first rank."""
    ckpt = config.checkpoint
    fine_tune = bool(ckpt.init_from) and resume is None
    parent = resolve_checkpoint(ckpt.init_from) if fine_tune else None
    if resume is not None or parent is not None:
        _check_positions(config, resume or parent, resume, say)
    model = build_model(
        config.model,
        spec,
        device,
        seed=config.run.seed,
        embedding_optimizer=fused_embedding_optimizer(config.train),
        run_dir=run_dir,
        table_device=_table_device(config, world_size, fine_tune),
    )
    if parent is not None:
        say(init_from_checkpoint(model, parent, ckpt))
        tiered = tiered_collections(model)
        if tiered and world_size > 1:
            raise ValueError(_FINE_TUNE_TIERED.format(world_size=world_size))
        for collection in tiered:  # their weights are in the tiered files; states start fresh
            collection.tiered_files().load(parent, weights_only=True)
    if note := capacity_note(model):
        say(note)
    configure_embedding_optimizer(config.train, model)
    for collection in embedding_collections(model).values():
        collection.validate = id_checks(config.train.id_checks, device)
    if ckpt.freeze:
        say(f"frozen: {', '.join(freeze(model, ckpt.freeze))}")
    if config.train.compile or config.train.cuda_graphs:
        paths = compile_dense(model, **compile_options(config.train.cuda_graphs))
        say(compile_line(paths, config.train.cuda_graphs, device))
    if world_size == 1:
        return model
    cfg = config.distributed
    model = parallelize_from_config(model, config, device)
    if cfg.print_plan:
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        say(inner.sharding_plan.describe())
    return model


def id_checks(mode: str, device: torch.device) -> str:
    """``train.id_checks`` on ``device``: "auto" is "async" on CUDA, "sync" elsewhere."""
    if mode == "auto":
        return "async" if device.type == "cuda" else "sync"
    return mode


def _check_positions(
    config: Config, checkpoint: Path, resume: Path | None, say: Callable[[str], None]
) -> None:
    """A sequence model resumed (or fine-tuned) with positions numbered as its checkpoint's:
    the weights load either way, but the learned position vectors mean the other numbering.

    Raises:
        ValueError: resuming with a numbering other than the checkpoint's (fine-tuning says so).
    """
    if config.model.name not in SEQUENCE_MODELS:
        return
    saved = read_config(checkpoint).model.sequence.positions
    ours = config.model.sequence.positions
    if saved == ours:
        return
    message = (
        f"checkpoint {checkpoint} numbers positions {saved} (model.sequence.positions; a "
        f"config saved before the key means from_end) and this run {ours}"
    )
    if resume is not None:
        raise ValueError(f"{message}: resume it with --model.sequence.positions={saved}")
    say(f"{message}: fine-tuning relearns the position vectors for {ours}")


def _table_device(config: Config, world_size: int, fine_tune: bool) -> torch.device | None:
    """``meta`` under torchrun: each rank materializes only its shards (parallelize). A
    fine-tuned run loads its checkpoint into whole tables first, which tiered tables cannot
    hold.

    Raises:
        ValueError: checkpoint.init_from with tiered tables under torchrun."""
    if world_size == 1:
        return None
    if not fine_tune:
        return torch.device("meta")
    if config.model.storage.tier != "device":
        raise ValueError(_FINE_TUNE_TIERED.format(world_size=world_size))
    return None  # tiered tables by overrides only: refused once built


_FINE_TUNE_TIERED = (
    "checkpoint.init_from with tiered tables (model.storage) runs in one process (fine-tuning "
    "loads whole tables before sharding); this run has {world_size} ranks. Fine-tune in one "
    "process, or resume (checkpoint.resume), which loads each rank's share"
)
