"""Benchmark one DLRM training step: recsys against TorchRec's sharded model in a world of one.

The model (Criteo-shaped): 26 one-hot sparse features, one table each of ``--rows`` rows and dim
``--dim`` (default 1M x 64: 6.7 GB of fp32 tables), 13 dense features, bottom MLP [512, 256, D],
top MLP [512, 512, 256, 1], BCE loss on the logit. One step: forward, loss, backward, the
tables' SGD (lr 0.01) fused into backward, the dense parameters' ``torch.optim.SGD`` (lr 0.01).
Providers:

- ``recsys``: ``recsys.DLRM`` over ``recsys.EmbeddingBagCollection(optimizer=SGD(lr=0.01),
  validate=False)``;
- ``recsys_ebc_plain_torch_layers``: the same recsys collection inside
  ``torchrec.models.dlrm.DLRM``, whose MLPs and interaction are plain torch modules: shows what
  recsys' own layers (``recsys.models.layers``) cost or save against the plain torch model;
- ``torchrec_dmp_fused``: ``torchrec.models.dlrm.DLRM`` over a meta-device
  ``torchrec.EmbeddingBagCollection`` sharded by ``DistributedModelParallel`` in a process
  group of one rank (gloo; nccl on CUDA): every table TABLE_WISE on the FUSED kernel (FBGEMM's
  TBE with EXACT_SGD fused into backward). DMP also wraps the dense part in
  DistributedDataParallel, whose all-reduce over one rank is part of its step.

Both train on the same 4 batches, cycled (ids Zipf(1)-skewed, as ``benchmarks/embedding_bag.py``;
dense features normal, labels 0/1), with their own default initializations. The models are
built one at a time (each holds its tables), warmed up, then ``--steps`` steps are timed one by
one; the p50 step gives samples/s. After timing, the script checks that the loss is finite and
that a row the batches touch has moved (the fused table update ran). Every row's notes carry the
load average when its provider was timed: the providers are not interleaved, so background load
on a shared machine can favour one of them.

Run: ``python -m benchmarks.dlrm_step [--device cuda] [--quick | --full] [--rows N]``; rows go
to ``benchmarks/results/dlrm_step.csv`` (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import recsys
from benchmarks._harness import (
    Row,
    Timing,
    add_common_args,
    environment,
    format_table,
    is_quick,
    load_note,
    resolve_device,
    time_fn,
    write_rows,
    zipf_ids,
)
from benchmarks._torchrec_peers import dmp_fused_dlrm
from recsys import EmbeddingBagConfig, KeyedJaggedTensor  # recsys quiets torchrec's import
from recsys.embedding.optim import SGD

TOPIC = "dlrm_step"
NUM_SPARSE, NUM_DENSE = 26, 13
BOTTOM_MLP = [512, 256]  # then the embedding dim D
TOP_MLP = [512, 512, 256, 1]
NUM_BATCHES = 4
LR = 0.01


@dataclass
class Batch:
    dense: torch.Tensor  # [B, 13] float32
    sparse: KeyedJaggedTensor  # 26 keys, one id per bag
    labels: torch.Tensor  # [B] float32, 0 or 1


def mlp(sizes: list[int]) -> str:
    return "-".join(map(str, sizes))


def table_configs(rows: int, dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{f}"]
        )
        for f in range(NUM_SPARSE)
    ]


def make_batches(
    rows: int, batch_size: int, device: torch.device, generator: torch.Generator
) -> list[Batch]:
    batches = []
    for _ in range(NUM_BATCHES):
        values = torch.cat([zipf_ids(batch_size, rows, generator) for _ in range(NUM_SPARSE)])
        sparse = KeyedJaggedTensor(
            keys=[f"f_{f}" for f in range(NUM_SPARSE)],
            values=values,
            lengths=torch.ones(NUM_SPARSE * batch_size, dtype=torch.int64),
        )
        dense = torch.randn(batch_size, NUM_DENSE, generator=generator)
        labels = torch.randint(0, 2, (batch_size,), generator=generator).float()
        batches.append(Batch(dense.to(device), sparse.to(device), labels.to(device)))
    return batches


# A provider: (tables, device) -> a context holding (model, dense optimizer) while it is timed.
Provider = Callable[
    [list[EmbeddingBagConfig], torch.device],
    contextlib.AbstractContextManager[tuple[nn.Module, torch.optim.Optimizer]],
]


@contextlib.contextmanager
def recsys_dlrm(
    tables: list[EmbeddingBagConfig], device: torch.device
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    ebc = recsys.EmbeddingBagCollection(tables, device=device, optimizer=SGD(lr=LR), validate=False)
    model = recsys.DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[*BOTTOM_MLP, tables[0].embedding_dim],
        over_arch_layer_sizes=TOP_MLP,
    ).to(device)
    # The tables take no gradient (the fused optimizer updates them in backward).
    dense = [p for p in model.parameters() if p.requires_grad]
    yield model, torch.optim.SGD(dense, lr=LR)


@contextlib.contextmanager
def plain_torch_layers(
    tables: list[EmbeddingBagConfig], device: torch.device
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    """The same model with plain torch layers: torchrec's DLRM (nn.Linear + ReLU MLPs, the
    cat / bmm / gather InteractionArch) over the same recsys collection."""
    import torchrec.models.dlrm

    ebc = recsys.EmbeddingBagCollection(tables, device=device, optimizer=SGD(lr=LR), validate=False)
    model = torchrec.models.dlrm.DLRM(
        ebc, NUM_DENSE, [*BOTTOM_MLP, tables[0].embedding_dim], TOP_MLP
    ).to(device)
    dense = [p for p in model.parameters() if p.requires_grad]
    yield model, torch.optim.SGD(dense, lr=LR)


@contextlib.contextmanager
def torchrec_dmp_fused(
    tables: list[EmbeddingBagConfig], device: torch.device
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    fused_params = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    bottom = [*BOTTOM_MLP, tables[0].embedding_dim]
    with dmp_fused_dlrm(tables, device, NUM_DENSE, bottom, TOP_MLP, fused_params) as (dmp, dense):
        yield dmp, torch.optim.SGD(dense, lr=LR)


PROVIDERS: dict[str, tuple[Provider, str]] = {
    "recsys": (recsys_dlrm, "EmbeddingBagCollection(optimizer=SGD, validate=False)"),
    "recsys_ebc_plain_torch_layers": (
        plain_torch_layers,
        "torchrec.models.dlrm.DLRM (plain torch MLPs and interaction) over the recsys collection",
    ),
    "torchrec_dmp_fused": (
        torchrec_dmp_fused,
        "DMP world of 1, TABLE_WISE, FUSED kernel (FBGEMM TBE, EXACT_SGD); dense part in DDP",
    ),
}


def first_table_row(model: nn.Module, row: int) -> torch.Tensor:
    """A copy of row ``row`` of the first table (``embedding_bags.t_0.weight``) of either model."""
    for name, param in model.named_parameters():
        if name.endswith("embedding_bags.t_0.weight"):
            return param[row].detach().clone()
    raise AssertionError("no parameter named *embedding_bags.t_0.weight")


def time_provider(
    provider: Provider,
    tables: list[EmbeddingBagConfig],
    batches: list[Batch],
    device: torch.device,
    warmup: int,
    steps: int,
) -> Timing:
    """Build one model and time ``steps`` train steps after ``warmup``; the model is freed on
    return."""
    with provider(tables, device) as (model, optimizer):
        model.train()
        cycle = itertools.cycle(batches)
        losses = []

        def train_step() -> None:
            batch = next(cycle)
            logits = model(batch.dense, batch.sparse).squeeze(1)  # [B]
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())

        touched = int(batches[0].sparse.values()[0])  # feature f_0's first id: a row of t_0
        before = first_table_row(model, touched)
        timing = time_fn(
            train_step, device, warmup=warmup, repeats=steps, min_time_s=0, max_repeats=steps
        )
        after = first_table_row(model, touched)
        if not all(torch.isfinite(loss).item() for loss in losses):
            raise AssertionError(f"non-finite loss: {[loss.item() for loss in losses]}")
        if torch.equal(before, after):
            raise AssertionError(f"row {touched} of table t_0 did not change in training")
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=64, help="embedding dim of every table")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps (default: --repeats, else 5 quick, 20 full)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for option in ("rows", "dim", "batch_size", "steps"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')}={value} must be >= 1")
    device = resolve_device(args.device)
    quick = is_quick(args)
    warmup = args.warmup if args.warmup is not None else (2 if quick else 5)
    steps = args.steps or args.repeats or (5 if quick else 20)

    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    generator = torch.Generator().manual_seed(args.seed)
    batches = make_batches(args.rows, args.batch_size, device, generator)
    config = (
        f"tables={NUM_SPARSE} rows={args.rows} dim={args.dim} batch={args.batch_size} "
        f"dense={NUM_DENSE} bottom={mlp([*BOTTOM_MLP, args.dim])} top={mlp(TOP_MLP)} "
        "one-hot ids=zipf1"
    )
    print(config, flush=True)
    rows = []
    for name, (provider, notes) in PROVIDERS.items():
        load = load_note()
        timing = time_provider(
            provider, table_configs(args.rows, args.dim), batches, device, warmup, steps
        )
        gc.collect()
        rows.append(
            Row(
                op=TOPIC,
                pass_="train_step",
                provider=name,
                config=config,
                dtype="fp32",
                timing=timing,
                throughput=args.batch_size / (timing.p50_ms * 1e-3),
                throughput_unit="samples/s",
                notes=f"{notes}; {load}",
            )
        )
        print(f"done {name}: p50 {timing.p50_ms:.1f} ms", flush=True)

    baseline = next(r for r in rows if r.provider == "torchrec_dmp_fused").throughput
    for r in rows:
        if r.provider != "torchrec_dmp_fused":
            r.notes += f"; {r.throughput / baseline:.2f}x torchrec_dmp_fused samples/s"
    plain = next(r for r in rows if r.provider == "recsys_ebc_plain_torch_layers").throughput
    recsys_row = next(r for r in rows if r.provider == "recsys")
    recsys_row.notes += f"; {recsys_row.throughput / plain:.2f}x recsys_ebc_plain_torch_layers"
    lines = [
        [
            r.provider,
            f"{r.timing.p50_ms:.2f}",
            f"{r.timing.p20_ms:.2f}-{r.timing.p80_ms:.2f}",
            f"{r.throughput:,.0f}",
            f"{r.throughput / baseline:.2f}x",
        ]
        for r in rows
    ]
    print()
    header = ["provider", "p50 ms", "p20-p80 ms", "samples/s", "vs torchrec_dmp_fused"]
    print(format_table(header, lines))
    path = write_rows(TOPIC, rows, env, args.out_dir)
    print(f"\n{len(rows)} rows appended to {path}")


if __name__ == "__main__":
    main()
