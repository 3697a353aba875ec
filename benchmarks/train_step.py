"""Benchmark the default recipe's train step through ``recsys train``, one variant at a time.

The recipe is ``configs/dlrm_synthetic.toml`` (DLRM on the synthetic Criteo-shaped log, 26
tables of dim 16, batch 2048 per rank). Each variant is a real run of the trainer for
``--steps`` steps with a train event every ``--window`` steps; its step time is the window's
wall time over its steps (from ``samples_per_s`` in ``metrics.jsonl``), the first window left out
(warm-up, and the compilation of ``train.compile``). Variants, side by side with the plain
eager fp32 loop they replace:

- one process: ``fp32`` (the plain loop), ``bf16``, ``fp16`` (with loss scaling), ``compile``
  (the dense part under torch.compile), ``compile_bf16``, ``cuda_graphs`` (``train.cuda_graphs``:
  the dense part compiled in mode "reduce-overhead", its forward and backward replayed as CUDA
  graphs; CUDA only: on CPU it is ``compile`` in another mode);
- under torchrun (``--world-size``, gloo on CPU): ``fp32`` with ``train.pipeline=off`` (the plain
  loop) and ``on`` (the next batch's input_dist issued during the step), and ``bf16`` pipelined.

Runs: ``python -m benchmarks.train_step [--variants ...] [--steps N]``; rows go to
``benchmarks/results/train_step.csv`` (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks._harness import (
    Row,
    add_common_args,
    environment,
    format_table,
    load_note,
    resolve_device,
    summarize,
    write_rows,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/dlrm_synthetic.toml"
BATCH = 2048
# name -> (ranks, overrides); ranks 0 means --world-size
VARIANTS = {
    "fp32": (1, []),
    "bf16": (1, ["--train.precision=bf16"]),
    "fp16": (1, ["--train.precision=fp16"]),
    "compile": (1, ["--train.compile=true"]),
    "compile_bf16": (1, ["--train.compile=true", "--train.precision=bf16"]),
    "cuda_graphs": (1, ["--train.cuda_graphs=true"]),
    "ranks_fp32_plain": (0, ["--train.pipeline=off"]),
    "ranks_fp32_pipelined": (0, ["--train.pipeline=on"]),
    "ranks_bf16_pipelined": (0, ["--train.pipeline=on", "--train.precision=bf16"]),
}


def run_variant(
    name: str, world: int, steps: int, window: int, device: torch.device
) -> list[float]:
    """Step times (ms) of each timed window of one ``recsys train`` run."""
    ranks, overrides = VARIANTS[name]
    ranks = ranks or world
    with tempfile.TemporaryDirectory() as run_dir:
        args = [
            "train",
            "--config",
            CONFIG,
            f"--run.dir={run_dir}",
            f"--run.device={device.type}",
            f"--train.max_steps={steps}",
            f"--train.log_every_steps={window}",
            "--train.eval_every_steps=0",
            "--train.progress_bar=false",
            "--checkpoint.save_final=false",
            f"--data.synthetic.num_train_samples={BATCH * ranks * (steps + 1)}",
            "--data.synthetic.num_valid_samples=2048",
            "--data.synthetic.num_test_samples=2048",
            *overrides,
        ]
        if ranks == 1:
            command = [sys.executable, "-m", "recsys", *args]
        else:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command = [*torchrun, f"--nproc-per-node={ranks}", "-m", "recsys", *args]
        env = os.environ | {"PYTHONPATH": str(REPO)}
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: recsys train failed:\n{done.stderr[-3000:]}")
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
    train = [e for e in events if e["split"] == "train"][1:]  # the first window warms up
    return [BATCH * ranks * 1000.0 / e["samples_per_s"] for e in train]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        help="default: all; on CPU all but fp16 (1.6x the fp32 step time here, one thread) and "
        "cuda_graphs (no graphs without CUDA)",
    )
    parser.add_argument("--steps", type=int, default=120, help="steps per run")
    parser.add_argument("--window", type=int, default=10, help="steps per timed window")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    device = resolve_device(args.device)
    if args.variants is None:
        cuda_only = ("fp16", "cuda_graphs")
        args.variants = [v for v in VARIANTS if device.type == "cuda" or v not in cuda_only]
    env = environment(device)
    rows = []
    for name in args.variants:
        times = run_variant(name, args.world_size, args.steps, args.window, device)
        ranks = VARIANTS[name][0] or args.world_size
        timing = summarize(times)
        rows.append(
            Row(
                op="dlrm_recipe_step",
                pass_="train_step",
                provider=name,
                config=f"{CONFIG} batch={BATCH}x{ranks} ranks={ranks} window={args.window}",
                dtype="bf16" if "bf16" in name else "fp16" if "fp16" in name else "fp32",
                timing=timing,
                throughput=BATCH * ranks * 1000.0 / timing.p50_ms,
                throughput_unit="samples/s",
                notes=load_note(),
            )
        )
        print(f"done {name}: p50 {timing.p50_ms:.1f} ms", flush=True)
    plain = {1: "fp32", args.world_size: "ranks_fp32_plain"}
    by_name = {r.provider: r for r in rows}
    lines = []
    for r in rows:
        ranks = VARIANTS[r.provider][0] or args.world_size
        base = by_name.get(plain[ranks])
        vs = f"{base.timing.p50_ms / r.timing.p50_ms:.2f}x" if base else "-"
        lines.append([r.provider, ranks, f"{r.timing.p50_ms:.1f}", f"{r.throughput:,.0f}", vs])
    header = ["variant", "ranks", "p50 step ms", "samples/s", "vs plain fp32"]
    print(format_table(header, lines))
    print(f"{len(rows)} rows appended to {write_rows('train_step', rows, env, args.out_dir)}")


if __name__ == "__main__":
    main()
