"""A checkpoint saved by 2 ranks under one sharding plan, read back by 1 process and by 4 ranks
under another plan: same scores, every shard of every table and optimizer state equal to the
saved logical tensor."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from recsys.checkpoint.io import load_checkpoint, load_model
from recsys.config import load_config
from recsys.distributed.parallel import DistributedInfo
from recsys.train.optimizers import optimizer_states
from recsys.train.trainer import _Run, _unwrap
from tests.distributed.spawn import run_ranks

TINY = [
    "--data.synthetic.cardinalities=[40,300,7,1000]",
    "--data.synthetic.bag_sizes=[1,2,1,3]",
    "--data.synthetic.num_train_samples=32768",  # 4 chunks: one per rank on 4 ranks
    "--data.synthetic.num_valid_samples=512",
    "--data.synthetic.num_test_samples=1024",
    "--train.batch_size=256",
    "--train.eval_batch_size=512",
    "--train.progress_bar=false",
    "--model.embedding_dim=8",
    "--model.dense_arch_layer_sizes=[16,8]",
    "--run.device=cpu",
    "--data.prefetch_batches=0",
    "--distributed.print_plan=false",
]
SAVE_PLAN = [
    "t_cat_0=table_wise@1",
    "t_cat_1=row_wise",
    "t_cat_2=data_parallel",
    "t_cat_3=table_wise@0",
]
LOAD_PLAN = [
    "t_cat_0=row_wise",
    "t_cat_1=table_wise@3",
    "t_cat_2=table_wise@2",
    "t_cat_3=row_wise",
]


def toml_list(items: list[str]) -> str:
    return "[" + ",".join(f'"{item}"' for item in items) + "]"


def scores(run: _Run) -> torch.Tensor:
    """The model's logits on the first 100 test samples (the same batch on every rank)."""
    batch = run.task.dataset.chunk("test", 0).slice(0, 100)
    model = _unwrap(run.model)
    model.eval()
    with torch.no_grad():
        return model(batch.dense, batch.sparse)


def start(rank: int, world: int, args: list[str]) -> _Run:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    info = DistributedInfo(rank=rank, world_size=world, local_rank=0)
    return _Run(load_config(None, args), torch.device("cpu"), info)


# Fused row-wise Adagrad (its state lives in the model's state_dict), or dense table gradients
# and torch's Adagrad (its state in the embedding optimizer's, re-keyed to the logical tables).
OPTIMIZERS = {
    "fused": ["--train.embedding_optimizer=rowwise_adagrad"],
    "torch": ["--train.embedding_optimizer=adagrad", "--train.fused_embedding_update=false"],
    # Raw ids: every table dynamic, KEY_WISE over all ranks (no constraints), each rank's keys
    # read back by routing bucket.
    "dynamic": ["--train.embedding_optimizer=adagrad", "--data.synthetic.id_encoding=raw"],
}
# A dynamic table's map size per rank: its length is the number of ranks.
PER_RANK = ("num_buckets", "admission_buckets")


def plan_args(optimizer: list[str], plan: list[str]) -> list[str]:
    """The sharding constraints, for fixed tables (dynamic ones are KEY_WISE)."""
    if "--data.synthetic.id_encoding=raw" in optimizer:
        return []
    return [f"--distributed.constraints={toml_list(plan)}"]


def _save_on_two(rank: int, world: int, run_dir: str, optimizer: list[str]) -> None:
    plan = plan_args(optimizer, SAVE_PLAN)
    args = [f"--run.dir={run_dir}", *TINY, *optimizer, *plan, "--train.max_steps=6"]
    run = start(rank, world, args)
    assert run.fit().checkpoint.name == "step_00000006"
    if rank == 0:
        torch.save(scores(run), Path(run_dir) / "scores.pt")
    else:
        scores(run)  # a collective: every rank runs the forward


def _resume_on_four(
    rank: int, world: int, run_dir: str, checkpoint: str, optimizer: list[str]
) -> None:
    plan = plan_args(optimizer, LOAD_PLAN)
    args = [f"--run.dir={run_dir}", *TINY, *optimizer, *plan, "--train.max_steps=8"]
    run = start(rank, world, [*args, f"--checkpoint.resume={checkpoint}"])
    assert run.step == 6
    torch.testing.assert_close(
        scores(run), torch.load(Path(checkpoint).parent.parent / "scores.pt")
    )

    # every local shard of every table and optimizer state is its rows / columns of the
    # logical tensor the 2-rank run saved
    saved_state = {"model": _unwrap(run.model).state_dict(), "optimizers": {}}
    if "embedding" in run.optimizers:
        saved = optimizer_states(run.model, run.optimizers)[0]
        saved_state["optimizers"]["embedding"] = saved["embedding"]
    flat = {k: v for k, v in flatten_state_dict(saved_state)[0].items() if not k.endswith(PER_RANK)}
    full = {
        k: torch.empty(v.shape, dtype=v.dtype) if isinstance(v, ShardedTensor) else v.clone()
        for k, v in flat.items()
    }
    load_checkpoint(checkpoint, full)
    num_shards = 0
    for key, value in flat.items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                (r0, *c0), (rows, *cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                expected = full[key][r0 : r0 + rows]
                if c0:
                    expected = expected[:, c0[0] : c0[0] + cols[0]]
                assert torch.equal(shard.tensor, expected), key
                num_shards += 1
        else:
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(full[key])), key
    assert num_shards > 0
    dense = run.optimizers["dense"]
    live = get_optimizer_state_dict(run.model, [dense])
    wanted = {"optimizers": {"dense": get_optimizer_state_dict(run.model, [dense])}}
    saved = load_checkpoint(checkpoint, wanted)["optimizers"]["dense"]
    for name, state in live["state"].items():
        for field, value in state.items():
            assert torch.equal(value, saved["state"][name][field]), (name, field)
    result = run.fit()  # and it trains on
    assert result.steps == 8 and torch.isfinite(torch.tensor(result.test["logloss"]))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_rank_checkpoint_loads_on_one_process_and_on_four_ranks_with_another_plan(
    tmp_path, optimizer
):
    run_ranks(2, _save_on_two, str(tmp_path / "two"), OPTIMIZERS[optimizer])
    checkpoint = tmp_path / "two" / "checkpoints" / "step_00000006"
    saved_scores = torch.load(tmp_path / "two" / "scores.pt")

    one = load_model(checkpoint)
    batch = one_batch(checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(one(batch.dense, batch.sparse), saved_scores)

    run_ranks(4, _resume_on_four, str(tmp_path / "four"), str(checkpoint), OPTIMIZERS[optimizer])


def one_batch(checkpoint: Path):
    from recsys.checkpoint.io import read_config
    from recsys.data import build_dataset

    config = read_config(checkpoint)
    return build_dataset(config.data, config.run.seed).chunk("test", 0).slice(0, 100)
