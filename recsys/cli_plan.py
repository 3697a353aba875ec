"""``recsys plan``: the plan a config gets on N ranks, flat and 2D, with what each rank holds,
sends and spends per step on a given cluster (:mod:`recsys.distributed.step_cost`), without a
process group (:mod:`recsys.cli` parses the command line)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from recsys.config import Config, load_config

__all__ = ["add_plan_arguments", "run_plan"]


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML recipe, e.g. configs/dlrm_dcnv2_mlperf.toml")
    parser.add_argument("--world-size", type=int, default=0, help="ranks (GPUs) in all")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=0,
        help="distributed.ranks_per_node (default: the preset's or file's)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--hardware",
        default="",
        help="distributed.hardware: a preset (h100_8x_ib400, h200_8x_ib400, a100_8x_ib200, "
        "cpu_host); the planner then minimises predicted seconds on it. Neither this nor "
        "--topology: the config's, else the run's byte-weighted plan, predicted on "
        "h100_8x_ib400",
    )
    where.add_argument(
        "--topology",
        default="",
        help="distributed.topology: a topology TOML file; one --calibrate wrote also has the "
        "train loader timed here and, on CPU hosts, a step of the first 8 ranks (each in this "
        "process, its peers mirrored; run it on a training host)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="2D: tables sharded in groups of world / R ranks, R replicas (default: flat, and "
        "distributed.sparse_replicas when it is > 1, else one group per node)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        default=0,
        help="2D: steps between replica syncs (default: distributed.sync_every)",
    )
    parser.add_argument(
        "--calibrate",
        metavar="FILE",
        default="",
        help="under torchrun: measure this launch's links, memory, compute, host sharing and "
        "the ranks' waits at collectives and write them as a topology file (for --topology / "
        "distributed.topology); plans nothing",
    )


def run_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    """Plan the config on ``--world-size`` ranks and print the plans and predictions.
    ``--hardware``, ``--topology`` and ``--ranks-per-node`` set the ``[distributed]`` keys of
    the same names, so the plan is the one a run of that config makes."""
    from recsys.build.sharding import plan_inputs, run_topology
    from recsys.distributed.topology import topology

    if args.calibrate:
        _calibrate(args.calibrate)
        return
    world = args.world_size
    if world < 1:
        raise ValueError(f"--world-size {world}; expected >= 1")
    if args.sync_every < 0:
        raise ValueError(f"--sync-every {args.sync_every}; expected >= 1")
    flags = [
        f"--distributed.{key}={value}"
        for key in ("hardware", "topology", "ranks_per_node")
        if (value := getattr(args, key))
    ]
    config = load_config(args.config, [*flags, *overrides])
    cluster = run_topology(config)
    planned = "predicted seconds on this cluster" if cluster else "weighted bytes (no cluster set)"
    if cluster is None:  # the run plans in bytes; the prediction needs figures all the same
        cluster = topology("h100_8x_ib400", ranks_per_node=config.distributed.ranks_per_node)
    configured = config.distributed.sparse_replicas
    asked = args.replicas or (configured if configured > 1 else 0)
    replicas = _replica_counts(world, cluster.ranks_per_node, asked)
    sync_every = args.sync_every or config.distributed.sync_every
    # A calibration of the training hosts (a topology file it wrote): their batches are timed
    # here, on one of them.
    inputs = plan_inputs(
        config,
        time_input=bool(cluster.device),
        ranks_per_node=cluster.ranks_per_node,
        cuda=cluster.device == "cuda" if cluster.device else None,
    )
    print(_header(config, inputs, world, cluster, planned))
    for count in replicas:
        print()
        print(_plan_text(config, inputs, world, count, sync_every, cluster))


def _calibrate(path: str) -> None:
    """``--calibrate FILE`` on every rank of a torchrun launch; rank 0 writes the file."""
    import os
    from pathlib import Path

    import torch

    from recsys.distributed.calibrate import calibrate
    from recsys.distributed.parallel import init_distributed, shutdown_distributed
    from recsys.distributed.topology import save_topology

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError(
            "--calibrate measures the links between ranks: launch it with torchrun "
            "--nproc-per-node=2 (or more, and on every node)"
        )
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"--calibrate '{path}': directory '{target.parent}' not found")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = init_distributed(device, "auto")  # as a run binds its ranks by default
    try:
        measured, notes = calibrate(device)
    finally:
        shutdown_distributed()
    if info.is_main:
        save_topology(measured, target, notes)
        print(f"recsys: wrote {target}: {measured.describe()}")


def _replica_counts(world: int, per_node: int, asked: int) -> list[int]:
    """Flat, and ``asked`` replicas (0: one group per node, when there are several nodes)."""
    if asked:
        if asked < 1 or world % asked:
            raise ValueError(f"--replicas {asked}: expected a divisor of --world-size {world}")
        return sorted({1, asked})
    if world > per_node and world % per_node == 0:
        return [1, world // per_node]
    return [1]


def _header(config: Config, inputs, world: int, topo, planned: str) -> str:
    tables = [c for group in inputs.configs.values() for c in group]
    rows = sum(c.num_embeddings for c in tables)
    ids = sum(inputs.pooling_factors.get(f, 1.0) for c in tables for f in c.feature_names)
    batch = config.train.batch_size
    return "\n".join(
        [
            f"recsys plan: model {config.model.name} on {world} ranks, {topo.ranks_per_node} per "
            f"node; a model of a step, not a run of it",
            f"cluster: {topo.describe()}",
            f"  figures from: {topo.source}" if topo.source else "",
            f"tables: {len(tables)}, {rows:,} rows; dense: {inputs.dense_parameters:,} "
            f"parameters ({config.train.dense_optimizer}); ids per sample {ids:g} "
            f"({inputs.pooling_source}); distinct rows a batch touches from "
            f"{inputs.profile_source}",
            f"dense part's step: {inputs.trace_source}",
            f"batches: {inputs.input_source}"
            + (
                " (a --topology FILE that recsys plan --calibrate wrote on the training hosts "
                "times them here)"
                if inputs.input_source == "not measured"
                else ""
            ),
            f"batch: {batch:,} samples per rank (train.batch_size), {batch * world:,} per step",
            f"planner cost: {planned}",
        ]
    ).replace("\n\n", "\n")


def _plan_text(config: Config, inputs, world: int, replicas: int, sync_every: int, topo) -> str:
    from recsys.build.sharding import step_inputs
    from recsys.distributed.step_cost import predict_step

    group = world // replicas
    options, from_device = inputs.options(config, topo)
    limit_note = (
        " (the device's memory less the dense part; distributed.memory_per_rank_gb = 0)"
        if from_device
        else ""
    )
    plan = inputs.plan(group, options)
    # auto: on for sharded tables on GPUs, as the trainer resolves it; off on a calibration of
    # CPU hosts (where the ranks' step is timed unpipelined)
    mode = config.train.pipeline
    pipeline = mode == "on" or (mode == "auto" and topo.device != "cpu")
    step = step_inputs(config, inputs, pipeline=pipeline, replicas=replicas, sync_every=sync_every)
    prediction = predict_step(plan, inputs.configs, step, topo)
    timed = ""
    if topo.device == "cpu":  # a calibration of CPU hosts: a rank's compute is timed here
        from recsys.train.rank_timing import rank_step_seconds

        rank_bytes = int(prediction.table_bytes.max()) + prediction.dense_bytes
        compute_s, how = rank_step_seconds(config, world, replicas, sync_every, rank_bytes)
        timed = f"compute: {how}"
        if compute_s:
            step = replace(step, compute_s=compute_s)
            prediction = predict_step(plan, inputs.configs, step, topo)
    title = (
        f"== flat: tables over all {world} ranks =="
        if replicas == 1
        else f"== 2D: tables over groups of {group} ranks, {replicas} replicas, synced every "
        f"{'step' if sync_every == 1 else f'{sync_every} steps'} =="
    )
    budget = f"memory limit per rank for tables {options['memory_per_rank'] / 2**30:.1f} GiB"
    lines = [title, budget + limit_note, plan.describe(max_ranks=16), "", prediction.describe()]
    return "\n".join(lines + ([timed] if timed else []))
