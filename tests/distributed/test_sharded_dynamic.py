"""Dynamic (KEY_WISE) tables of a ShardedEmbeddingBagCollection on 2 and 4 gloo ranks against the
single-process DynamicEmbeddingBagCollection run on the concatenated batch: outputs at every
step, then every key's row, optimizer state and key state; and checkpoints of the sharded
collection that load on 1, 2 and 4 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from recsys.checkpoint.io import checkpoint_shapes, tensor_reader
from recsys.distributed import planner as P
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.interface import state_to_load
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.distributed.spawn import run_ranks
from tests.distributed.test_sharded import assert_entry_equal, rows_of

# name, dim, initial rows, features, pooling, dynamic: two dynamic tables (one read by two
# features, one mean-pooled) and a fixed one.
TABLES = [
    ("u", 4, 8, ["a"], PoolingType.SUM, True),
    ("v", 6, 16, ["b", "c"], PoolingType.MEAN, True),
    ("w", 5, 11, ["d"], PoolingType.SUM, False),
]
FEATURES = ["a", "b", "c", "d"]
ROUTING = 16  # routing buckets: 4 ranks own 4 each
SEED = 7


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=rows, feature_names=list(fs), pooling=pool
        )
        for name, dim, rows, fs, pool, _ in TABLES
    ]


def collection(make_optimizer, **options) -> DynamicEmbeddingBagCollection:
    torch.manual_seed(0)  # the fixed table's rows: the same on every rank
    dynamic = DynamicTableOptions(routing_buckets=ROUTING, bucket_size=4, **options)
    names = [name for name, *_, is_dynamic in TABLES if is_dynamic]
    return DynamicEmbeddingBagCollection(
        configs(), dict.fromkeys(names, dynamic), seed=SEED, optimizer=make_optimizer()
    )


def plan(world: int) -> dict[str, P.TableSharding]:
    return {
        "u": P.key_wise(64, 4, range(world)),
        "v": P.key_wise(64, 6, list(reversed(range(world)))),  # shard order != rank order
        "w": P.row_wise(11, 5, world),
    }


def raw_kjt(seed: int, batch_size: int) -> KeyedJaggedTensor:
    """Raw keys: negative, huge and patterned (multiples of 4) ids; the fixed table's in range."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES), batch_size), generator=g)
    pool = torch.tensor([-(2**62), -5, 0, 4, 8, 12, 16, 2**40 + 3, 2**62, 99, 1000, 77])
    values = []
    for feature, n in zip(FEATURES, lengths.sum(1).tolist(), strict=True):
        if feature == "d":
            values.append(torch.randint(0, 11, (n,), generator=g))
        else:
            values.append(pool[torch.randint(0, len(pool), (n,), generator=g)])
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=lengths.reshape(-1))


def assert_state_matches(sharded, reference) -> None:
    """Every logical entry this rank holds equals the reference's rows (the rows of a dynamic
    table, in routing order, are the concatenation of the ranks' parts); the maps' per-part
    sizes are the only entries whose shapes differ."""
    expected, state = reference.state_dict(), sharded.state_dict()
    assert set(state) == set(expected)
    for key, value in state.items():
        if key.endswith(("num_buckets", "admission_buckets")):
            continue
        assert_entry_equal(key, value, expected[key], atol=1e-6)


def train_and_compare(rank, world, make_optimizer, steps=4, batch=5, **options) -> None:
    unsharded = collection(make_optimizer, **options)
    reference = collection(make_optimizer, **options)
    reference.load_state_dict(unsharded.state_dict())
    sharded = ShardedEmbeddingBagCollection(unsharded, plan(world))
    for step in range(steps):
        full = raw_kjt(100 * step + 1, batch * world)
        out = sharded(rows_of(full, rank * batch, (rank + 1) * batch))
        expected = reference(full)
        mine = expected.values()[rank * batch : (rank + 1) * batch]
        torch.testing.assert_close(out.values(), mine, atol=1e-6, rtol=1e-6)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (out.values() * grad[rank * batch : (rank + 1) * batch]).sum().div(batch).backward()
        (expected.values() * grad).sum().div(batch * world).backward()
    assert_state_matches(sharded, reference)
    stats, one = sharded.dynamic_stats(), reference.dynamic_stats()
    for table in ("u", "v"):
        assert stats[table]["size"] == one[table]["size"]
        assert stats[table]["inserts"] == one[table]["inserts"]
        assert sum(stats[table][f"size_rank{r}"] for r in range(world)) == one[table]["size"]


def _matches_one_process(rank: int, world: int) -> None:
    for make_optimizer in (lambda: Adagrad(lr=0.1), lambda: RowWiseAdagrad(lr=0.1)):
        train_and_compare(rank, world, make_optimizer)
    train_and_compare(rank, world, lambda: Adam(lr=0.05), admit_after=2)
    train_and_compare(rank, world, lambda: SGD(lr=0.3), score="lfu", ttl_steps=2)


