"""ShardedEmbeddingCollection on 2 and 4 gloo ranks against the unsharded EmbeddingCollection
run on the concatenated batch in one process: each rank's rows (its own ids, in input order),
and after several steps of the fused optimizer the tables and optimizer states, under every
placement; the logical state dict loads into another plan and back into one process."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor

from recsys import EmbeddingCollection
from recsys.data.batch import Batch
from recsys.distributed import planner as P
from recsys.distributed.sharded_sequence import ShardedEmbeddingCollection
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.distributed.spawn import run_ranks
from tests.distributed.test_sharded import assert_state_equal
from tests.distributed.test_sharded import make_plan as make_bag_plan

# name, dim, rows, features: a table read by two features (history and candidates, as
# SASRec's item table), an odd dim, a 3-row table (fewer rows than 4 ranks).
TABLES = [
    ("item", 8, 23, ["history", "candidates"]),
    ("cat", 5, 3, ["category"]),
    ("user", 4, 11, ["user"]),
]
ROWS = {f: n for _, _, n, fs in TABLES for f in fs}


def configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=fs)
        for name, dim, rows, fs in TABLES
    ]


def random_kjt(seed: int, batch_size: int, keys: list[str]) -> KeyedJaggedTensor:
    """Histories of 0..6 ids (some empty), one candidate, 0..2 categories, one user id."""
    g = torch.Generator().manual_seed(seed)
    most = {"history": 7, "candidates": 2, "category": 3, "user": 2, "zz": 3}
    lengths = torch.stack(
        [torch.randint(0 if k != "user" else 1, most[k], (batch_size,), generator=g) for k in keys]
    )
    values = torch.cat(
        [
            torch.randint(0, ROWS.get(k, 5), (int(n),), generator=g)
            for k, n in zip(keys, lengths.sum(1), strict=True)
        ]
    )
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.reshape(-1))


def rows_of(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    size = kjt.stride()
    return Batch(torch.zeros(size, 1), kjt, torch.zeros(size, 1)).slice(start, stop).sparse


def make_plan(kinds: list[str], world: int) -> dict[str, P.TableSharding]:
    return make_bag_plan(kinds, world, TABLES)


def jagged_rows(out: dict, full: dict, rank: int, batch: int, atol: float = 1e-6) -> None:
    """Each feature's rows on this rank are the reference's rows of this rank's samples (the
    tables agree to float rounding once trained: duplicates' gradients are summed in another
    order on an owner; bitwise before training)."""
    for name, expected in full.items():
        lengths = expected.lengths()
        start = int(lengths[: rank * batch].sum())
        stop = int(lengths[: (rank + 1) * batch].sum())
        got = out[name]
        assert torch.equal(got.lengths(), lengths[rank * batch : (rank + 1) * batch]), name
        torch.testing.assert_close(
            got.values(), expected.values()[start:stop], atol=atol, rtol=0, msg=name
        )


def train_and_compare(rank, world, kinds, make_optimizer, steps=3, batch=5):
    torch.manual_seed(0)
    unsharded = EmbeddingCollection(configs(), optimizer=make_optimizer())
    reference = EmbeddingCollection(configs(), optimizer=make_optimizer())
    reference.load_state_dict(unsharded.state_dict())
    sharded = ShardedEmbeddingCollection(unsharded, make_plan(kinds, world))
    keys = ["user", "zz", "candidates", "category", "history"]  # another order, an extra key
    for step in range(steps):
        full = random_kjt(100 * step + 1, batch * world, keys)
        mine = rows_of(full, rank * batch, (rank + 1) * batch)
        out = sharded(mine)
        expected = reference(full)
        assert list(out) == list(expected)
        jagged_rows(out, expected, rank, batch, atol=0 if step == 0 else 1e-6)
        # The mean over the global batch: each rank's own mean, averaged over ranks.
        loss, reference_loss = 0.0, 0.0
        for i, (name, rows) in enumerate(expected.items()):
            g = torch.Generator().manual_seed(10 * step + i)
            grad = torch.randn(rows.values().shape, generator=g)
            lengths = rows.lengths()
            start = int(lengths[: rank * batch].sum())
            stop = int(lengths[: (rank + 1) * batch].sum())
            loss = loss + (out[name].values() * grad[start:stop]).sum()
            reference_loss = reference_loss + (rows.values() * grad).sum()
        (loss / batch).backward()
        (reference_loss / (batch * world)).backward()
    assert_state_equal(sharded, reference, atol=1e-6)
    return sharded, reference


def _sharding_cases(rank: int, world: int) -> None:
    for kinds in (["tw"], ["rw"], ["cw"], ["dp"], ["rw", "tw", "dp"], ["tw", "cw", "rw"]):
        train_and_compare(rank, world, kinds, lambda: Adagrad(lr=0.1))
    train_and_compare(rank, world, ["rw", "tw", "dp"], lambda: RowWiseAdagrad(lr=0.1))
    train_and_compare(rank, world, ["cw", "rw"], lambda: Adam(lr=0.05))
    sharded, reference = train_and_compare(rank, world, ["tw", "rw"], lambda: SGD(lr=0.3))
    # The logical state is the unsharded collection's (keys ``embeddings.<table>.weight``
    # ...): a plain state dict loads into any plan, and the sharded one's entries are the
    # tables of the reference.
    state = sharded.state_dict()
    assert set(state) == set(reference.state_dict())
    assert "embeddings.item.weight" in state and "optimizer_step" in state
    other = ShardedEmbeddingCollection(
        EmbeddingCollection(configs(), optimizer=SGD(lr=0.3)), make_plan(["rw", "cw", "tw"], world)
    )
    other.load_state_dict(reference.state_dict())
    assert_state_equal(other, reference, atol=0)
    kjt = rows_of(random_kjt(7, 3 * world, ["history", "candidates", "category", "user"]), 0, 3)
    assert torch.equal(other(kjt)["history"].values(), sharded(kjt)["history"].values())


def test_every_sharding_type_matches_one_process_on_two_ranks():
    run_ranks(2, _sharding_cases)


def _four_rank_cases(rank: int, world: int) -> None:
    train_and_compare(rank, world, ["rw", "cw", "tw"], lambda: Adagrad(lr=0.1))
    train_and_compare(rank, world, ["dp", "rw"], lambda: RowWiseAdagrad(lr=0.1), steps=2)


@pytest.mark.slow
def test_mixed_plans_match_one_process_on_four_ranks():
    run_ranks(4, _four_rank_cases)


def _uneven(rank: int, world: int) -> None:
    """Ranks with very different id counts (one with no history at all) and an empty batch."""
    torch.manual_seed(0)
    unsharded = EmbeddingCollection(configs(), optimizer=Adagrad(lr=0.1))
    reference = EmbeddingCollection(configs(), optimizer=Adagrad(lr=0.1))
    reference.load_state_dict(unsharded.state_dict())
    sharded = ShardedEmbeddingCollection(unsharded, make_plan(["rw", "tw", "cw"], world))
    keys = ["history", "candidates", "category", "user"]
    full = random_kjt(3, 4 * world, keys)
    lengths = full.lengths().view(len(keys), -1).clone()
    lengths[0, :4] = 0  # rank 0: no history
    values = torch.randint(0, 3, (int(lengths.sum()),))  # ids < 3 fit every table
    full = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.reshape(-1))
    out = sharded(rows_of(full, rank * 4, (rank + 1) * 4))
    jagged_rows(out, reference(full), rank, 4, atol=0)
    with pytest.raises(ValueError, match="history"):
        bad = KeyedJaggedTensor(
            keys=keys, values=torch.full((4,), 99), lengths=torch.ones(4, dtype=torch.int64)
        )
        sharded(bad)


def test_uneven_id_counts_and_a_bad_id():
    run_ranks(2, _uneven)


def test_only_a_plain_embedding_collection_is_sharded():
    from recsys import EmbeddingBagCollection
    from recsys.distributed.sharded_sequence import pooled_twin

    tables = [
        __import__("torchrec").EmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"]
        )
    ]
    with pytest.raises(ValueError, match="shards a recsys.EmbeddingCollection"):
        pooled_twin(EmbeddingBagCollection(tables))


def _sasrec(rank: int, world: int) -> None:
    """parallelize() shards a sequence model's EmbeddingCollection (and DDP wraps the rest):
    each rank's user vectors and every item's vector are the one-process model's, and a step
    of training moves the shards."""
    from recsys.distributed.parallel import parallelize
    from recsys.models.sasrec import CANDIDATES, HISTORY, SASRec

    def build() -> SASRec:
        torch.manual_seed(0)
        table = EmbeddingConfig(
            name="item", embedding_dim=8, num_embeddings=31, feature_names=[HISTORY, CANDIDATES]
        )
        items = EmbeddingCollection([table], optimizer=Adagrad(lr=0.1))
        return SASRec(items, max_len=6, num_blocks=1, num_heads=2, dropout=0.0)

    reference = build().eval()
    model = parallelize(build(), torch.device("cpu"), make_item_plan(world))
    assert isinstance(model.module.embeddings, ShardedEmbeddingCollection)
    model.eval()
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 7, (4,), generator=g)
    ids = torch.randint(0, 31, (int(lengths.sum()),), generator=g)
    history = KeyedJaggedTensor(keys=[HISTORY], values=ids, lengths=lengths)
    most = int(lengths.max())
    with torch.no_grad():
        got = model.module.user_vectors(history, most)
        expected = reference.user_vectors(history, most)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(model.module.item_vectors(), reference.item_vectors())
    model.train()
    before = model.module.item_vectors().detach()
    hidden, vectors = model(history, most, torch.arange(31))
    (hidden @ vectors.t()).logsumexp(dim=1).mean().backward()
    assert not torch.equal(model.module.item_vectors(), before)


def make_item_plan(world: int) -> P.ShardingPlan:
    plan = P.ShardingPlan(world)
    plan.collections["embeddings"] = {"item": P.row_wise(31, 8, world)}
    return plan


def test_parallelize_shards_a_sequence_model():
    run_ranks(2, _sasrec)


def _checkpoint(rank: int, world: int, directory: str) -> None:
    import recsys.checkpoint.io as ckpt

    sharded, reference = train_and_compare(rank, world, ["rw", "tw", "cw"], lambda: Adam(lr=0.05))
    path = ckpt.save_checkpoint(directory, 3, {"model": sharded.state_dict()})
    other = ShardedEmbeddingCollection(
        EmbeddingCollection(configs(), optimizer=Adam(lr=0.05)),
        make_plan(["tw", "cw", "rw"], world),
    )
    ckpt.load_checkpoint(path, {"model": other.state_dict()})
    assert_state_equal(other, reference, atol=0)
    if rank == 0:
        torch.save(reference.state_dict(), f"{directory}/reference.pt")


def test_checkpoints_move_between_plans_and_to_one_process(tmp_path):
    import recsys.checkpoint.io as ckpt

    run_ranks(2, _checkpoint, str(tmp_path))
    one = EmbeddingCollection(configs(), optimizer=Adam(lr=0.05))
    ckpt.load_checkpoint(tmp_path / "step_00000003", {"model": one.state_dict()})
    expected = torch.load(tmp_path / "reference.pt")
    for key, value in one.state_dict().items():
        assert torch.equal(value, expected[key]), key
