"""PooledAssembly on its own (no process group): the received blocks of one rank's output dist
put in the model's order, forward and backward, against a plain PyTorch reference (bitwise:
the same additions in the same order), and the scratch buffers it keeps between steps."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recsys.distributed.assembly import PooledAssembly, ScratchBuffers

CPU = torch.device("cpu")

# (widths per rank, features in output order); see PooledAssembly for the feature forms.
SPECS = {
    # Two ranks, chunk 1 (a replicated dim of 3): a row-wise mean feature, a column-wise one, a
    # replicated one, a table-wise one, and a row-wise one on rank 1 only (rank 0's part: zero).
    "mixed": (
        [4, 8],
        [
            ("sum", 2, [(0, 0), (1, 0)], True),
            ("direct", [(0, 2, 2), (1, 2, 2)]),
            ("replicated", 3),
            ("direct", [(1, 4, 2)]),
            ("sum", 2, [(1, 6)], False),
        ],
    ),
    # Three ranks, chunk 4; column pieces listed out of rank order, a rank holding nothing.
    "chunked": (
        [16, 16, 0],
        [
            ("direct", [(1, 0, 4), (0, 0, 4)]),
            ("sum", 8, [(0, 4), (1, 4)], False),
            ("replicated", 8),
            ("direct", [(0, 12, 4)]),
            ("sum", 4, [(1, 12)], True),
        ],
    ),
}


def reference(widths, features, blocks, pooled_dp, lengths):
    """The assembly in plain PyTorch: pieces cut and concatenated, partial sums added one
    after another in shard order (a zero for each missing shard), means divided."""
    num_parts = max(len(f[2]) for f in features if f[0] == "sum")
    columns, dp_col = [], 0
    for f, feature in enumerate(features):
        if feature[0] == "direct":
            columns += [blocks[r][:, s : s + n] for r, s, n in feature[1]]
        elif feature[0] == "sum":
            _, dim, parts, mean = feature
            total = blocks[parts[0][0]][:, parts[0][1] : parts[0][1] + dim]
            for r, s in parts[1:]:
                total = total + blocks[r][:, s : s + dim]
            for _ in range(num_parts - len(parts)):
                total = total + torch.zeros_like(total)
            if mean:
                total = total * (1.0 / lengths[f].clamp(min=1).float()).unsqueeze(1)
            columns.append(total)
        else:
            columns.append(pooled_dp[:, dp_col : dp_col + feature[1]])
            dp_col += feature[1]
    return torch.cat(columns, dim=1)


def inputs(widths, features, batch):
    blocks = [torch.randn(batch, w, requires_grad=True) for w in widths]
    dp_width = sum(f[1] for f in features if f[0] == "replicated")
    pooled_dp = torch.randn(batch, dp_width, requires_grad=True)
    lengths = torch.randint(0, 4, (len(features), batch))
    return blocks, pooled_dp, lengths


def run(assembly, blocks, pooled_dp, lengths, batch, layout="blocks"):
    """Forward from the blocks (received in ``layout``), as the output dist runs it."""
    index = assembly.index(batch, layout)
    pool = assembly.new_pool(index, CPU)
    if layout == "blocks":
        received = torch.cat([b.detach().reshape(-1) for b in blocks])
    else:
        received = torch.cat([b.detach() for b in blocks], dim=1).reshape(-1)
    pool.view(-1)[: received.numel()].copy_(received)
    scale = assembly.mean_scale(lengths, batch)
    return assembly.forward(pool, pooled_dp.detach(), scale, index), scale, index


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("batch", [5, 1, 0])
def test_forward_and_backward_match_the_reference_bitwise(spec, batch):
    widths, features = SPECS[spec]
    assembly = PooledAssembly(widths, features, CPU)
    blocks, pooled_dp, lengths = inputs(widths, features, batch)
    expected = reference(widths, features, blocks, pooled_dp, lengths)
    out, scale, index = run(assembly, blocks, pooled_dp, lengths, batch)
    assert out.shape == expected.shape == (batch, assembly.width)
    assert torch.equal(out, expected)
    for layout in ("matrix", "blocks"):  # the cached index tables agree
        assert torch.equal(run(assembly, blocks, pooled_dp, lengths, batch, layout)[0], expected)

    grad = torch.randn(batch, assembly.width)
    expected.backward(grad)
    send = assembly.backward(grad, scale, 0.25, index)
    # What each rank is sent: its block's gradient, times the scale, back to back.
    grads = [torch.zeros_like(b) if b.grad is None else b.grad for b in blocks]  # width 0
    assert torch.equal(send, torch.cat([(g * 0.25).reshape(-1) for g in grads]))
    assert torch.equal(assembly.dp_grad(grad, index), pooled_dp.grad)


def test_an_unknown_feature_form_is_named():
    with pytest.raises(ValueError, match="'rows'"):
        PooledAssembly([4], [("rows", 4)], CPU)


def test_chunks_are_the_gcd_of_the_pieces():
    assert PooledAssembly(*SPECS["mixed"], CPU).chunk == 1
    assert PooledAssembly(*SPECS["chunked"], CPU).chunk == 4
    assert PooledAssembly.exchange_order([64, 128, 0], CPU).chunk == 64


def test_partial_sums_add_in_shard_order():
    """Four shards' partials of very different sizes: the result is ((p0 + p1) + p2) + p3,
    which another order would not give for these values."""
    dim, batch = 4, 64
    features = [("sum", dim, [(r, 0) for r in range(4)], False)]
    assembly = PooledAssembly([dim] * 4, features, CPU)
    scales = torch.tensor([1e8, 1.0, -1e8, 1e-3])
    blocks = [torch.randn(batch, dim) * s for s in scales]
    out, _, _ = run(assembly, blocks, torch.zeros(batch, 0), None, batch)
    p = blocks
    assert torch.equal(out, ((p[0] + p[1]) + p[2]) + p[3])
    assert not torch.equal(out, ((p[0] + p[2]) + p[1]) + p[3])


@pytest.mark.parametrize("num_parts", [1, 2, 4])
def test_up_to_four_shards_add_as_torch_sum_does(num_parts):
    """With 2 and 4 ranks the row-wise sums are bitwise what torch.sum over the parts gave
    before the output dist added them itself."""
    batch, dim = 50, 24
    features = [("sum", dim, [(r, 0) for r in range(num_parts)], False)]
    assembly = PooledAssembly([dim] * num_parts, features, CPU)
    scales = torch.logspace(-6, 6, num_parts)
    blocks = [torch.randn(batch, dim) * s for s in scales]
    out, _, _ = run(assembly, blocks, torch.zeros(batch, 0), None, batch)
    assert torch.equal(out, torch.stack(blocks, dim=1).sum(dim=1))


# Ops that move no data (views, and the allocation of a scratch buffer's first use).
METADATA = {"view", "slice", "select", "detach", "_unsafe_view", "split", "split_with_sizes"}
METADATA |= {"as_strided", "empty"}


class _Ops(TorchDispatchMode):
    """The names of the data-moving aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in METADATA:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_every_table_row_wise_adds_the_received_blocks_and_moves_nothing():
    """All row-wise over 3 ranks: forward is one strided sum over the received blocks, the
    output a view of it; backward writes the scaled gradient into each rank's block (no
    gather, no zero-filled buffer, no scatter)."""
    dims, batch = [8, 16, 8], 6
    widths = [sum(dims)] * 3
    starts = [sum(dims[:i]) for i in range(len(dims))]
    features = [
        ("sum", d, [(r, s) for r in range(3)], False) for d, s in zip(dims, starts, strict=True)
    ]
    assembly = PooledAssembly(widths, features, CPU)
    blocks = [torch.randn(batch, w) for w in widths]
    index = assembly.index(batch)
    pool = assembly.new_pool(index, CPU)
    pool.view(-1)[: 3 * batch * widths[0]].copy_(torch.cat([b.reshape(-1) for b in blocks]))
    with _Ops() as ops:
        out = assembly.forward(pool, None, None, index)
    assert ops.names == ["add", "add_"]
    assert out.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    assert torch.equal(out, blocks[0] + blocks[1] + blocks[2])
    grad = torch.randn(batch, widths[0])
    with _Ops() as ops:
        send = assembly.backward(grad, None, 0.5, index)
    assert ops.names == ["mul"] * 3
    assert torch.equal(send, (grad * 0.5).reshape(-1).repeat(3))