def _bad_plans_and_keys(rank: int, world: int) -> None:
    def make(**changes):
        return ShardedEmbeddingBagCollection(
            collection(lambda: Adagrad(lr=0.1)), {**plan(world), **changes}
        )

    with pytest.raises(ValueError, match="table 'u' is ROW_WISE but dynamic"):
        make(u=P.row_wise(8, 4, world))
    with pytest.raises(ValueError, match="table 'w' is KEY_WISE but KEY_WISE is for dynamic"):
        make(w=P.key_wise(11, 5, range(world)))
    with pytest.raises(ValueError, match="dynamic table 'u' is KEY_WISE on ranks \\[0\\]"):
        make(u=P.key_wise(8, 4, [0]))
    sharded = make()
    bad = KeyedJaggedTensor(
        keys=FEATURES,
        values=torch.tensor([-(2**63) + 1, 3, 4, 5]),
        lengths=torch.tensor([1, 1, 1, 1]),
    )
    with pytest.raises(ValueError, match="ids of dynamic tables contain -9223372036854775807"):
        sharded(bad)  # every rank raises before any collective
    with pytest.raises(ValueError, match="id 12 is out of range for its table with 11 rows"):
        sharded(
            KeyedJaggedTensor(
                keys=FEATURES,
                values=torch.tensor([1, 2, 3, 12]),
                lengths=torch.tensor([1, 1, 1, 1]),
            )
        )


def test_dynamic_tables_match_one_process_on_two_ranks():
    run_ranks(2, _matches_one_process)
    run_ranks(2, _bad_plans_and_keys)


def test_dynamic_tables_match_one_process_on_four_ranks():
    run_ranks(4, _matches_one_process)


# ---------------------------------------------------------------------------------------------
# Checkpoints across world sizes


