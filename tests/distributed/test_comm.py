"""Communication helpers of the sharded collection: the codecs of quantized communication
within their documented error bounds, the reordering of received ids, byte accounting, and the
two exchanges run in this process on a one-rank gloo group. The exchanges between several ranks
are tested through ShardedEmbeddingBagCollection in test_sharded.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from recsys.distributed.comm import (
    PRECISIONS,
    CommStats,
    PooledLayout,
    ReceivedIds,
    check_precision,
    decode,
    encode,
    pooled_all_to_all,
    source_to_slot_major,
    wire_dtype,
    wire_width,
)
from recsys.distributed.counts import all_to_all_ids, exchange_counts

FP16_MIN_NORMAL, FP16_MAX = 2.0**-14, 65504.0

# ---------------------------------------------------------------------------------------------
# Codecs


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(64, 37), (1, 8), (3, 1)])
def test_encoded_shape_and_dtype_are_what_travels(precision, shape):
    x = torch.randn(shape)
    sent = encode(x, precision)
    assert sent.dtype == wire_dtype(precision)
    assert sent.shape == (shape[0], wire_width(shape[1], precision))
    y = decode(sent, precision)
    assert y.dtype == torch.float32 and y.shape == x.shape


def test_wire_width_and_dtype():
    assert [wire_width(37, p) for p in PRECISIONS] == [37, 37, 37, 41]
    assert [wire_dtype(p) for p in PRECISIONS] == [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int8,
    ]


def test_fp32_is_exact():
    x = torch.randn(16, 9) * torch.logspace(-30, 30, 16).unsqueeze(1)
    assert torch.equal(decode(encode(x, "fp32"), "fp32"), x)


@pytest.mark.parametrize(
    ("precision", "bound"),
    [("fp16", lambda x: x.abs() * 2**-11), ("bf16", lambda x: x.abs() * 2**-8)],
)
def test_cast_codecs_round_to_nearest(precision, bound):
    x = torch.randn(64, 37) * 10
    y = decode(encode(x, precision), precision)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert ((y - x).abs() <= bound(x)).all()


def test_fp16_relative_bound_holds_over_its_normal_range():
    # Magnitudes 2**-14 .. 2**15 (fp16's normal range) with random mantissas and signs.
    exponents = torch.randint(-14, 15, (256, 33)).float()
    x = (torch.rand(256, 33) + 1.0) * torch.exp2(exponents) * torch.sign(torch.randn(256, 33))
    assert x.abs().min() >= FP16_MIN_NORMAL and x.abs().max() < FP16_MAX
    err = (decode(encode(x, "fp16"), "fp16") - x).abs()
    assert (err <= x.abs() * 2**-11).all()
    assert (err > x.abs() * 2**-13).any()  # a real rounding, at about the bound's scale


def test_fp16_below_its_normal_range_keeps_an_absolute_bound():
    """Below 2**-14 fp16 is subnormal: the error is at most half its spacing, 2**-25, so the
    relative bound of the module docstring does not hold there (gradients can be that small)."""
    x = torch.randn(64, 16) * 1e-6
    err = (decode(encode(x, "fp16"), "fp16") - x).abs()
    assert (err <= 2.0**-25).all()
    assert (err > x.abs() * 2**-11).any()


def test_bf16_relative_bound_holds_from_tiny_to_huge():
    x = torch.randn(64, 37) * torch.logspace(-30, 30, 64).unsqueeze(1)
    err = (decode(encode(x, "bf16"), "bf16") - x).abs()
    assert (err <= x.abs() * 2**-8).all()
    assert (err > x.abs() * 2**-10).any()


def test_int8_codec_error_is_below_half_a_step_of_each_rows_scale():
    x = torch.randn(64, 37) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[5] = 0.0  # an all-zero row decodes to zeros
    sent = encode(x, "int8")
    assert sent.dtype == torch.int8 and sent.shape == (64, 41)
    y = decode(sent, "int8")
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert ((y - x).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (y[5] == 0).all()


def test_int8_layout_codes_then_the_rows_fp32_scale():
    x = torch.randn(8, 6) * torch.logspace(-2, 2, 8).unsqueeze(1)
    x[3] = -x[3].abs()  # a row whose largest magnitude is negative
    sent = encode(x, "int8")
    scale = sent[:, -4:].contiguous().view(torch.float32)  # the 4 trailing bytes of each row
    assert torch.equal(scale, x.abs().amax(dim=1, keepdim=True) / 127.0)
    codes = sent[:, :-4].long()
    assert codes.abs().max() == 127 and (codes.abs().amax(dim=1) == 127).all()
    assert torch.equal(codes, torch.round(x / scale).long())
    y = decode(sent, "int8")
    assert (y[3] <= 0).all() and torch.equal(torch.sign(y), torch.sign(codes.float()))


def test_int8_scales_each_row_on_its_own():
    small, large = torch.randn(1, 16) * 1e-4, torch.randn(1, 16) * 1e4
    y = decode(encode(torch.cat([small, large]), "int8"), "int8")
    # the small row's error is bounded by its own max, not the large row's
    assert ((y[0] - small[0]).abs() <= small.abs().max() / 254 * (1 + 1e-5)).all()
    assert ((y[1] - large[0]).abs() <= large.abs().max() / 254 * (1 + 1e-5)).all()


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (0, 0)])
def test_empty_blocks_round_trip(precision, shape):
    sent = encode(torch.empty(shape), precision)
    assert sent.shape == (shape[0], wire_width(shape[1], precision))
    assert decode(sent, precision).shape == shape


@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (0, 0)])
def test_int8_empty_blocks_round_trip(shape):
    sent = encode(torch.empty(shape), "int8")
    assert sent.shape == (shape[0], shape[1] + 4)
    assert decode(sent, "int8").shape == shape


@pytest.mark.parametrize("width", [5, 6, 7])
def test_int8_one_row_of_any_width_round_trips(width):
    x = torch.randn(1, width)
    y = decode(encode(x, "int8"), "int8")
    assert ((y - x).abs() <= x.abs().max() / 254 * (1 + 1e-5)).all()


def test_int8_one_row_at_an_aligned_offset_round_trips():
    x = torch.randn(1, 8)
    y = decode(encode(x, "int8"), "int8")
    assert ((y - x).abs() <= x.abs().max() / 254 * (1 + 1e-5)).all()


def test_check_precision_names_the_key_and_the_choices():
    for precision in PRECISIONS:
        assert check_precision(precision, "forward_precision") == precision
    with pytest.raises(ValueError, match=r"backward_precision = 'fp8'; expected one of fp32, "):
        check_precision("fp8", "backward_precision")


# ---------------------------------------------------------------------------------------------
# Reordering received ids


def received_bags(sizes: list[int], num_slots: int, weighted: bool, seed: int):
    """ReceivedIds from len(sizes) sources, and each bag (source, slot, sample) -> its ids and
    weights, for a reference built bag by bag."""
    g = torch.Generator().manual_seed(seed)
    bags, lengths, values, weights = {}, [], [], []
    next_id = 1000
    for source, batch in enumerate(sizes):
        for slot in range(num_slots):
            for sample in range(batch):
                n = int(torch.randint(0, 4, (), generator=g))
                ids = torch.arange(next_id, next_id + n)  # distinct ids: order is visible
                w = torch.rand(n, generator=g) * 2 - 1  # negative too: a weight's sign bit
                next_id += n
                bags[(source, slot, sample)] = (ids, w)
                lengths.append(n)
                values.append(ids)
                weights.append(w)
    received = packed(
        sizes,
        num_slots,
        torch.tensor(lengths, dtype=torch.int64),
        torch.cat(values) if values else torch.empty(0, dtype=torch.int64),
        (torch.cat(weights) if weights else torch.empty(0)) if weighted else None,
    )
    return received, bags


def packed(sizes, num_slots, lengths, values, weights) -> ReceivedIds:
    """What sources with batch ``sizes`` send for ``lengths`` (source-major blocks of
    [num_slots, B_s]), ``values`` and ``weights`` (source-major): per source its lengths, ids
    and weights' bits (each in an int64 word), back to back."""
    per_bag = lengths.split([num_slots * b for b in sizes])
    per_source = [int(x.sum()) for x in per_bag]
    pieces = []
    for s, (bag_lengths, ids) in enumerate(zip(per_bag, values.split(per_source), strict=True)):
        pieces += [bag_lengths, ids]
        if weights is not None:
            pieces.append(weights.split(per_source)[s].view(torch.int32).long())
    counts = torch.tensor([[b, n] for b, n in zip(sizes, per_source, strict=True)])
    dtype = None if weights is None else weights.dtype
    return ReceivedIds(list(sizes), per_source, num_slots, torch.cat(pieces), dtype, counts)


