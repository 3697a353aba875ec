"""Gloo ranks on this CPU with ``distributed.cpu_binding`` auto (each rank on its own cores)
against off (the OS places the threads, recsys' behaviour before the option), side by side.

For each recipe (default: the default recipe and DeepFM, 1,024 samples per rank) the two
settings train in turn, ``--repeats`` times each, interleaved (auto, off, auto, off, ...) so
that a change in what else this machine runs falls on both; each run is a torchrun launch of
``--world-size`` ranks on this machine. One row per recipe and setting: the median over the
runs of the step (each run's median over its log windows after the first, from the trainer's
samples/s) and of rank 0's time in the embedding collectives, every run's step in the notes.
With more ranks than cores ``auto`` binds nothing (the rows would time the same thing twice):
the script refuses such a world.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks._harness import add_common_args, append_csv, environment, format_table, load_note
from benchmarks.scale import measure

TOPIC = "cpu_binding"
COLUMNS = (
    *("world_size", "recipe", "cpu_binding", "runs", "step_ms", "collectives_ms"),
    *("samples_per_s", "device", "versions", "commit", "timestamp", "notes"),
)
RECIPES = ("configs/dlrm_synthetic.toml", "configs/deepfm_synthetic.toml")
SETTINGS = ("auto", "off")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--steps", type=int, default=200, help="train steps per run")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per rank")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per torchrun")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("--device: this benchmark runs gloo ranks on this machine's CPU")
    cores = len(os.sched_getaffinity(0))
    if args.world_size > cores:
        raise SystemExit(
            f"--world-size {args.world_size}: more ranks than this machine's {cores} cores, "
            "where cpu_binding = auto binds nothing"
        )
    repeats = args.repeats or 3
    env = environment(torch.device("cpu"))
    world, lines = args.world_size, []
    with tempfile.TemporaryDirectory(prefix="bench_cpu_binding_") as temporary:
        for recipe in args.recipes:
            runs: dict[str, list[dict]] = {setting: [] for setting in SETTINGS}
            load = load_note()
            rows = args.steps * args.batch_size * world
            for _ in range(repeats):
                for setting in SETTINGS:
                    overrides = [
                        f"--config={recipe}",
                        f"--train.batch_size={args.batch_size}",
                        f"--data.synthetic.num_train_samples={rows}",
                        f"--train.log_every_steps={args.log_every}",
                        "--train.eval_every_steps=0",
                        "--checkpoint.save_final=false",
                        "--run.device=cpu",
                        "--run.tensorboard=false",
                        "--train.progress_bar=false",
                        "--run.overwrite=true",
                        f"--distributed.cpu_binding={setting}",
                    ]
                    runs[setting].append(measure(world, 1, args, overrides, Path(temporary)))
            for setting in SETTINGS:
                steps = [1e3 * world * args.batch_size / r["samples_per_s"] for r in runs[setting]]
                collectives = [1e3 * r["parts"].get("collectives", 0.0) for r in runs[setting]]
                step = statistics.median(steps)
                notes = (
                    "gloo ranks on this CPU, one torchrun launch a run, runs interleaved auto/off;"
                    f" {len(steps)} runs of {args.steps} steps, each its median over "
                    f"{args.log_every}-step windows after the first; steps (ms): "
                    + ", ".join(f"{s:.2f}" for s in steps)
                    + f"; {load}"
                )
                lines.append([
                    world, f"{recipe} batch {args.batch_size}/rank", setting, len(steps), step,
                    statistics.median(collectives), world * args.batch_size / step * 1e3,
                    *env.values(), notes,
                ])  # fmt: skip
    path = append_csv(TOPIC, COLUMNS, lines, args.out_dir)
    header = ["W", "recipe", "cpu_binding", "step ms", "collectives ms", "samples/s"]
    table = [
        [line[0], line[1].split("/")[1].split(" ")[0], line[2], f"{line[4]:.2f}",
         f"{line[5]:.2f}", f"{line[6]:,.0f}"]
        for line in lines
    ]  # fmt: skip
    print(format_table(header, table))
    print(f"{len(lines)} rows appended to {path}")


if __name__ == "__main__":
    main()
