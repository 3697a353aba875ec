"""Dynamic (KEY_WISE) tables of a ShardedEmbeddingCollection on 2 gloo ranks against the
single-process DynamicEmbeddingCollection run on the concatenated batch: each rank's rows (its
own ids, in input order) at every step, then every key's row, optimizer state and key state,
bitwise, for every fused optimizer; the keys gathered from the ranks; checkpoints saved on 2
ranks load in one process and back.

The gradients are small dyadic numbers (k / 16), so the sums of a key's gradients are exact in
any order: the owner of a key reduces its ranks' gradients in another order than one process
does, and the tables still agree bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingConfig, KeyedJaggedTensor

from recsys.checkpoint.io import checkpoint_shapes, tensor_reader
from recsys.distributed import planner as P
from recsys.distributed.sharded_sequence import ShardedEmbeddingCollection
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.interface import state_to_load
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.embedding.unpooled_tables import DynamicEmbeddingCollection
from tests.distributed.spawn import run_ranks
from tests.distributed.test_sharded import assert_entry_equal
from tests.distributed.test_sharded_sequence import rows_of

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.25),
    "adagrad": lambda: Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.1),
    "adam": lambda: Adam(lr=0.05),
}
FEATURES = ["history", "candidates", "user"]
SEED, BATCH = 5, 4


def configs() -> list[EmbeddingConfig]:
    """A dynamic item table read by two features (as SASRec's), a fixed user table."""
    return [
        EmbeddingConfig(name="item", embedding_dim=8, num_embeddings=8, feature_names=FEATURES[:2]),
        EmbeddingConfig(name="user", embedding_dim=5, num_embeddings=11, feature_names=["user"]),
    ]


def collection(make_optimizer, **options) -> DynamicEmbeddingCollection:
    torch.manual_seed(0)  # the fixed table's rows: the same on every rank
    dynamic = DynamicTableOptions(routing_buckets=16, bucket_size=4, **options)
    return DynamicEmbeddingCollection(
        configs(), {"item": dynamic}, seed=SEED, optimizer=make_optimizer()
    )


def plan(world: int) -> dict[str, P.TableSharding]:
    return {"item": P.key_wise(64, 8, range(world)), "user": P.row_wise(11, 5, world)}


def raw_kjt(seed: int, batch_size: int) -> KeyedJaggedTensor:
    """Histories of 0..6 raw keys (negative and huge ones, many repeats), 0..2 candidates, one
    user id."""
    g = torch.Generator().manual_seed(seed)
    most = {"history": 7, "candidates": 3, "user": 2}
    lengths = torch.stack(
        [torch.randint(int(k == "user"), most[k], (batch_size,), generator=g) for k in FEATURES]
    )
    pool = torch.randint(-(2**62), 2**62, (40,), generator=g)
    values = [
        torch.randint(0, 11, (n,), generator=g)
        if k == "user"
        else pool[torch.randint(0, len(pool), (n,), generator=g)]
        for k, n in zip(FEATURES, lengths.sum(1).tolist(), strict=True)
    ]
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=lengths.reshape(-1))


def _span(lengths: torch.Tensor, rank: int) -> slice:
    return slice(int(lengths[: rank * BATCH].sum()), int(lengths[: (rank + 1) * BATCH].sum()))


def train(model, reference, rank: int, world: int, steps: int, seed: int = 0) -> None:
    """``steps`` steps of the global batch: ``model`` (sharded, or the same one process) on
    this rank's samples, ``reference`` on all; each rank's rows equal the reference's bitwise."""
    for step in range(steps):
        full = raw_kjt(100 * step + seed, BATCH * world)
        mine = rows_of(full, rank * BATCH, (rank + 1) * BATCH) if model is not reference else full
        out = model(mine)
        expected = reference(full) if model is not reference else out
        loss, reference_loss = 0.0, 0.0
        for i, name in enumerate(FEATURES):
            rows = expected[name].values()
            where = _span(expected[name].lengths(), rank)
            assert torch.equal(out[name].values(), rows[where] if model is not reference else rows)
            g = torch.Generator().manual_seed(10 * step + i)
            grad = torch.randint(-8, 9, rows.shape, generator=g).float() / 16  # exact sums
            if model is not reference:
                loss = loss + (out[name].values() * grad[where]).sum()
            reference_loss = reference_loss + (rows * grad).sum()
        if model is not reference:
            (loss / BATCH).backward()
        (reference_loss / (BATCH * world)).backward()


def assert_state_matches(sharded, reference) -> None:
    """Every logical entry equals the reference's bitwise (a dynamic table's rows, keys and
    optimizer state in routing order: the ranks' parts one after the other); the per-part map
    sizes are the only entries whose shapes differ."""
    expected, state = reference.state_dict(), sharded.state_dict()
    assert set(state) == set(expected)
    assert "embeddings.item.weight" in state and "dynamic.item.keys" in state
    for key, value in state.items():
        if not key.endswith(("num_buckets", "admission_buckets")):
            assert_entry_equal(key, value, expected[key], atol=0)