def slot_major_reference(sizes, num_slots, bags):
    lengths, values, weights = [], [], []
    for slot in range(num_slots):
        for source, batch in enumerate(sizes):
            for sample in range(batch):
                ids, w = bags[(source, slot, sample)]
                lengths.append(ids.numel())
                values.append(ids)
                weights.append(w)
    return (
        torch.tensor(lengths, dtype=torch.int64),
        torch.cat(values) if values else torch.empty(0, dtype=torch.int64),
        torch.cat(weights) if weights else torch.empty(0),
    )


@pytest.mark.parametrize(
    ("sizes", "num_slots"),
    [([3, 0, 2, 4], 3), ([5, 5], 2), ([1, 2, 3], 1), ([4], 3), ([0, 0], 2), ([2, 7, 1, 3, 2], 5)],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_source_to_slot_major_matches_a_bag_by_bag_reference(sizes, num_slots, weighted):
    received, bags = received_bags(sizes, num_slots, weighted, seed=len(sizes) * 10 + num_slots)
    lengths, values, weights = source_to_slot_major(received)
    ref_lengths, ref_values, ref_weights = slot_major_reference(sizes, num_slots, bags)
    assert torch.equal(lengths, ref_lengths)
    assert torch.equal(values, ref_values)
    if weighted:
        assert torch.equal(weights, ref_weights)
    else:
        assert weights is None


def test_source_to_slot_major_reorders_when_there_is_something_to_reorder():
    # Guard for the reference above: two sources and two slots do change the order.
    received = packed([2, 2], 2, torch.ones(8, dtype=torch.int64), torch.arange(8), None)
    lengths, values, _ = source_to_slot_major(received)
    assert values.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert lengths.tolist() == [1] * 8


def test_source_to_slot_major_reads_nothing_on_the_host():
    from recsys.train.step_audit import StepAudit  # tests may import the train layer

    received, _ = received_bags([3, 0, 2], 3, weighted=True, seed=1)
    with StepAudit() as report:
        source_to_slot_major(received)
    assert report.syncs == []


# ---------------------------------------------------------------------------------------------
# Byte accounting


def test_comm_stats_counts_bytes_per_kind_and_resets():
    stats = CommStats()
    assert stats.bytes == {"input": 0, "forward": 0, "backward": 0}
    stats.add("input", torch.zeros(3, dtype=torch.int64), torch.zeros(7, dtype=torch.int32))
    stats.add("forward", torch.zeros(2, 5, dtype=torch.float16))
    stats.add("forward", torch.zeros(4, 41, dtype=torch.int8), torch.zeros(0))
    stats.add("backward")
    assert stats.bytes == {"input": 3 * 8 + 7 * 4, "forward": 2 * 5 * 2 + 4 * 41, "backward": 0}
    stats.reset()
    assert stats.bytes == {"input": 0, "forward": 0, "backward": 0}
    assert CommStats().bytes is not CommStats().bytes  # no state shared between instances


# ---------------------------------------------------------------------------------------------
# The exchanges on one rank (in this process)


@pytest.fixture(scope="module")
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("weighted", [False, True])
def test_all_to_all_ids_on_one_rank_returns_the_bags_and_counts_bytes(one_rank, weighted):
    num_slots, batch = 3, 4
    lengths = torch.randint(0, 4, (num_slots * batch,))
    values = torch.randint(0, 100, (int(lengths.sum()),))
    weights = torch.rand(values.numel()) if weighted else None
    stats = CommStats()
    per_rank = torch.tensor([values.numel()])
    received = all_to_all_ids(lengths, values, weights, batch, [num_slots], per_rank, None, stats)
    assert received.batch_sizes == [batch]
    got_lengths, got_values, got_weights = source_to_slot_major(received)
    assert torch.equal(got_lengths, lengths) and torch.equal(got_values, values)
    assert (got_weights is None) if not weighted else torch.equal(got_weights, weights)
    # (batch size, number of ids) per destination as int64, then one int64 block of lengths,
    # ids and weights (each weight's 4 bytes in a word of its own)
    expected = 2 * 8 + lengths.numel() * 8 + values.numel() * 8
    expected += values.numel() * 8 if weighted else 0
    assert stats.bytes == {"input": expected, "forward": 0, "backward": 0}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_pooled_all_to_all_on_one_rank_goes_through_the_codec_both_ways(one_rank, precision):
    batch, width = 5, 12
    pooled = (torch.randn(batch, width) * 3).requires_grad_()
    anchor = torch.zeros((), requires_grad=True)
    layout = PooledLayout([batch], width, [width], precision, precision, grad_scale=0.25)
    stats = CommStats()
    out = pooled_all_to_all(pooled, layout, anchor, None, stats)
    assert torch.equal(out, decode(encode(pooled.detach(), precision), precision))
    grad = torch.randn(batch, width)
    out.backward(grad)
    assert torch.equal(pooled.grad, decode(encode(grad * 0.25, precision), precision))
    wire = batch * wire_width(width, precision) * wire_dtype(precision).itemsize
    assert stats.bytes == {"input": 0, "forward": wire, "backward": wire}
    if precision == "fp32":
        assert torch.equal(out, pooled) and torch.equal(pooled.grad, grad * 0.25)


def test_pooled_all_to_all_runs_its_backward_through_the_anchor(one_rank):
    """Where the pooled rows need no gradient, the anchor still makes backward (a collective
    on several ranks) run."""
    pooled = torch.randn(3, 4)
    anchor = torch.zeros((), requires_grad=True)
    stats = CommStats()
    layout = PooledLayout([3], 4, [4])
    out = pooled_all_to_all(pooled, layout, anchor, None, stats)
    assert out.requires_grad
    out.sum().backward()
    assert stats.bytes["backward"] == 3 * 4 * 4


def test_fp32_pooled_rows_travel_as_they_lie(one_rank, monkeypatch):
    """At fp32 the lookup's rows are sent as they are and received where the output is read
    (no copy on either side); the gradient likewise comes back where the lookup reads it."""
    buffers = []  # (sent, received) of each all-to-all
    real = dist.all_to_all_single

    def spy(output, send, *args, **kwargs):
        buffers.append((send.data_ptr(), output.data_ptr()))
        return real(output, send, *args, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", spy)
    pooled = torch.randn(5, 8)
    lookup = pooled.clone().requires_grad_()
    rows = lookup * 1.0  # the lookup's output, not a leaf
    rows.register_hook(lambda grad: buffers.append(grad.data_ptr()))
    anchor = torch.zeros((), requires_grad=True)
    out = pooled_all_to_all(rows, PooledLayout([5], 8, [8]), anchor, None, CommStats())
    assert buffers[0][0] == rows.data_ptr() and out.data_ptr() == buffers[0][1]
    assert torch.equal(out, pooled)
    out.backward(torch.ones(5, 8))
    assert buffers[2] == buffers[1][1]  # the gradient the lookup gets is the received buffer


@pytest.mark.parametrize("weighted", [False, True])
def test_the_input_dist_reads_its_counts_once_and_sends_the_bags_in_one_all_to_all(
    one_rank, weighted
):
    """The sizes of the ids' all-to-all (what comes in and what goes out) in one read; then
    lengths, ids and weights in one all-to-all."""
    from recsys.train.step_audit import StepAudit

    lengths = torch.randint(0, 4, (6,))
    values = torch.randint(0, 100, (int(lengths.sum()),))
    weights = torch.rand(values.numel()) if weighted else None
    per_rank = torch.tensor([values.numel()])
    with StepAudit() as report:
        all_to_all_ids(lengths, values, weights, 2, [3], per_rank, None, CommStats())
    assert [op for op, _ in report.syncs] == ["tolist"]
    assert [op for op, _ in report.collectives] == ["alltoall_base_"] * 2


def test_the_counts_exchange_carries_extras_to_every_rank(one_rank):
    counts = exchange_counts(5, torch.tensor([7]), None, CommStats(), torch.tensor([1, -3]))
    assert (counts.batch_sizes, counts.num_values, counts.sent_values) == ([5], [7], [7])
    assert counts.extras == [[1, -3]]
    assert counts.received.tolist() == [[5, 7, 1, -3]]


def test_the_counts_exchange_carries_the_ids_per_slot(one_rank):
    """With the ids of each stream, every rank learns how many ids each source sends each of
    its slots (the received KeyedJaggedTensor's length per key, known on the host)."""
    counts = exchange_counts(
        5, torch.tensor([7]), None, CommStats(), torch.tensor([1]), None, torch.tensor([3, 4]), [2]
    )
    assert (counts.num_values, counts.slot_values, counts.extras) == ([7], [[3, 4]], [[1]])
    assert counts.received_extras.tolist() == [[1]]


def test_int8_is_the_documented_formula_bitwise():
    """scale = max|x| / 127 per row, q = round(x / scale), decoded q * scale; rows of zeros
    (either sign) send a zero scale and decode to +0."""
    x = torch.randn(300, 37) * torch.logspace(-30, 30, 300).unsqueeze(1)
    x[0], x[1] = 0.0, -0.0
    scale = x.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)).to(torch.int8)
    sent = encode(x, "int8")
    assert torch.equal(sent, torch.cat([q, scale.view(torch.int8)], dim=1))
    out = torch.empty_like(x)
    decoded = decode(sent, "int8", out=out)
    assert decoded is out and torch.equal(out, q.float() * scale)
    assert not out[:2].signbit().any()