def test_a_gathered_output_and_gradient_take_one_gather_each():
    """Table-wise pieces from two ranks, interleaved in the output: one gather forward, one
    per destination backward, then the scale; nothing filled with zeros, nothing scattered."""
    widths, batch = [8, 8], 3
    features = [("direct", [(t % 2, 4 * (t // 2), 4)]) for t in range(4)]
    assembly = PooledAssembly(widths, features, CPU)
    blocks = [torch.randn(batch, w) for w in widths]
    index = assembly.index(batch)
    pool = assembly.new_pool(index, CPU)
    pool.view(-1)[: 2 * batch * 8].copy_(torch.cat([b.reshape(-1) for b in blocks]))
    with _Ops() as ops:
        out = assembly.forward(pool, None, None, index)
    assert ops.names == ["index_select"]
    b0, b1 = blocks
    assert torch.equal(out, torch.cat([b0[:, :4], b1[:, :4], b0[:, 4:], b1[:, 4:]], dim=1))
    grad = torch.randn(batch, 16)
    with _Ops() as ops:
        assembly.backward(grad, None, 0.5, index)
    assert ops.names == ["index_select", "index_select", "mul_"]


def test_scratch_buffers_come_back_only_once_nothing_holds_them():
    scratch = ScratchBuffers()
    first = scratch.take("x", 100, torch.float32, CPU)
    address = first.data_ptr()
    view = first[10:20]
    del first
    held = scratch.take("x", 100, torch.float32, CPU)  # the view still holds the first
    assert held.data_ptr() != address
    del view, held
    again = scratch.take("x", 60, torch.float32, CPU)
    assert again.numel() == 60
    del again
    bigger = scratch.take("x", 200, torch.float32, CPU)
    assert bigger.numel() == 200
    address = bigger.data_ptr()
    del bigger
    assert scratch.take("x", 200, torch.float32, CPU).data_ptr() == address
    assert scratch.take("y", 200, torch.float16, CPU).dtype == torch.float16
