"""parallelize(): whole models on 2 gloo ranks (sharded tables + DDP dense layers) train like one
process on the concatenated batch: the same losses, dense weights, tables and optimizer
states after several steps."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recsys.build.models import build_model
from recsys.config import ModelConfig, TrainConfig
from recsys.data.batch import Batch, DatasetSpec
from recsys.distributed import planner as P
from recsys.distributed.parallel import parallelize
from recsys.embedding.interface import embedding_collections
from recsys.train.optimizers import build_optimizers, configure_embedding_optimizer
from tests.distributed.spawn import run_ranks
from tests.distributed.test_sharded import assert_state_equal

SPEC = DatasetSpec(
    dense_names=("d0", "d1", "d2"),
    sparse_names=("a", "b", "c", "d"),
    cardinalities=(50, 7, 300, 3),
    label_names=("click",),
)


def random_batch(seed: int, size: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(SPEC.sparse_names), size), generator=g)
    values = torch.cat(
        [
            torch.randint(0, rows, (int(n),), generator=g)
            for rows, n in zip(SPEC.cardinalities, lengths.sum(1), strict=True)
        ]
    )
    from torchrec import KeyedJaggedTensor

    sparse = KeyedJaggedTensor(
        keys=list(SPEC.sparse_names), values=values, lengths=lengths.reshape(-1)
    )
    dense = torch.randn(size, len(SPEC.dense_names), generator=g)
    labels = torch.randint(0, 2, (size, 1), generator=g).float()
    return Batch(dense, sparse, labels)


def mixed_plan(model: torch.nn.Module, world: int) -> P.ShardingPlan:
    """Every sharding type in one plan: a -> ROW_WISE, b -> DATA_PARALLEL, c -> COLUMN_WISE
    (TABLE_WISE for dim-1 tables), d -> TABLE_WISE on the last rank."""
    plan = P.ShardingPlan(world_size=world)
    for path, ebc in embedding_collections(model).items():
        shardings = {}
        for c in ebc.embedding_bag_configs():
            rows, dim, feature = c.num_embeddings, c.embedding_dim, c.feature_names[0]
            if feature == "a":
                shardings[c.name] = P.row_wise(rows, dim, world)
            elif feature == "b":
                shardings[c.name] = P.data_parallel(rows, dim, world)
            elif feature == "c" and dim >= world:
                shardings[c.name] = P.column_wise(rows, dim, list(range(world)))
            else:
                shardings[c.name] = P.table_wise(rows, dim, world - 1)
        plan.collections[path] = shardings
    return plan


def _train_like_one_process(rank: int, world: int, name: str, fused: bool) -> None:
    torch.manual_seed(0)
    config = ModelConfig(
        name=name, embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]
    )
    train = TrainConfig(
        dense_optimizer="sgd",
        dense_lr=0.2,
        embedding_optimizer="adagrad",
        embedding_lr=0.1,
        fused_embedding_update=fused,
    )
    reference = build_model(config, SPEC, torch.device("cpu"))
    model = copy.deepcopy(reference)
    configure_embedding_optimizer(train, reference)
    configure_embedding_optimizer(train, model)
    parallel = parallelize(model, torch.device("cpu"), mixed_plan(model, world))
    optimizers = list(build_optimizers(train, parallel).values())
    reference_optimizers = list(build_optimizers(train, reference).values())
    batch = 6
    for step in range(4):
        full = random_batch(step, batch * world)
        mine = full.slice(rank * batch, (rank + 1) * batch)
        loss = F.binary_cross_entropy_with_logits(parallel(mine.dense, mine.sparse), mine.labels)
        expected = F.binary_cross_entropy_with_logits(
            reference(full.dense, full.sparse), full.labels
        )
        for optimizer in optimizers + reference_optimizers:
            optimizer.zero_grad()
        loss.backward()
        expected.backward()
        for optimizer in optimizers + reference_optimizers:
            optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, expected.detach(), atol=1e-6, rtol=1e-5)
    sharded = embedding_collections(parallel.module)
    for path, module in sharded.items():
        assert_state_equal(module, reference.get_submodule(path), atol=1e-5)
    dense = {n: p for n, p in reference.named_parameters() if "embedding_bags" not in n}
    for n, p in parallel.module.named_parameters():
        if n in dense:
            torch.testing.assert_close(p, dense[n], atol=1e-5, rtol=1e-5, msg=n)


def _models(rank: int, world: int) -> None:
    _train_like_one_process(rank, world, "dlrm", fused=True)
    _train_like_one_process(rank, world, "dlrm", fused=False)
    _train_like_one_process(rank, world, "deepfm", fused=True)  # two collections


def test_parallelized_models_train_like_one_process():
    run_ranks(2, _models)