def _bitwise(rank: int, world: int) -> None:
    for name, make_optimizer in OPTIMIZERS.items():
        options = {"admit_after": 2} if name == "adam" else {}
        unsharded = collection(make_optimizer, **options)
        reference = collection(make_optimizer, **options)
        reference.load_state_dict(unsharded.state_dict())
        sharded = ShardedEmbeddingCollection(unsharded, plan(world))
        train(sharded, reference, rank, world, steps=4)
        assert_state_matches(sharded, reference)
        keys = sharded.live_keys("item")  # every rank's keys
        assert torch.equal(keys, reference.live_keys("item")), name
        assert sharded.live_keys("user") is None
        sizes = sharded.dynamic_stats()["item"]
        assert sizes["size"] == len(keys) and sizes["size_rank0"] < len(keys)
        # Outside training a key nobody holds reads the zero row and is not inserted.
        sharded.eval()
        reference.eval()
        asked = KeyedJaggedTensor(
            keys=FEATURES,
            values=torch.cat([keys[:3], torch.tensor([12345, 1])]),
            lengths=torch.tensor([4, 0, 1]),
        )
        out = sharded(asked)["history"].values()
        assert torch.equal(out, reference(asked)["history"].values())
        assert torch.equal(out[3], torch.zeros(8)) and out[:3].abs().sum() > 0
        assert torch.equal(sharded.live_keys("item"), keys)


def _bitwise_and_refusals(rank: int, world: int) -> None:
    _bitwise(rank, world)
    _parallelized_sasrec(rank, world)
    with pytest.raises(ValueError, match="table 'item' is ROW_WISE but dynamic"):
        ShardedEmbeddingCollection(
            collection(OPTIMIZERS["sgd"]), {**plan(world), "item": P.row_wise(8, 8, world)}
        )


def _parallelized_sasrec(rank: int, world: int) -> None:
    """parallelize() shards a SASRec's dynamic item table KEY_WISE (DDP wraps the rest): after
    a training step on each rank's own raw keys, ``item_keys()`` (the ranking corpus, the
    uniform negatives' pool) is every rank's keys on every rank."""
    import torch.distributed as dist

    from recsys.distributed.parallel import parallelize
    from recsys.distributed.plan import ShardingType
    from recsys.models.sasrec import CANDIDATES, HISTORY, SASRec

    torch.manual_seed(0)
    table = EmbeddingConfig(
        name="item", embedding_dim=8, num_embeddings=8, feature_names=[HISTORY, CANDIDATES]
    )
    items = DynamicEmbeddingCollection(
        [table], DynamicTableOptions(), seed=SEED, optimizer=Adam(lr=0.01)
    )
    model = parallelize(SASRec(items, max_len=6, num_blocks=1, num_heads=2), torch.device("cpu"))
    assert isinstance(model.module.embeddings, ShardedEmbeddingCollection)
    kind = model.module.sharding_plan.collections["embeddings"]["item"].sharding_type
    assert ShardingType(kind) == ShardingType.KEY_WISE
    g = torch.Generator().manual_seed(rank)
    keys = torch.randint(-(2**62), 2**62, (9,), generator=g)
    history = KeyedJaggedTensor(keys=[HISTORY], values=keys[:6], lengths=torch.tensor([4, 2]))
    hidden, vectors = model(history, 4, keys[6:])
    (hidden @ vectors.t()).logsumexp(dim=1).mean().backward()
    every: list = [None] * world
    dist.all_gather_object(every, keys)
    assert torch.equal(model.module.item_keys(), torch.cat(every).unique())


def test_dynamic_sequence_tables_match_one_process_bitwise_on_two_ranks():
    run_ranks(2, _bitwise_and_refusals)


def _save(rank: int, world: int, directory: str) -> None:
    reference = collection(OPTIMIZERS["rowwise_adagrad"])
    sharded = ShardedEmbeddingCollection(collection(OPTIMIZERS["rowwise_adagrad"]), plan(world))
    train(sharded, reference, rank, world, steps=3)
    dcp.save(sharded.state_dict(), checkpoint_id=directory)


def load(model, directory: str):
    state = state_to_load(model, checkpoint_shapes(directory), "", tensor_reader(directory))
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state)
    return model


def _load_and_continue(rank: int, world: int, saved: str, reference_dir: str) -> None:
    """A one-process checkpoint loads on the ranks, each keeping its keys; training goes on
    bitwise like one process going on from the same checkpoint."""
    fresh = collection(OPTIMIZERS["rowwise_adagrad"])
    sharded = load(ShardedEmbeddingCollection(fresh, plan(world)), saved)
    reference = load(collection(OPTIMIZERS["rowwise_adagrad"]), reference_dir)
    assert_state_matches(sharded, reference)
    train(sharded, reference, rank, world, steps=2, seed=7)
    assert_state_matches(sharded, reference)


