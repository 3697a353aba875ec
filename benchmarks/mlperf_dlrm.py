"""Benchmark MLPerf's DLRM-DCNv2 training step: recsys against TorchRec's own ``DLRM_DCN`` under
``DistributedModelParallel``, on the same MLPerf-shaped batches and the same tables.

The model is ``configs/dlrm_dcnv2_mlperf.toml`` as it is (dim 128, bottom MLP 512-256-128, 3
low-rank (512) DCN-v2 cross layers, top MLP 1024-1024-512-256-1, Adagrad at 0.005 on tables and
dense layers, multi-hot bags of MLPerf's fixed sizes, 214 ids a sample) except two things a
CPU machine cannot hold: each table is capped at ``--max-rows`` (MLPerf's 40M-row tables hold
97.4 GiB with as much Adagrad state), and the batch is one of the reference's 8 ranks' (8,192;
``--batch-size``).

Providers, each in a process of its own run one after the other (so each has the machine's
memory to itself; ``--one-process``: both in this process, timed in alternation by
``benchmarks/_harness.py``, which needs the cap to fit twice), on ``--num-batches`` batches of
the recipe's synthetic train split made beforehand (the same in every process), cycled:

- ``recsys``: the recipe's ``dlrm_dcn`` built as ``recsys train`` builds it (tables in memory,
  element-wise Adagrad fused into backward), the trainer's step;
- ``torchrec_dmp_fused``: ``torchrec.models.dlrm.DLRM_DCN`` over an ``EmbeddingBagCollection``
  sharded by ``DistributedModelParallel`` (world of one, gloo), every table TABLE_WISE on the
  FUSED kernel with FBGEMM's EXACT_ADAGRAD at the same learning rate and eps (the optimizer the
  reference fuses into backward), ``torch.optim.Adagrad`` on the dense layers.

At full size (no cap) TorchRec has no tier below memory on a CPU: it needs 195 GiB of host RAM
(or the HBM / UVM of GPUs); recsys trains it on the disk tier (``benchmarks/tiered_train.py``,
rows ``dlrm_dcnv2_mlperf_full_size*`` of ``tiered.csv``).

Run: ``python -m benchmarks.mlperf_dlrm --full`` (the 1M-row cap and batch 8,192; ``--quick``,
the default on CPU: 100k rows, batch 2,048); rows go to
``benchmarks/results/mlperf_dlrm.csv`` (peak RSS of the process in the notes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

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
    time_fns,
    write_rows,
)
from benchmarks._torchrec_peers import dmp_fused_dlrm
from benchmarks.models import dense_optimizer, make_step, recsys_model
from recsys.config import Config, load_config
from recsys.data import build_dataset
from recsys.data.batch import DatasetSpec
from recsys.data.loader import BatchLoader
from recsys.embedding.optim import Adagrad
from recsys.models import table_configs

TOPIC = "mlperf_dlrm"
RECIPE = REPO_ROOT / "configs" / "dlrm_dcnv2_mlperf.toml"
PEER = "torchrec_dmp_fused"
GIB = 1 << 30


@contextlib.contextmanager
def torchrec_dlrm_dcn(recipe: Config, spec: DatasetSpec, device: torch.device):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    m = recipe.model
    tables = table_configs(spec.sparse_names, spec.cardinalities, m.embedding_dim, m.pooling)
    fused_params = {
        "optimizer": EmbOptimType.EXACT_ADAGRAD,
        "learning_rate": recipe.train.embedding_lr,
        "eps": Adagrad.eps,  # recsys' fused Adagrad
    }
    dcn = (m.cross.num_layers, m.cross.low_rank)
    with dmp_fused_dlrm(
        tables,
        device,
        spec.num_dense,
        m.dense_arch_layer_sizes,
        m.over_arch_layer_sizes,
        fused_params,
        dcn=dcn,
    ) as (dmp, dense):
        yield make_step(dmp, [dense_optimizer(recipe, dense)], None)


def time_providers(providers, recipe, batch_size, num_batches, device, warmup, repeats) -> dict:
    """Build each provider, time its steps on ``num_batches`` batches of the recipe's
    synthetic train split, made beforehand (the same in every process) and cycled, in
    alternation when several: {name: {"timing", "peak_rss_gib", "last_loss"}}."""
    dataset = build_dataset(recipe.data, recipe.run.seed)
    loader = BatchLoader(dataset, "train", batch_size, drop_last=True, device=device)
    batches = list(itertools.islice(loader, num_batches))
    spec = dataset.spec
    losses: dict[str, list[torch.Tensor]] = {name: [] for name in providers}
    with contextlib.ExitStack() as stack:
        fns = {}
        for name, build in providers.items():
            step = stack.enter_context(build(recipe, spec, device))
            cycle = itertools.cycle(batches)
            fns[name] = lambda step=step, cycle=cycle, out=losses[name]: out.append(
                step(next(cycle))
            )
        timings = time_fns(fns, device, warmup=warmup, repeats=repeats, min_time_s=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    return {
        name: {
            "timing": dataclasses.asdict(timing),
            "peak_rss_gib": peak,
            "last_loss": losses[name][-1].item(),
        }
        for name, timing in timings.items()
    }


def in_own_process(name: str) -> dict:
    """This script run again for provider ``name`` alone, with the same arguments."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timing.json"
        command = [sys.executable, "-m", "benchmarks.mlperf_dlrm", *sys.argv[1:]]
        subprocess.run([*command, "--provider", name, "--timing-json", str(out)], check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument(
        "--max-rows", type=int, default=None, help="rows per table at most (1M; quick: 100k)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="8192 (quick: 2048)")
    parser.add_argument("--num-batches", type=int, default=4, help="prebuilt batches, cycled")
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="both providers in this process, timed in alternation (the table cap must fit "
        "twice in RAM); default: each in a process of its own, one after the other",
    )
    parser.add_argument("--provider", help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--timing-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    args.max_rows = args.max_rows or (100_000 if quick else 1_000_000)
    args.batch_size = args.batch_size or (2048 if quick else 8192)
    base = load_config(RECIPE)
    capped = [min(rows, args.max_rows) for rows in base.data.synthetic.cardinalities]
    recipe = load_config(
        RECIPE,
        [
            f"--run.device={device.type}",
            f"--data.synthetic.cardinalities={capped}",
            f"--train.batch_size={args.batch_size}",
            f"--data.synthetic.num_train_samples={args.batch_size * args.num_batches}",
            "--data.synthetic.num_valid_samples=1",
            "--data.synthetic.num_test_samples=1",
        ],
    )
    warmup = args.warmup if args.warmup is not None else 2
    repeats = args.repeats if args.repeats is not None else 10
    providers = {"recsys": recsys_model, PEER: torchrec_dlrm_dcn}
    made = (recipe, args.batch_size, args.num_batches, device)  # what the batches are made of
    if args.provider:  # a child: time one provider, hand the result back
        chosen = {args.provider: providers[args.provider]}
        result = time_providers(chosen, *made, warmup, repeats)[args.provider]
        Path(args.timing_json).write_text(json.dumps(result))
        return
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    dim = recipe.model.embedding_dim
    per_side = sum(capped) * dim * 4 * 2  # fp32 weights + element-wise Adagrad state
    print(
        f"tables: {sum(capped):,} rows (<= {args.max_rows:,} each), {per_side / GIB:.1f} GiB "
        "of weights + state per provider"
    )
    if args.one_process:
        results = time_providers(providers, *made, warmup, repeats)
        where = "both providers in one process, timed in alternation"
    else:
        results = {name: in_own_process(name) for name in providers}
        where = "each provider in a process of its own, one after the other"
    ids = sum(recipe.data.synthetic.bag_sizes)
    config = (
        f"recipe=dlrm_dcnv2_mlperf.toml batch={args.batch_size} tables=26 rows<={args.max_rows} "
        f"({sum(capped)} in all) dim={dim} bags=fixed {ids} ids/sample "
        f"bottom=512-256-128 dcn=3x512 top=1024-1024-512-256-1 optim=adagrad+fused_adagrad"
    )
    note = f"same {args.num_batches} synthetic MLPerf-shaped batches cycled; {where}; {load_note()}"
    rows = [
        Row(
            op="train_step",
            pass_="train_step",
            provider=name,
            config=config,
            dtype="float32",
            timing=Timing(**result["timing"]),
            throughput=args.batch_size / (result["timing"]["p50_ms"] * 1e-3),
            throughput_unit="samples/s",
            notes=f"{note}; peak RSS {result['peak_rss_gib']:.1f} GiB; last loss "
            f"{result['last_loss']:.4f}",
        )
        for name, result in results.items()
    ]
    peer = next(r for r in rows if r.provider == PEER).throughput
    rows[0].notes += f"; {rows[0].throughput / peer:.2f}x {PEER} samples/s"
    print(config)
    lines = [[r.provider, f"{r.timing.p50_ms:.0f}", f"{r.throughput:,.0f}", r.notes] for r in rows]
    print(format_table(["provider", "p50 ms", "samples/s", "notes"], lines))
    path = write_rows(TOPIC, rows, env, args.out_dir)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