def trained(make_optimizer, steps: int, world: int, rank: int):
    """A sharded collection (or, in a world of one, the plain one) after ``steps`` steps of the
    global batch, with the reference that trained on it in one process."""
    unsharded = collection(make_optimizer, admit_after=2)
    reference = collection(make_optimizer, admit_after=2)
    reference.load_state_dict(unsharded.state_dict())
    model = ShardedEmbeddingBagCollection(unsharded, plan(world)) if world > 1 else unsharded
    for step in range(steps):
        full = raw_kjt(100 * step + 1, 4 * 5)
        part = rows_of(full, rank * (20 // world), (rank + 1) * (20 // world))
        out, expected = model(part), reference(full)
        out.values().sum().mul(world / 20).backward()
        expected.values().sum().div(20).backward()
    return model, reference


def _save(rank: int, world: int, directory: str) -> None:
    model, _ = trained(lambda: Adagrad(lr=0.1), 3, world, rank)
    dcp.save(model.state_dict(), checkpoint_id=directory)


def load(model, directory: str):
    state = state_to_load(model, checkpoint_shapes(directory), "", tensor_reader(directory))
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state)
    return model


def _load_and_compare(rank: int, world: int, directory: str) -> None:
    _, reference = trained(lambda: Adagrad(lr=0.1), 3, 1, 0)
    fresh = collection(lambda: Adagrad(lr=0.1), admit_after=2)
    model = load(ShardedEmbeddingBagCollection(fresh, plan(world)), directory)
    assert_state_matches(model, reference)
    full = raw_kjt(999, 4 * world)
    model.eval()
    reference.eval()
    out = model(rows_of(full, rank * 4, (rank + 1) * 4)).values()
    torch.testing.assert_close(out, reference(full).values()[rank * 4 : (rank + 1) * 4])
    dist.barrier()


def test_a_two_rank_checkpoint_loads_on_one_and_four_ranks(tmp_path: Path):
    directory = str(tmp_path / "ckpt")
    run_ranks(2, _save, directory)
    _, reference = trained(lambda: Adagrad(lr=0.1), 3, 1, 0)
    one = load(collection(lambda: Adagrad(lr=0.1), admit_after=2), directory)
    for key, value in reference.state_dict().items():
        if not key.endswith(("num_buckets", "admission_buckets")):
            torch.testing.assert_close(one.state_dict()[key], value, atol=1e-6, rtol=0, msg=key)
    assert int(one.dynamic["v"].map.num_buckets) >= 1
    run_ranks(4, _load_and_compare, directory)


# ---------------------------------------------------------------------------------------------
# Deltas of sharded dynamic tables


def _train_with_deltas(rank: int, world: int, run_dir: str) -> None:
    from recsys.distributed.ranks import all_gather
    from tests.checkpoint.test_deltas import TINY
    from tests.distributed.test_reshard import start

    chunks = ["--data.synthetic.num_train_samples=16384", "--train.max_steps=12"]  # a chunk each
    run = start(rank, world, [*TINY, *chunks, f"--run.dir={run_dir}"])
    assert all_gather(run.lineage) == [run.lineage] * world  # the first rank's ids on every rank
    run.fit()


def test_deltas_of_two_ranks_rebuild_the_final_tables_from_any_base(tmp_path: Path):
    """2 gloo ranks, each writing the keys it owns; evictions (a small cap) and TTL expiry
    included. Every base checkpoint plus the deltas after it equals the final checkpoint."""
    from recsys.checkpoint.deltas import apply_deltas, dynamic_table_rows, list_deltas
    from recsys.checkpoint.io import load_model
    from recsys.checkpoint.lineage import read_lineage
    from tests.checkpoint.test_deltas import DELTAS

    run_dir = tmp_path / "run"
    run_ranks(2, _train_with_deltas, str(run_dir))
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    final = dynamic_table_rows(load_model(checkpoints[-1]))
    infos = list_deltas(run_dir / "deltas")
    assert [(i.step, i.since) for i in infos] == DELTAS[: len(infos)]
    assert all(i.world_size == 2 for i in infos)
    assert {i.lineage for i in infos} == {read_lineage(checkpoints[-1])}
    assert sum(t["deletions"] for i in infos for t in i.tables.values()) > 0
    for base in checkpoints:
        got = apply_deltas(base, run_dir / "deltas")
        assert sorted(got) == sorted(final)
        for name, (keys, rows) in final.items():
            assert torch.equal(got[name][0], keys), name
            assert torch.equal(got[name][1], rows), name


def test_two_ranks_resumed_on_one_keep_the_cap_and_the_delta_chain(tmp_path: Path, capsys):
    """Tables capped at 256 keys (16 buckets of 16) train on 2 ranks (8 buckets each), then
    resume from step 8 in one process: the cap stays 256 (it doubled past it before, with a
    warning per table); keys over it are dropped, said in one line, and deleted by the next
    delta, so every base plus the deltas after it still equals the final tables."""
    import warnings

    from recsys.checkpoint.deltas import apply_deltas, dynamic_table_rows
    from recsys.checkpoint.io import load_model
    from recsys.embedding.dynamic.table import DynamicTable
    from recsys.train.trainer import _unwrap
    from tests.checkpoint.test_deltas import TINY
    from tests.distributed.test_reshard import start

    run_dir = tmp_path / "run"
    run_ranks(2, _train_with_deltas, str(run_dir))
    base = run_dir / "checkpoints" / "step_00000008"
    chunks = ["--data.synthetic.num_train_samples=16384", "--train.max_steps=12"]
    args = [*TINY, *chunks, f"--run.dir={run_dir}", f"--checkpoint.resume={base}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = start(0, 1, args)
    assert not [w for w in caught if "restored keys" in str(w.message)]
    tables = [m for m in _unwrap(run.model).modules() if isinstance(m, DynamicTable)]
    capped = [t for t in tables if t.options.max_capacity]
    assert capped and all(t.map.max_capacity == 256 >= t.map.size for t in capped)
    out = capsys.readouterr().out
    assert out.count("dropped the rest: ") == 1  # the 2 ranks' keys overflow some buckets
    line = out.split("dropped the rest: ")[1].split(" (deltas, when")[0]
    dropped = {name: int(count) for name, count in (part.split() for part in line.split(", "))}
    assert dropped and all(count > 0 for count in dropped.values())
    run.fit()
    from recsys.checkpoint.deltas import list_deltas, read_delta

    first = read_delta(list_deltas(run_dir / "deltas")[-2])  # the first one after step 8
    for name, count in dropped.items():
        assert len(first[name].deleted) >= count
    final = dynamic_table_rows(load_model(run_dir / "checkpoints" / "step_00000012"))
    for checkpoint in (base, run_dir / "checkpoints" / "step_00000004"):
        got = apply_deltas(checkpoint, run_dir / "deltas")
        for name, (keys, rows) in final.items():
            assert torch.equal(got[name][0], keys), name
            assert torch.equal(got[name][1], rows), name


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_parts_caps_add_up_to_the_one_process_cap(world: int):
    """max_capacity 50 in buckets of 4: 13 buckets, 52 rows in one process; dealt out in whole
    buckets, the parts add up to the same 52 rows on any number of ranks (each part used to
    round ceil(50 / world) up to whole buckets: 2 ranks held 56)."""
    from recsys.distributed.shard_build import dynamic_parts

    module = collection(lambda: SGD(lr=0.1), max_capacity=50)
    assert module.dynamic["u"].map.max_capacity == 52
    shards = plan(world)
    caps = [dynamic_parts(module, shards, rank)["u"].max_capacity for rank in range(world)]
    assert sum(caps) == 52 and all(cap % 4 == 0 and cap > 0 for cap in caps)