@pytest.mark.slow
def test_checkpoints_move_between_two_ranks_and_one_process(tmp_path: Path):
    two = str(tmp_path / "two")
    run_ranks(2, _save, two)
    reference = collection(OPTIMIZERS["rowwise_adagrad"])
    train(reference, reference, 0, 2, steps=3)
    one = load(collection(OPTIMIZERS["rowwise_adagrad"]), two)
    expected = reference.state_dict()
    for key, value in one.state_dict().items():
        if not key.endswith(("num_buckets", "admission_buckets")):
            assert torch.equal(value, expected[key]), key
    assert torch.equal(one.live_keys("item"), reference.live_keys("item"))
    # Saved by one process, loaded on two ranks (each its routing buckets' keys).
    single = str(tmp_path / "one")
    dcp.save(one.state_dict(), checkpoint_id=single, no_dist=True)
    run_ranks(2, _load_and_continue, single, single)


# ---------------------------------------------------------------------------------------------
# `recsys train` of an all-dynamic SASRec on 2 ranks against one process

ALL_DYNAMIC = [
    "--model.name=sasrec",
    "--model.embedding_dim=16",
    "--model.sequence.max_len=10",
    "--model.sequence.num_blocks=1",
    "--model.sequence.dropout=0",
    "--model.dynamic.tables=['all']",
    "--model.dynamic.initial_capacity=16",
    "--data.synthetic_sequences.num_users=3000",
    "--data.synthetic_sequences.num_items=80",
    "--data.synthetic_sequences.num_topics=4",
    "--data.synthetic_sequences.mean_events=10",
    "--data.synthetic_sequences.max_events=20",
    "--train.epochs=4",
    "--train.log_every_steps=50",
    "--train.eval_every_steps=0",
    "--train.eval_batch_size=256",
    "--train.embedding_optimizer=adam",
    "--train.embedding_lr=0.01",
    "--train.dense_lr=0.01",
    "--train.next_item.loss=full",
    "--train.progress_bar=false",
    "--run.device=cpu",
    "--run.tensorboard=false",
]


@pytest.mark.slow
def test_all_dynamic_sasrec_on_two_ranks_ranks_like_one_process(tmp_path: Path):
    """SASRec over a dynamic item table (every key's row made as training brings it), trained
    by `torchrun --nproc-per-node=2` with batch 64 per rank and in one process with batch 128:
    test HR@10 within 0.005 (full softmax over the gathered corpus, no dropout: the runs differ
    only in how the ranks' losses are averaged). The 2-rank checkpoint evaluates in one process
    to the same test metrics."""
    from recsys.config import load_config
    from recsys.train.evaluate import evaluate_checkpoint
    from recsys.train.metrics import read_metrics
    from recsys.train.trainer import train as train_run
    from tests.distributed.test_torchrun import run_torchrun

    two = tmp_path / "two"
    args = [*ALL_DYNAMIC, "--train.batch_size=64", f"--run.dir={two}"]
    done = run_torchrun(["--nproc-per-node=2", "-m", "recsys", "train", *args])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "KEY_WISE" in done.stdout
    (test,) = [e for e in read_metrics(two / "metrics.jsonl") if e.get("split") == "test"]
    assert test["num_users"] == 3000
    one = train_run(
        load_config(None, [*ALL_DYNAMIC, "--train.batch_size=128", f"--run.dir={tmp_path / 'one'}"])
    )
    assert abs(test["hr@10"] - one.test["hr@10"]) <= 0.005, (test["hr@10"], one.test["hr@10"])
    assert test["hr@10"] > test["popularity_hr@10"] + 0.2
    again = evaluate_checkpoint(two).metrics  # in this one process
    assert again["hr@10"] == test["hr@10"] and again["num_users"] == 3000


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_tiered_item_table_trains_on_two_ranks(dynamic: bool, tmp_path: Path):
    """A disk-tier item table under torchrun, fixed or dynamic (KEY_WISE): built on meta, each
    rank's shard in its own store (``tables/rank<r>``); the 2-rank checkpoint (rows in tiered
    files by rank) evaluates in one process to the same test metrics."""
    from recsys.train.evaluate import evaluate_checkpoint
    from recsys.train.metrics import read_metrics
    from tests.distributed.test_torchrun import run_torchrun
    from tests.train.test_sequence_training import TINY

    run_dir = tmp_path / "tiered"
    overrides = [o for o in TINY if not o.startswith("--train.batch_size")]
    tiered = ["--model.storage.tier=disk", "--model.storage.cache_rows=60"]
    if dynamic:
        tiered += ["--model.dynamic.tables=['all']", "--model.dynamic.initial_capacity=16"]
    args = [*overrides, *tiered, "--train.batch_size=16", f"--run.dir={run_dir}"]
    done = run_torchrun(["--nproc-per-node=2", "-m", "recsys", "train", *args])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tiered" in done.stdout and (run_dir / "tables" / "rank0").is_dir()
    (test,) = [e for e in read_metrics(run_dir / "metrics.jsonl") if e.get("split") == "test"]
    assert test["num_users"] == 200
    assert evaluate_checkpoint(run_dir).metrics["hr@10"] == test["hr@10"]
