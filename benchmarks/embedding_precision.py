"""Measure what the storage dtype of the tables and the rounding of their updates cost in model
quality and speed: the DLRM recipe trained with fp32, bf16 and fp16 tables.

Variants, each a full ``recsys train`` run of ``configs/dlrm_synthetic.toml`` (fused Adagrad,
lr 0.05) from the same seed on the same synthetic data:

- ``fp32``: the recipe as it is;
- ``bf16_stochastic`` / ``fp16_stochastic``: tables stored in bf16 / fp16, pooled in fp32, the
  fused update computed in fp32 and written back with stochastic rounding (the default);
- ``bf16_nearest``: bf16 tables, updates rounded to nearest (``train.embedding_stochastic_
  rounding=false``), which drops every update smaller than half a unit in the last place.

Each row: samples/s of the run (``throughput``), its step time from the train events' rates
(p20 / p50 / p80 over the logged windows), and in ``notes`` the test AUC and logloss next to the
oracle AUC of the synthetic teacher. Quick mode trains on 500k samples instead of 2M;
``--set train.embedding_optimizer=sgd train.embedding_lr=0.005`` changes the recipe for every
variant (small updates are where the rounding matters).

Run: ``python -m benchmarks.embedding_precision [--quick | --full]``; rows go to
``benchmarks/results/embedding_precision.csv`` (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._harness import (
    REPO_ROOT,
    Row,
    Timing,
    add_common_args,
    environment,
    format_table,
    is_quick,
    load_note,
    resolve_device,
    write_rows,
)
from recsys.config import load_config
from recsys.train.metrics import read_metrics
from recsys.train.trainer import train

TOPIC = "embedding_precision"
RECIPE = REPO_ROOT / "configs" / "dlrm_synthetic.toml"
VARIANTS = {
    "fp32": ["--model.embedding_dtype=fp32"],
    "bf16_stochastic": ["--model.embedding_dtype=bf16"],
    "bf16_nearest": [
        "--model.embedding_dtype=bf16",
        "--train.embedding_stochastic_rounding=false",
    ],
    "fp16_stochastic": ["--model.embedding_dtype=fp16"],
}


def step_timing(metrics_path: Path, batch_size: int) -> Timing:
    """Percentiles of the step time over the logged train windows."""
    rates = [e["samples_per_s"] for e in read_metrics(metrics_path) if e["split"] == "train"]
    steps_ms = sorted(1000 * batch_size / rate for rate in rates)

    def at(q: float) -> float:
        return steps_ms[min(len(steps_ms) - 1, int(q * len(steps_ms)))]

    return Timing(p20_ms=at(0.2), p50_ms=at(0.5), p80_ms=at(0.8), repeats=len(steps_ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="recipe overrides for every variant, e.g. train.embedding_optimizer=sgd",
    )
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    size = ["--data.synthetic.num_train_samples=500000"] if quick else []
    common = [*size, f"--run.device={device}", "--train.progress_bar=false"]
    common += ["--checkpoint.save_final=false", *(f"--{item}" for item in args.set)]
    rows = []
    for name in args.variants:
        with tempfile.TemporaryDirectory() as run_dir:
            overrides = [*common, *VARIANTS[name], f"--run.dir={run_dir}", f"--run.name={name}"]
            config = load_config(RECIPE, overrides)
            note = load_note()
            result = train(config)
            timing = step_timing(Path(run_dir) / "metrics.jsonl", config.train.batch_size)
        test = result.test
        rows.append(
            Row(
                op=TOPIC,
                pass_="train",
                provider=name,
                config=(
                    f"recipe=dlrm_synthetic train_samples="
                    f"{config.data.synthetic.num_train_samples} dim={config.model.embedding_dim}"
                    f" optimizer=fused_{config.train.embedding_optimizer}"
                    f" lr={config.train.embedding_lr}"
                ),
                dtype=config.model.embedding_dtype,
                timing=timing,
                throughput=result.samples_per_s,
                throughput_unit="samples/s",
                notes=(
                    f"test_auc={test['auc']:.4f} test_logloss={test['logloss']:.4f} "
                    f"oracle_auc={test['oracle_auc']:.4f}; {note}"
                ),
            )
        )
    path = write_rows(TOPIC, rows, env, args.out_dir)
    lines = [
        [r.provider, r.notes.split(";")[0], f"{r.throughput:,.0f}", f"{r.timing.p50_ms:.1f}"]
        for r in rows
    ]
    print()
    print(format_table(["variant", "test metrics", "samples/s", "step p50 ms"], lines))
    print(f"\n{len(rows)} rows appended to {path}")


if __name__ == "__main__":
    main()
