"""Benchmark the training throughput of every model in the zoo, and DLRM against TorchRec's DLRM
and a plain-torch DLRM, on the Criteo-shaped synthetic data.

Each model trains as its recipe ``configs/<model.name>_synthetic.toml`` sets it up (sizes, dense
optimizer, embedding optimizer fused into backward, task loss weights), built by
``recsys.build.models.build_model`` and ``recsys.train.optimizers.build_optimizers`` exactly as
``recsys train`` builds it, on ``--num-batches`` batches of the recipe's synthetic train split
made beforehand (13 dense and 26 categorical features, the last four multi-hot), cycled. One step
is the trainer's: forward, BCE on the logits (task-weighted when the recipe says so), backward,
every optimizer's step.

Providers:

- ``recsys``: the recipe's model (``recsys_dlrm``, ``recsys_dcn``, ... in the CSV);
- for DLRM, on the dlrm recipe's tables, sizes and batches:
  - ``torchrec_dmp_fused``: ``torchrec.models.dlrm.DLRM`` under ``DistributedModelParallel`` in
    a world of one (gloo), every table TABLE_WISE on the FUSED kernel (FBGEMM's TBE with
    EXACT_ADAGRAD at the recipe's embedding lr), the recipe's dense optimizer on the rest;
  - ``plain_torch``: ``torchrec.models.dlrm.DLRM`` over an unsharded
    ``torchrec.EmbeddingBagCollection`` (one ``nn.EmbeddingBag`` per table, dense table
    gradients), ``torch.optim.Adagrad`` on the tables and the recipe's dense optimizer.

The DLRM providers are timed in alternation (``benchmarks/_harness.py``); each other model on its
own. samples/s is the batch size over the p50 step time; DLRM rows record their ratio to
``torchrec_dmp_fused`` in ``notes``.

Run: ``python -m benchmarks.models [--device cuda] [--models dlrm dcn ...]``; rows go to
``benchmarks/results/models.csv`` (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._harness import (
    REPO_ROOT,
    Row,
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
from recsys.build.models import MODELS, build_model
from recsys.config import Config, load_config
from recsys.data import build_dataset
from recsys.data.batch import Batch, DatasetSpec
from recsys.data.loader import BatchLoader
from recsys.models import table_configs
from recsys.train.optimizers import build_optimizers, task_loss_weights

TOPIC = "models"
CONFIGS = REPO_ROOT / "configs"
PEER_BASELINE = "torchrec_dmp_fused"

# A step function runs one training step on a batch.
Step = Callable[[Batch], torch.Tensor]


def recipe_path(name: str) -> Path:
    return CONFIGS / f"{name}_synthetic.toml"


def make_step(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], weights: torch.Tensor | None
) -> Step:
    """As ``recsys.train.trainer._Run._train_step``."""
    model.train()

    def step(batch: Batch) -> torch.Tensor:
        logits = model(batch.dense, batch.sparse)  # [B, T]
        if weights is None:
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        else:
            per_task = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
            loss = (per_task.mean(dim=0) * weights).sum()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        return loss.detach()

    return step


def dense_optimizer(recipe: Config, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    classes = {
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "adagrad": torch.optim.Adagrad,
        "sgd": torch.optim.SGD,
    }
    return classes[recipe.train.dense_optimizer](params, lr=recipe.train.dense_lr)


@contextlib.contextmanager
def recsys_model(
    recipe: Config,
    spec: DatasetSpec,
    device: torch.device,
    prepare: Callable[[nn.Module], None] | None = None,
) -> Iterator[Step]:
    """The recipe's model as ``recsys train`` builds it (``prepare``, when given, sees it before
    its optimizers are made) and its train step."""
    torch.manual_seed(recipe.run.seed)
    model = build_model(recipe.model, spec, device)
    if prepare is not None:
        prepare(model)
    optimizers = build_optimizers(recipe.train, model)
    weights = task_loss_weights(recipe.train, spec.num_tasks, device)
    yield make_step(model, list(optimizers.values()), weights)


@contextlib.contextmanager
def torchrec_dmp(recipe: Config, spec: DatasetSpec, device: torch.device) -> Iterator[Step]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    m = recipe.model
    tables = table_configs(spec.sparse_names, spec.cardinalities, m.embedding_dim, m.pooling)
    fused_params = {
        "optimizer": EmbOptimType.EXACT_ADAGRAD,
        "learning_rate": recipe.train.embedding_lr,
    }
    with dmp_fused_dlrm(
        tables,
        device,
        spec.num_dense,
        m.dense_arch_layer_sizes,
        m.over_arch_layer_sizes,
        fused_params,
    ) as (dmp, dense):
        yield make_step(dmp, [dense_optimizer(recipe, dense)], None)


@contextlib.contextmanager
def plain_torch(recipe: Config, spec: DatasetSpec, device: torch.device) -> Iterator[Step]:
    import torchrec
    import torchrec.models.dlrm

    m = recipe.model
    ebc = torchrec.EmbeddingBagCollection(
        table_configs(spec.sparse_names, spec.cardinalities, m.embedding_dim, m.pooling),
        device=device,
    )
    model = torchrec.models.dlrm.DLRM(
        ebc, spec.num_dense, m.dense_arch_layer_sizes, m.over_arch_layer_sizes
    ).to(device)
    tables = list(ebc.parameters())
    table_ids = {id(p) for p in tables}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    optimizers = [
        torch.optim.Adagrad(tables, lr=recipe.train.embedding_lr),
        dense_optimizer(recipe, dense),
    ]
    yield make_step(model, optimizers, None)


def describe(recipe: Config, spec: DatasetSpec, batch_size: int) -> str:
    m, sizes = recipe.model, lambda layers: "-".join(map(str, layers))
    parts = [
        f"recipe={recipe_path(m.name).name}",
        f"batch={batch_size}",
        f"tables={len(spec.cardinalities)} rows<={max(spec.cardinalities)} dim={m.embedding_dim}",
        f"dense={spec.num_dense} tasks={spec.num_tasks}",
    ]
    if m.name in ("dlrm", "dlrm_dcn"):
        parts.append(f"bottom={sizes(m.dense_arch_layer_sizes)}")
    if m.name == "mmoe":
        parts.append(
            f"experts={m.mmoe.num_experts}x{sizes(m.mmoe.expert_layer_sizes)} "
            f"tower={sizes(m.mmoe.tower_layer_sizes)}"
        )
    else:
        parts.append(f"top={sizes(m.over_arch_layer_sizes)}")
    parts.append(f"optim={recipe.train.dense_optimizer}+fused_{recipe.train.embedding_optimizer}")
    return " ".join(parts)


def bench_recipe(
    name: str, device: torch.device, num_batches: int, warmup: int, repeats: int
) -> list[Row]:
    recipe = load_config(recipe_path(name), [f"--run.device={device.type}"])
    dataset = build_dataset(recipe.data, recipe.run.seed)
    spec = dataset.spec
    batch_size = recipe.train.batch_size
    loader = BatchLoader(dataset, "train", batch_size, drop_last=True, device=device)
    batches = list(itertools.islice(loader, num_batches))
    providers = {f"recsys_{name}": recsys_model}
    if name == "dlrm":
        providers |= {PEER_BASELINE: torchrec_dmp, "plain_torch": plain_torch}
    config = describe(recipe, spec, batch_size)
    print(config, flush=True)
    load = load_note()
    with contextlib.ExitStack() as stack:
        fns = {}
        for provider, build in providers.items():
            step = stack.enter_context(build(recipe, spec, device))
            cycle = itertools.cycle(batches)
            losses: list[torch.Tensor] = []
            fns[provider] = lambda step=step, cycle=cycle, losses=losses: losses.append(
                step(next(cycle))
            )
        timings = time_fns(fns, device, warmup=warmup, repeats=repeats, min_time_s=0)
    rows = [
        Row(
            op="train_step",
            pass_="train_step",
            provider=provider,
            config=config,
            dtype=recipe.model.embedding_dtype,
            timing=timing,
            throughput=batch_size / (timing.p50_ms * 1e-3),
            throughput_unit="samples/s",
            notes=load,
        )
        for provider, timing in timings.items()
    ]
    if name == "dlrm":
        baseline = next(r for r in rows if r.provider == PEER_BASELINE).throughput
        for r in rows:
            if r.provider != PEER_BASELINE:
                r.notes += f"; {r.throughput / baseline:.2f}x {PEER_BASELINE} samples/s"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    available = [name for name in MODELS if recipe_path(name).exists()]
    parser.add_argument("--models", nargs="+", choices=available, default=available)
    parser.add_argument("--num-batches", type=int, default=8, help="prebuilt batches, cycled")
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    warmup = args.warmup if args.warmup is not None else 3
    repeats = args.repeats if args.repeats is not None else (10 if quick else 30)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    rows: list[Row] = []
    for name in args.models:
        rows += bench_recipe(name, device, args.num_batches, warmup, repeats)
        gc.collect()
    lines = [
        [r.provider, f"{r.timing.p50_ms:.1f}", f"{r.throughput:,.0f}", r.notes.split("; ")[-1]]
        for r in rows
    ]
    print(format_table(["provider", "p50 ms", "samples/s", "notes"], lines))
    path = write_rows(TOPIC, rows, env, args.out_dir)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
