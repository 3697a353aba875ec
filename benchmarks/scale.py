"""``recsys plan``'s prediction against a run: bytes, memory and step time per rank.

For each world size W (``--world-sizes``, gloo ranks of this machine under torchrun):

1. ``torchrun --nproc-per-node=W -m recsys plan --calibrate`` measures this launch (links,
   memory bandwidth, matrix throughput, per-op floor, how much slower host work runs with every
   rank busy and how long ranks wait at a collective) into a topology file;
2. ``torchrun --nproc-per-node=W -m recsys train`` of the recipe (``--config``, default
   ``configs/dlrm_synthetic.toml``) for ``--steps`` steps, logging every ``--log-every``: rank 0's
   ``comm_bytes_<kind>`` per step and the samples/s of each window (the first window, with the
   warm-up, is dropped; the median of the others is the measured step), and its tables' bytes;
3. the same plan made in this process (the recipe's model on ``meta``, the run's planner
   options, its train loader timed here as ``recsys plan --topology FILE`` times it) and its
   :func:`~recsys.distributed.step_cost.predict_step` on the calibrated topology, as ``recsys
   plan`` makes it: with the ranks' step timed here
   (:func:`~recsys.train.rank_timing.rank_step_seconds`), and, in the notes, with nothing timed
   but the batches.

``--project W ...`` runs nothing: it writes ``recsys plan``'s prediction of the MLPerf
DLRM-DCNv2 recipe and the default recipe (8,192 samples per GPU) on a hardware preset, flat and
2D (a group per node, synced every ``--sync-every`` steps), to ``scale_projection.csv``: memory
per GPU, the busiest rank's bytes per step inside and across nodes, the predicted step and
samples/s. A model, not a measurement.

One row per world size and kind (``flat``, and from 4 ranks ``2D``: groups of 2 ranks,
``distributed.sparse_replicas`` = W / 2, synced every step): predicted and measured bytes per
step for rank 0 (input, forward, backward), rank 0's tables and optimizer state (predicted, and
the trainer's ``sharding`` event), and predicted and measured step time with their ratio; the
notes split both steps: the prediction's parts, and rank 0's measured data wait, forward,
backward, optimizer and embedding collectives (the trainer's timers: the collectives' time
taken out of the parts they ran in; DDP's all-reduce stays in the backward). The
bytes of variable bags, row-wise and replicated tables depend on the ids drawn (the model takes
their expectation: the synthetic log's bag sizes and its power law over each table's rows), so
they match exactly only for fixed bags and tables whose bytes do not depend on which ids come
(a test); here the relative differences are in the row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks._harness import add_common_args, append_csv, environment, format_table, load_note

if TYPE_CHECKING:
    from recsys.distributed.step_cost import StepPrediction
    from recsys.distributed.topology import Topology

TOPIC = "scale"
COLUMNS = (
    *("world_size", "kind", "recipe", "bytes_input_pred", "bytes_input", "bytes_forward_pred"),
    *("bytes_forward", "bytes_backward_pred", "bytes_backward", "memory_pred_mib", "memory_mib"),
    *("step_ms_pred", "step_ms", "step_ratio", "device", "versions", "commit", "timestamp"),
    "notes",
)
REPO_ROOT = Path(__file__).resolve().parents[1]


def torchrun(world: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={world}", "-m", "recsys", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done


def measure(
    world: int, replicas: int, args: argparse.Namespace, overrides: list[str], work: Path
) -> dict:
    """Train, read rank 0's events: bytes per step, its tables' bytes and the median step."""
    from recsys.train.metrics import read_metrics
    from recsys.train.progress import STEP_PARTS

    run_dir = work / f"run_{world}_{replicas}"
    overrides = [*overrides, f"--distributed.sparse_replicas={replicas}"]
    torchrun(world, ["train", f"--run.dir={run_dir}", *overrides], args.timeout)
    events = read_metrics(run_dir / "metrics.jsonl")
    train = [e for e in events if e["split"] == "train"]
    if len(train) < 2:
        raise RuntimeError(f"{len(train)} train events: raise --steps over --log-every")
    windows = train[1:]  # the first holds the warm-up
    rate = statistics.median(e["samples_per_s"] for e in windows)
    (sharding,) = [e for e in events if e["split"] == "sharding"]
    out = {"samples_per_s": rate, "windows": len(windows), "table_bytes": sharding["table_bytes"]}
    for kind in ("input", "forward", "backward"):
        out[kind] = statistics.mean(e[f"comm_bytes_{kind}"] for e in windows)
    out["parts"] = {  # rank 0's step split (the trainer's timers), each part's median
        part: statistics.median(e[f"time_{part}"] for e in windows)
        for part in STEP_PARTS
        if all(f"time_{part}" in e for e in windows)
    }
    return out


def predict(world: int, replicas: int, recipe: str, overrides: list[str], topology_file: Path):
    """The run's plan, made here, and its prediction on the calibrated topology as ``recsys
    plan`` makes it (the ranks' step timed here, each with its peers mirrored); the prediction
    with nothing timed but the batches; how the step was timed."""
    from dataclasses import replace

    from recsys.build.sharding import plan_inputs, planner_options, step_inputs
    from recsys.config import load_config
    from recsys.distributed.step_cost import predict_step
    from recsys.distributed.topology import load_topology
    from recsys.train.rank_timing import rank_step_seconds

    config = load_config(recipe, overrides)
    cluster = load_topology(topology_file)
    cuda = cluster.device == "cuda"
    inputs = plan_inputs(config, time_input=True, ranks_per_node=cluster.ranks_per_node, cuda=cuda)
    options = planner_options(config, cluster.ranks_per_node, inputs.pooling_factors)
    plan = inputs.plan(world // replicas, options)  # what the run planned (no memory limit)
    sync = config.distributed.sync_every
    pipeline = config.train.pipeline == "on"
    step = step_inputs(config, inputs, pipeline=pipeline, replicas=replicas, sync_every=sync)
    modelled = predict_step(plan, inputs.configs, step, cluster)
    compute_s, how = rank_step_seconds(config, world, replicas, sync)
    step = replace(step, compute_s=compute_s)
    return predict_step(plan, inputs.configs, step, cluster), modelled, cluster, how


def row(world, replicas, args, measured, predicted, modelled, how, cluster, env, load) -> list:
    """One CSV line: rank 0's bytes per step, predicted and measured; the busiest rank's
    tables; the step, predicted (``recsys plan``'s: the ranks' step timed, ``how``) and
    measured; in the notes, the parts of both and the prediction with no compute timed
    (``modelled``)."""
    step_ms = 1e3 * world * args.batch_size / measured["samples_per_s"]
    pred_ms = 1e3 * predicted.step_s
    bytes_ = []
    for kind in ("input", "forward", "backward"):
        bytes_ += [float(predicted.rank_bytes(kind)[0]), measured[kind]]
    parts = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in predicted.seconds.items() if v)
    split = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in measured["parts"].items())
    model = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in modelled.seconds.items() if v)
    notes = (
        f"gloo ranks on this CPU; {measured['windows']} windows of {args.log_every} steps after "
        f"the first; predicted ms: {parts}; compute: {how}; measured ms (rank 0, each part's "
        f"median over the windows): {split}; with no compute timed (lookups, updates and dense "
        f"part modelled): {1e3 * modelled.step_s:.3f} ms, "
        f"{modelled.step_s / (step_ms / 1e3):.3f} of the measured ({model}); "
        f"calibrated: {cluster.describe()}; {load}"
    )
    kind = "flat" if replicas == 1 else f"2D {replicas}x{world // replicas}"
    return [
        world, kind, f"{args.config} batch {args.batch_size}/rank", *bytes_,
        float(predicted.table_bytes[0]) / 2**20, measured["table_bytes"] / 2**20, pred_ms,
        step_ms, pred_ms / step_ms,
        env["device"], env["versions"], env["commit"], env["timestamp"], notes,
    ]  # fmt: skip


PROJECTION_TOPIC = "scale_projection"
PROJECTION_COLUMNS = (
    *("world_size", "kind", "recipe", "hardware", "sync_every", "memory_gib"),
    *("inter_node_mib", "intra_node_mib", "step_ms", "samples_per_s", "versions", "commit"),
    *("timestamp", "notes"),
)
PROJECTED = (  # recipe, samples per rank (the MLPerf reference's 8,192 per GPU), precision
    # MLPerf's submissions train in mixed precision: the MLPerf model in bf16 (the tensor cores'
    # rate); the default recipe as it is configured, fp32.
    ("configs/dlrm_dcnv2_mlperf.toml", 8192, "bf16"),
    ("configs/dlrm_synthetic.toml", 8192, "fp32"),
)


def projection(
    recipe: str,
    batch: int,
    cluster: Topology,
    worlds: list[int],
    sync_every: int,
    precision: str = "fp32",
) -> Iterator[tuple[int, int, StepPrediction]]:
    """``recsys plan``'s prediction of ``recipe`` at ``batch`` samples per rank, trained in
    ``precision`` (``train.precision``), on ``cluster`` for each world size, flat and (past one
    node) 2D with one group per node: yields ``(world, replicas, prediction)``."""
    from recsys.build.sharding import plan_inputs, step_inputs
    from recsys.config import load_config
    from recsys.distributed.step_cost import predict_step

    overrides = [
        f"--train.batch_size={batch}",
        f"--distributed.hardware={cluster.name}",
        f"--train.precision={precision}",
    ]
    config = load_config(recipe, overrides)
    inputs = plan_inputs(config)
    options, _ = inputs.options(config, cluster)
    per_node = cluster.ranks_per_node
    for world in worlds:
        for replicas in [1] + [world // per_node] * (world > per_node):
            plan = inputs.plan(world // replicas, options)
            step = step_inputs(
                config, inputs, pipeline=True, replicas=replicas, sync_every=sync_every
            )
            yield world, replicas, predict_step(plan, inputs.configs, step, cluster)


def project(args: argparse.Namespace, env: dict) -> list[list]:
    """``recsys plan``'s prediction, no run: each recipe of :data:`PROJECTED` on each world
    size of ``--project``, flat and 2D (one group per node), on the ``--hardware`` preset."""
    from recsys.distributed.topology import topology

    cluster, parts = topology(args.hardware), ("input", "forward", "backward", "dense")
    lines = []
    for recipe, batch, precision in PROJECTED:
        for world, replicas, predicted in projection(
            recipe, batch, cluster, args.project, args.sync_every, precision
        ):
            sent = {
                where: sum(predicted.rank_bytes(p, where) for p in (*parts, "replica_sync"))
                for where in ("inter", "intra")
            }
            memory = (predicted.table_bytes.max() + predicted.dense_bytes) / 2**30
            seconds = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in predicted.seconds.items() if v)
            lines.append([
                world, "flat" if replicas == 1 else f"2D {replicas}x{world // replicas}",
                f"{recipe} batch {batch}/rank {precision}", args.hardware,
                args.sync_every if replicas > 1 else "", memory,
                float(sent["inter"].max()) / 2**20, float(sent["intra"].max()) / 2**20,
                1e3 * predicted.step_s, predicted.samples_per_s, env["versions"],
                env["commit"], env["timestamp"],
                f"a model, not a measurement; {cluster.describe()}; predicted ms: {seconds}",
            ])  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--config", default="configs/dlrm_synthetic.toml")
    parser.add_argument("--steps", type=int, default=120, help="train steps per run")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per rank")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per torchrun")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument(
        "--project",
        type=int,
        nargs="+",
        default=None,
        metavar="W",
        help="no runs: recsys plan's prediction of the projected recipes on these world sizes "
        "(rows in scale_projection.csv)",
    )
    parser.add_argument("--hardware", default="h100_8x_ib400", help="--project's preset")
    parser.add_argument("--sync-every", type=int, default=100, help="--project's 2D sync")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("--device: this benchmark runs gloo ranks on this machine's CPU")
    env = environment(torch.device("cpu"))
    if args.project:
        rows = project(args, env)
        path = append_csv(PROJECTION_TOPIC, PROJECTION_COLUMNS, rows, args.out_dir)
        header = ["W", "kind", "recipe", "GiB/GPU", "inter MiB/step", "step ms", "samples/s"]
        table = [
            [r[0], r[1], r[2].split("/")[1], f"{r[5]:.1f}", f"{r[6]:.1f}", f"{r[8]:.2f}",
             f"{r[9]:,.0f}"]
            for r in rows
        ]  # fmt: skip
        print(format_table(header, table))
        print(f"{len(rows)} rows appended to {path}")
        return
    lines = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as temporary:
        work = args.work_dir or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        for world in args.world_sizes:
            overrides = [
                f"--train.batch_size={args.batch_size}",
                f"--data.synthetic.num_train_samples={args.steps * args.batch_size * world}",
                f"--train.log_every_steps={args.log_every}",
                "--train.eval_every_steps=0",
                "--checkpoint.save_final=false",
                "--run.device=cpu",
                "--run.tensorboard=false",
                "--train.progress_bar=false",
            ]
            topology_file = work / f"topology_{world}.toml"
            torchrun(world, ["plan", "--calibrate", str(topology_file)], args.timeout)
            for replicas in [1] + [world // 2] * (world >= 4):  # 2D: groups of 2
                load = load_note()
                recipe = [f"--config={args.config}", *overrides]
                measured = measure(world, replicas, args, recipe, work)
                predicted, modelled, cluster, how = predict(
                    world, replicas, args.config, overrides, topology_file
                )
                timed = (measured, predicted, modelled, how, cluster)
                lines.append(row(world, replicas, args, *timed, env, load))
    path = append_csv(TOPIC, COLUMNS, lines, args.out_dir)
    header = ["W", "kind", "input", "forward", "backward", "MiB", "step ms (pred/meas)"]
    table = [
        [line[0], line[1], f"{line[3]:.0f}/{line[4]:.0f}", f"{line[5]:.0f}/{line[6]:.0f}",
         f"{line[7]:.0f}/{line[8]:.0f}", f"{line[9]:.2f}/{line[10]:.2f}",
         f"{line[11]:.2f}/{line[12]:.2f}"]
        for line in lines
    ]  # fmt: skip
    print(format_table(header, table))
    print(f"{len(lines)} rows appended to {path}")


if __name__ == "__main__":
    main()
