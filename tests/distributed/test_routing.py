"""ShardRouting on its own (no process group): where each id goes, renumbered as its shard
sees it, and how received columns are put back in the unsharded order."""

import torch
from torchrec import EmbeddingBagConfig, PoolingType

from recsys.distributed import plan as P
from recsys.distributed.routing import ShardRouting


def configs():
    return [
        EmbeddingBagConfig(
            name="rw",
            embedding_dim=2,
            num_embeddings=10,
            feature_names=["a"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="cw", embedding_dim=4, num_embeddings=6, feature_names=["b"]),
        EmbeddingBagConfig(name="dp", embedding_dim=3, num_embeddings=5, feature_names=["c"]),
        EmbeddingBagConfig(name="tw", embedding_dim=2, num_embeddings=4, feature_names=["d"]),
    ]


def routing(rank=0):
    plan = {
        "rw": P.row_wise(10, 2, 2),  # rows 0-4 on rank 0, 5-9 on rank 1
        "cw": P.column_wise(6, 4, [0, 1]),  # columns 0-1 on rank 0, 2-3 on rank 1
        "dp": P.data_parallel(5, 3, 2),
        "tw": P.table_wise(4, 2, 1),
    }
    return ShardRouting(configs(), plan, world_size=2, rank=rank, device=torch.device("cpu"))


def test_placements_and_widths():
    r0, r1 = routing(0), routing(1)
    assert [(c.name, s.rank) for c, s in r0.local] == [("rw", 0), ("cw", 0)]
    assert [(c.name, s.rank) for c, s in r1.local] == [("rw", 1), ("cw", 1), ("tw", 1)]
    assert r0.slots_per_rank == [2, 3] and r0.widths == [4, 6]
    assert r1.local_features == ["a", "b", "d"]


def test_route_sends_each_id_to_its_owners_renumbered():
    r = routing(0)
    # batch of 2; features a, b, c, d; lengths [F, B]
    lengths = torch.tensor([[2, 1], [1, 0], [1, 1], [0, 1]])
    values = torch.tensor([3, 7, 9, 5, 0, 4, 2])  # a: [3, 7] [9]; b: [5]; c: [0] [4]; d: [2]
    routed = r.route(lengths, values, None, batch_size=2)
    # streams: rank 0 (a, b), rank 1 (a, b, d); send_lengths is [stream, sample]
    expected_lengths = [
        [1, 0],  # a on rank 0: id 3
        [1, 0],  # b's first column piece
        [1, 1],  # a on rank 1: ids 7 and 9, renumbered 2 and 4
        [1, 0],  # b's second column piece
        [0, 1],  # d, table-wise on rank 1
    ]
    assert routed.send_lengths.view(5, 2).tolist() == expected_lengths
    assert routed.ids.tolist() == [3, 5, 2, 4, 5, 2]
    assert routed.per_rank.tolist() == [2, 4]  # the replicated c sends nothing
    assert routed.weights is None


def test_route_carries_weights_with_their_ids():
    r = routing(0)
    lengths = torch.tensor([[1, 1], [1, 0], [0, 0], [0, 0]])
    values = torch.tensor([8, 1, 3])
    weights = torch.tensor([0.5, 2.0, 3.0])
    routed = r.route(lengths, values, weights, batch_size=2)
    # a: 8 -> rank 1 (as 3), 1 -> rank 0; b: 3 -> both column pieces
    assert routed.ids.tolist() == [1, 3, 3, 3]
    assert routed.weights.tolist() == [2.0, 3.0, 0.5, 3.0]


def test_assemble_sums_row_wise_parts_and_divides_means():
    r = routing(0)
    batch = 2
    received = torch.arange(batch * 10, dtype=torch.float32).view(batch, 10)
    pooled_dp = torch.full((batch, 3), -1.0)
    lengths = torch.tensor([[2, 0], [1, 1], [1, 1], [1, 1]])
    out = r.assemble(received, pooled_dp, lengths, batch)
    assert out.shape == (batch, 2 + 4 + 3 + 2)
    # received columns: rank 0 [a(2) | b cols 0-1], rank 1 [a(2) | b cols 2-3 | d(2)]
    a = (received[:, 0:2] + received[:, 4:6]) / lengths[0].clamp(min=1).unsqueeze(1)
    torch.testing.assert_close(out[:, 0:2], a)
    torch.testing.assert_close(out[:, 2:6], torch.cat([received[:, 2:4], received[:, 6:8]], 1))
    torch.testing.assert_close(out[:, 6:9], pooled_dp)
    torch.testing.assert_close(out[:, 9:11], received[:, 8:10])


def test_route_waits_on_the_device_only_to_size_copies():
    """Routing reads no device value on the host (the id count is known there), except the
    number of copies when some table is column-wise or replicated (test_layers allows tests to
    import the train layer's audit)."""
    from recsys.train.step_audit import StepAudit

    lengths = torch.tensor([[2, 1], [1, 0], [1, 1], [0, 1]])
    values = torch.tensor([3, 7, 9, 5, 0, 4, 2])
    mixed = routing(0)
    with StepAudit() as report:
        mixed.route(lengths, values, None, batch_size=2)
    assert [op for op, _ in report.syncs] == ["repeat_interleave"]  # the copies of each id
    plan = {"rw": P.row_wise(10, 2, 2), "tw": P.table_wise(4, 2, 1)}
    tables = [configs()[0], configs()[3]]
    one_owner = ShardRouting(tables, plan, world_size=2, rank=0, device=torch.device("cpu"))
    lengths, values = lengths[[0, 3]], torch.tensor([3, 7, 9, 2])
    with StepAudit() as report:
        routed = one_owner.route(lengths, values, None, batch_size=2)
    assert report.syncs == []
    assert routed.send_lengths.tolist() == [1, 0, 1, 1, 0, 1]  # a on 0, a on 1, d on 1


def test_route_with_the_ids_per_feature_reads_nothing_to_size_copies():
    """Given the ids of each feature (the KJT's length per key, known on the host), a
    column-wise or replicated table's copies are sized without a read, with a row-wise (one
    owner per id) table beside them: the same ids as the read gives."""
    from recsys.train.step_audit import StepAudit

    lengths = torch.tensor([[2, 1], [1, 0], [1, 1], [0, 1]])
    values = torch.tensor([3, 7, 9, 5, 0, 4, 2])
    mixed = routing(0)
    expected = mixed.route(lengths, values, None, batch_size=2)
    per_feature = lengths.sum(dim=1).tolist()
    with StepAudit() as report:
        routed = mixed.route(lengths, values, None, 2, per_feature)
    assert report.syncs == []
    assert torch.equal(routed.ids, expected.ids)
    assert torch.equal(routed.send_lengths, expected.send_lengths)


def test_tables_without_an_owner_per_id_move_whole_features():
    """Table-wise and column-wise only: the ids move feature by feature, in the order the sort
    by (stream, sample) gives, and without any host read when no id is copied."""
    from recsys.train.step_audit import StepAudit

    tables = [configs()[1], configs()[3]]  # cw over ranks 0, 1; tw on rank 1
    plan = {"cw": P.column_wise(6, 4, [0, 1]), "tw": P.table_wise(4, 2, 1)}
    lengths = torch.tensor([[2, 1, 0], [1, 0, 2]])
    values = torch.tensor([5, 1, 3, 2, 0, 3])
    weights = torch.rand(6)
    r = ShardRouting(tables, plan, world_size=2, rank=0, device=torch.device("cpu"))
    routed = r.route(lengths, values, weights, batch_size=3)
    assert r.by_feature
    # streams: b on rank 0; b, d on rank 1
    assert routed.send_lengths.tolist() == [2, 1, 0, 2, 1, 0, 1, 0, 2]
    assert routed.ids.tolist() == [5, 1, 3, 5, 1, 3, 2, 0, 3]
    assert torch.equal(routed.weights, weights[[0, 1, 2, 0, 1, 2, 3, 4, 5]])
    assert routed.per_rank.tolist() == [3, 6]
    with StepAudit() as report:  # the ids per feature known on the host: copies sized there
        known = r.route(lengths, values, weights, batch_size=3, ids_per_feature=[3, 3])
    assert report.syncs == [] and torch.equal(known.ids, routed.ids)
    r.by_feature = False  # the general path agrees
    general = r.route(lengths, values, weights, batch_size=3)
    assert torch.equal(general.ids, routed.ids) and torch.equal(general.weights, routed.weights)
    assert torch.equal(general.send_lengths, routed.send_lengths)
    table_wise = ShardRouting(
        [configs()[3]], {"tw": plan["tw"]}, world_size=2, rank=0, device=torch.device("cpu")
    )
    ids, one_feature = torch.tensor([0, 3, 1]), lengths[1:]
    with StepAudit() as report:
        routed = table_wise.route(one_feature, ids, None, batch_size=3)
    assert report.syncs == [] and routed.ids.tolist() == [0, 3, 1]
