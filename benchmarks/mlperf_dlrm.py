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
- ``recsys_dense_torch``: the same, with the dense layers (MLPs, DCN cross layers) on their torch
  path (cuBLAS on a GPU) instead of ``auto``'s choice (the MLPs' Triton kernels; the cross
  layers already run their torch path under ``auto``): which a GPU should run;
- ``torchrec_dmp_fused``: ``torchrec.models.dlrm.DLRM_DCN`` over an ``EmbeddingBagCollection``
  sharded by ``DistributedModelParallel`` (world of one, gloo), every table TABLE_WISE on the
  FUSED kernel with FBGEMM's EXACT_ADAGRAD at the same learning rate and eps (the optimizer the
  reference fuses into backward; EXACT_ROWWISE_ADAGRAD with ``--embedding-optimizer
  rowwise_adagrad``), ``torch.optim.Adagrad`` on the dense layers.

At full size (``--max-rows 0``: MLPerf's own tables, 204M rows) TorchRec has no tier below
memory on a CPU: it needs 195 GiB of host RAM (or the HBM / UVM of GPUs); recsys trains it on the
disk tier there (``benchmarks/tiered_train.py``, rows ``dlrm_dcnv2_mlperf_full_size*`` of
``tiered.csv``), and in the memory of one 141 GB GPU with row-wise Adagrad state
(``--embedding-optimizer rowwise_adagrad``: 98 GiB; element-wise state would double it).

``--precision fp32 bf16``: a row per provider and precision, bf16 being the step under
``torch.autocast`` (tables and optimizer state stay fp32). A provider that cannot run here (the
TorchRec peer on a GPU without FBGEMM's CUDA kernels) is reported as skipped, with the reason, in
the output and in the recsys rows' notes.

Run: ``python -m benchmarks.mlperf_dlrm --full`` (the 1M-row cap and batch 8,192; ``--quick``,
the default on CPU: 100k rows, batch 2,048); on a GPU at full size: ``--device cuda --max-rows 0
--batch-size 65536 --embedding-optimizer rowwise_adagrad --precision fp32 bf16``. Rows go to
``benchmarks/results/mlperf_dlrm.csv`` (peak RSS of the process, and on a GPU its peak device
memory, in the notes).
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
from recsys.embedding.optim import Adagrad, RowWiseAdagrad
from recsys.models import table_configs

TOPIC = "mlperf_dlrm"
RECIPE = REPO_ROOT / "configs" / "dlrm_dcnv2_mlperf.toml"
PEER = "torchrec_dmp_fused"
GIB = 1 << 30
PRECISIONS = ("fp32", "bf16")
# What a provider that cannot run here raises when it is built or first called: FBGEMM without
# its CUDA kernels (fbgemm-gpu-cpu) raises NotImplementedError for CUDA tensors.
CANNOT_RUN = (ImportError, NotImplementedError)


@contextlib.contextmanager
def torchrec_dlrm_dcn(recipe: Config, spec: DatasetSpec, device: torch.device):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    m = recipe.model
    tables = table_configs(spec.sparse_names, spec.cardinalities, m.embedding_dim, m.pooling)
    rowwise = recipe.train.embedding_optimizer == "rowwise_adagrad"
    fused_params = {  # FBGEMM's exact Adagrad (element-wise or row-wise), recsys' eps
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD if rowwise else EmbOptimType.EXACT_ADAGRAD,
        "learning_rate": recipe.train.embedding_lr,
        "eps": RowWiseAdagrad.eps if rowwise else Adagrad.eps,
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


@contextlib.contextmanager
def recsys_dense_torch(recipe: Config, spec: DatasetSpec, device: torch.device):
    """``recsys`` with every dense layer on its torch path: the embedding bag keeps ``auto``."""
    with recsys_model(recipe, spec, device, prepare=dense_on_torch) as step:
        yield step


def dense_on_torch(model: torch.nn.Module) -> None:
    """Every dense layer of ``model`` (``recsys.models.layers``) on its torch path; the tables
    keep their backend."""
    for module in model.modules():
        if type(module).__module__ == "recsys.models.layers" and hasattr(module, "backend"):
            module.backend = "torch"


def under_precision(step, precision: str, device: torch.device):
    """``step`` in ``precision``: ``"bf16"`` runs it under ``torch.autocast``."""
    if precision == "fp32":
        return step

    def autocast_step(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return step(batch)

    return autocast_step


def time_providers(
    providers, recipe, batch_size, num_batches, device, precision, warmup, repeats
) -> dict:
    """Build each provider, time its steps in ``precision`` on ``num_batches`` batches of the
    recipe's synthetic train split, made beforehand (the same in every process) and cycled, in
    alternation when several: {name: {"timing", "peak_rss_gib", "peak_device_gib",
    "last_loss"}}, or {name: {"skipped": why}} for a provider that cannot run here."""
    dataset = build_dataset(recipe.data, recipe.run.seed)
    loader = BatchLoader(dataset, "train", batch_size, drop_last=True, device=device)
    batches = list(itertools.islice(loader, num_batches))
    spec = dataset.spec
    losses: dict[str, list[torch.Tensor]] = {name: [] for name in providers}
    skipped: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        fns = {}
        for name, build in providers.items():
            try:
                step = under_precision(
                    stack.enter_context(build(recipe, spec, device)), precision, device
                )
                losses[name].append(step(batches[0]))  # a first call: the one that can fail
            except CANNOT_RUN as error:
                skipped[name] = {"skipped": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
                continue
            cycle = itertools.cycle(batches)
            fns[name] = lambda step=step, cycle=cycle, out=losses[name]: out.append(
                step(next(cycle))
            )
        timings = time_fns(fns, device, warmup=warmup, repeats=repeats, min_time_s=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    peak_device = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    return skipped | {
        name: {
            "timing": dataclasses.asdict(timing),
            "peak_rss_gib": peak,
            "peak_device_gib": peak_device,
            "last_loss": losses[name][-1].item(),
        }
        for name, timing in timings.items()
    }


def in_own_process(name: str, precision: str) -> dict:
    """This script run again for provider ``name`` alone in ``precision``, with the same
    arguments otherwise."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timing.json"
        command = [sys.executable, "-m", "benchmarks.mlperf_dlrm", *sys.argv[1:]]
        child = ["--provider", name, "--child-precision", precision, "--timing-json", str(out)]
        subprocess.run([*command, *child], check=True)
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
        "--precision",
        nargs="+",
        choices=PRECISIONS,
        default=["fp32"],
        help="a row per provider and precision (bf16: the step under torch.autocast)",
    )
    parser.add_argument(
        "--embedding-optimizer",
        choices=("adagrad", "rowwise_adagrad"),
        default="adagrad",
        help="the tables' fused optimizer: the reference's element-wise Adagrad (default), or "
        "row-wise (one state value a row: what fits MLPerf's tables in one 141 GB GPU)",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="both providers in this process, timed in alternation (the table cap must fit "
        "twice in RAM); default: each in a process of its own, one after the other",
    )
    parser.add_argument("--provider", help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--child-precision", help=argparse.SUPPRESS)
    parser.add_argument("--timing-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    if args.max_rows is None:
        args.max_rows = 100_000 if quick else 1_000_000
    if args.max_rows < 0:
        parser.error(f"--max-rows {args.max_rows}: expected >= 1, or 0 for MLPerf's full tables")
    args.batch_size = args.batch_size or (2048 if quick else 8192)
    base = load_config(RECIPE)
    full = base.data.synthetic.cardinalities
    capped = [min(rows, args.max_rows) if args.max_rows else rows for rows in full]
    recipe = load_config(
        RECIPE,
        [
            f"--run.device={device.type}",
            f"--data.synthetic.cardinalities={capped}",
            f"--train.batch_size={args.batch_size}",
            f"--train.embedding_optimizer={args.embedding_optimizer}",
            f"--data.synthetic.num_train_samples={args.batch_size * args.num_batches}",
            "--data.synthetic.num_valid_samples=1",
            "--data.synthetic.num_test_samples=1",
        ],
    )
    warmup = args.warmup if args.warmup is not None else 2
    repeats = args.repeats if args.repeats is not None else 10
    providers = {
        "recsys": recsys_model,
        "recsys_dense_torch": recsys_dense_torch,
        PEER: torchrec_dlrm_dcn,
    }
    made = (recipe, args.batch_size, args.num_batches, device)  # what the batches are made of
    if args.provider:  # a child: time one provider, hand the result back
        chosen = {args.provider: providers[args.provider]}
        timed = time_providers(chosen, *made, args.child_precision, warmup, repeats)
        Path(args.timing_json).write_text(json.dumps(timed[args.provider]))
        return
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    dim = recipe.model.embedding_dim
    state = dim if args.embedding_optimizer == "adagrad" else 1  # state values a row
    per_side = sum(capped) * (dim + state) * 4  # fp32 weights + Adagrad state
    cap = f"<= {args.max_rows:,} each" if args.max_rows else "MLPerf's full tables"
    print(
        f"tables: {sum(capped):,} rows ({cap}), {per_side / GIB:.1f} GiB of weights + "
        f"{args.embedding_optimizer} state per provider"
    )
    results: dict[tuple[str, str], dict] = {}
    for precision in args.precision:
        if args.one_process:
            timed = time_providers(providers, *made, precision, warmup, repeats)
            results |= {(name, precision): result for name, result in timed.items()}
            where = "the providers in one process, timed in alternation"
        else:
            for name in providers:
                results[name, precision] = in_own_process(name, precision)
            where = "each provider in a process of its own, one after the other"
    skips = [
        f"{name} skipped: {result['skipped']}"
        for (name, precision), result in results.items()
        if "skipped" in result and precision == args.precision[0]
    ]
    for line in skips:
        print(line)
    ids = sum(recipe.data.synthetic.bag_sizes)
    rows_cap = f"rows<={args.max_rows}" if args.max_rows else "rows=full"
    config = (
        f"recipe=dlrm_dcnv2_mlperf.toml batch={args.batch_size} tables=26 {rows_cap} "
        f"({sum(capped)} in all) dim={dim} bags=fixed {ids} ids/sample "
        f"bottom=512-256-128 dcn=3x512 top=1024-1024-512-256-1 "
        f"optim=adagrad+fused_{args.embedding_optimizer}"
    )
    note = f"same {args.num_batches} synthetic MLPerf-shaped batches cycled; {where}; {load_note()}"
    rows = []
    for (name, precision), result in results.items():
        if "skipped" in result:
            continue
        memory = f"peak RSS {result['peak_rss_gib']:.1f} GiB"
        if device.type == "cuda":
            memory += f", peak device memory {result['peak_device_gib']:.1f} GiB"
        rows.append(
            Row(
                op="train_step",
                pass_="train_step",
                provider=name,
                config=config,
                dtype="float32" if precision == "fp32" else "bf16 autocast (fp32 tables)",
                timing=Timing(**result["timing"]),
                throughput=args.batch_size / (result["timing"]["p50_ms"] * 1e-3),
                throughput_unit="samples/s",
                notes=f"{note}; {memory}; last loss {result['last_loss']:.4f}",
            )
        )
    peers = {r.dtype: r.throughput for r in rows if r.provider == PEER}
    for row in rows:
        if row.provider != PEER and row.dtype in peers:
            row.notes += f"; {row.throughput / peers[row.dtype]:.2f}x {PEER} samples/s"
        elif row.provider != PEER and skips:
            row.notes += "; " + "; ".join(skips)
    print(config)
    lines = [[r.provider, f"{r.timing.p50_ms:.0f}", f"{r.throughput:,.0f}", r.notes] for r in rows]
    print(format_table(["provider", "p50 ms", "samples/s", "notes"], lines))
    path = write_rows(TOPIC, rows, env, args.out_dir)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
