"""HSTU jagged attention against Meta's definition: a dense HSTU written from
generative-recommenders' ``pytorch_hstu_mha`` / ``_get_valid_attn_mask``
(``generative_recommenders/ops/pytorch/pt_hstu_attention.py``), the position rows of their
fused relative-bias kernel and the time half of their research
``RelativeBucketedTimeAndPositionBasedBias`` (``time_convention="next"``), transcribed line by
line below and independent of the op's code, compared with the float64 reference, the padded
torch path and the Triton kernels (interpreted), forward and backward, for every mask
option."""

from __future__ import annotations

import pytest
import torch

from recsys.ops.jagged.attention import jagged_attention, jagged_attention_reference, visible


def meta_valid_attn_mask(
    N: int,
    seq_lengths: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_attn_len: int,
    contextual_seq_len: int,
    min_full_attn_seq_len: int,
) -> torch.Tensor:
    """Meta's ``_get_valid_attn_mask(device, causal=True, N, seq_lengths, num_targets,
    max_attn_len, contextual_seq_len, min_full_attn_seq_len)``: [B or 1, N, N] bool."""
    ids = torch.arange(0, N).view(1, N)
    max_ids = seq_lengths.view(-1, 1, 1)
    if contextual_seq_len > 0:
        ids = ids - contextual_seq_len + 1
        ids = torch.clamp(ids, min=0)
        max_ids = max_ids - contextual_seq_len + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.view(-1, 1, 1)
        ids = torch.clamp(ids, max=max_ids)
        row_ids = ids.view(-1, N, 1).expand(-1, N, N)
        col_ids = ids.view(-1, 1, N).expand(-1, N, N)
    else:
        row_ids = ids.view(N, 1).expand(N, N)
        col_ids = row_ids.t()
        row_ids = row_ids.view(1, N, N)
        col_ids = col_ids.view(1, N, N)
    row_col_dist = row_ids - col_ids
    valid_attn_mask = torch.eye(N, dtype=torch.bool).view(1, N, N)
    valid_attn_mask = torch.logical_or(valid_attn_mask, row_col_dist > 0)
    if max_attn_len > 0:
        if min_full_attn_seq_len > 0:
            valid_attn_mask = torch.logical_and(
                valid_attn_mask,
                torch.logical_or(
                    row_col_dist <= max_attn_len,
                    row_ids >= max_ids - min_full_attn_seq_len,
                ),
            )
        else:
            valid_attn_mask = torch.logical_and(valid_attn_mask, row_col_dist <= max_attn_len)
    if contextual_seq_len > 0:
        valid_attn_mask = torch.logical_or(
            valid_attn_mask, torch.logical_and(row_ids == 0, col_ids < max_ids)
        )
    return valid_attn_mask


def meta_fused_position_rows(seq_len, n_targets, contextual_seq_len, max_pos_ind):
    """[n, n] rows of the position table that Meta's fused relative-bias kernel reads for one
    sequence (``_ragged_hstu_attn_fwd_one_block`` of
    ``generative_recommenders/ops/triton/triton_ragged_hstu_attention.py``, as of 2024-12:
    ``offs_pos_w`` from ``offs_n_minus_m`` of the clamped ids, ``HAS_MAX_POS_IND``)."""
    offs_m = offs_n = torch.arange(seq_len)
    max_ids = seq_len
    if contextual_seq_len > 0:
        offs_m = offs_m - contextual_seq_len + 1
        offs_m = torch.where(offs_m > 0, offs_m, 0)
        offs_n = offs_n - contextual_seq_len + 1
        offs_n = torch.where(offs_n > 0, offs_n, 0)
        max_ids = max_ids - contextual_seq_len + 1
    if n_targets is not None:
        max_ids = max_ids - n_targets
        offs_m = torch.where(offs_m < max_ids, offs_m, max_ids)
        offs_n = torch.where(offs_n < max_ids, offs_n, max_ids)
    offs_n_minus_m = offs_n[None, :] - offs_m[:, None]
    offs_pos_w = offs_n_minus_m + max_pos_ind - 1
    offs_pos_w = torch.where(offs_pos_w > 0, offs_pos_w, 0)
    return torch.where(offs_pos_w < 2 * max_pos_ind - 2, offs_pos_w, 2 * max_pos_ind - 2)


# the research HSTU's bucketization_fn, with 0.301 as the float32 value the op documents
DIV = float(torch.tensor(0.301, dtype=torch.float32))


def bucketization_fn(x):
    return (torch.log(torch.abs(x).clamp(min=1)) / DIV).long()


def meta_relative_time_bias(all_timestamps, ts_w, num_buckets):
    """The time half of ``RelativeBucketedTimeAndPositionBasedBias.forward``
    (``generative_recommenders/research/modeling/sequential/hstu.py``): [B, N, N]."""
    B = all_timestamps.size(0)
    N = all_timestamps.size(1)
    # [B, N + 1] to simplify tensor manipulations.
    ext_timestamps = torch.cat([all_timestamps, all_timestamps[:, N - 1 : N]], dim=1)
    # causal masking. Otherwise [:, :-1] - [:, 1:] works
    bucketed_timestamps = torch.clamp(
        bucketization_fn(ext_timestamps[:, 1:].unsqueeze(2) - ext_timestamps[:, :-1].unsqueeze(1)),
        min=0,
        max=num_buckets,
    ).detach()
    return torch.index_select(ts_w, dim=0, index=bucketed_timestamps.view(-1)).view(B, N, N)


def meta_hstu_mha(
    q,
    k,
    v,
    offsets,
    max_seq_len,
    alpha,
    num_targets,
    masking,
    position_weights=None,
    timestamps=None,
    time_weights=None,
):
    """Meta's ``pytorch_hstu_mha`` (causal, no dropout, no attn_scale) in float64: pad to
    [B, H, N, D], ``silu(alpha q k^T + rab) / N`` times the mask, times v, back to jagged
    rows; rab from ``position_weights`` as their fused relative-bias kernel reads it, plus
    the research module's time bias from ``timestamps`` padded with each sequence's last time
    (so a last row's next time, Meta's slot n, is its own: the op's documented rule)."""
    lengths = offsets.diff()
    batch, heads, N = lengths.numel(), q.shape[1], max_seq_len

    def pad(x):
        out = x.new_zeros(batch, N, heads, x.shape[2], dtype=torch.float64)
        for b in range(batch):
            out[b, : lengths[b]] = x[offsets[b] : offsets[b + 1]].double()
        return out.transpose(1, 2)  # [B, H, N, D]

    qp, kp, vp = pad(q), pad(k), pad(v)
    qk_attn = torch.einsum("bhxa,bhya->bhxy", qp, kp) * alpha
    if position_weights is not None:
        rab = torch.zeros(batch, N, N, dtype=torch.float64)
        for b, n in enumerate(lengths.tolist()):
            targets = None if num_targets is None else int(num_targets[b])
            reach = (position_weights.numel() + 1) // 2
            rows = meta_fused_position_rows(n, targets, masking["contextual_seq_len"], reach)
            rab[b, :n, :n] = position_weights.double()[rows]
        qk_attn = qk_attn + rab.unsqueeze(1)
    if time_weights is not None:
        all_timestamps = torch.zeros(batch, N, dtype=torch.float64)
        for b, n in enumerate(lengths.tolist()):
            if n:
                all_timestamps[b] = timestamps[offsets[b] : offsets[b + 1]][-1]
                all_timestamps[b, :n] = timestamps[offsets[b] : offsets[b + 1]]
        rab = meta_relative_time_bias(
            all_timestamps, time_weights.double(), time_weights.numel() - 1
        )
        qk_attn = qk_attn + rab.unsqueeze(1)
    qk_attn = torch.nn.functional.silu(qk_attn) / N
    valid_attn_mask = meta_valid_attn_mask(N, lengths, num_targets, **masking)
    qk_attn = qk_attn * valid_attn_mask.unsqueeze(1)
    dense = torch.einsum("bhxd,bhdv->bhxv", qk_attn, vp).transpose(1, 2)  # [B, N, H, V]
    return torch.cat([dense[b, : lengths[b]] for b in range(batch)])


def _meta_masking(max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0):
    return dict(
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        min_full_attn_seq_len=min_full_attn_seq_len,
    )


def _ours(masking: dict) -> dict:
    return dict(
        max_attn_len=masking["max_attn_len"],
        contextual_len=masking["contextual_seq_len"],
        min_full_attn_seq_len=masking["min_full_attn_seq_len"],
    )


# (name, with targets, Meta's mask options)
CASES = [
    ("causal", False, _meta_masking()),
    ("targets", True, _meta_masking()),
    ("window 1", False, _meta_masking(max_attn_len=1)),
    ("window 3", False, _meta_masking(max_attn_len=3)),
    ("window 1 + targets", True, _meta_masking(max_attn_len=1)),
    ("window 4 + targets", True, _meta_masking(max_attn_len=4)),
    ("prefix 1", False, _meta_masking(contextual_seq_len=1)),
    ("prefix 3", False, _meta_masking(contextual_seq_len=3)),
    ("prefix 3 + targets", True, _meta_masking(contextual_seq_len=3)),
    ("prefix 2 + window 2", False, _meta_masking(max_attn_len=2, contextual_seq_len=2)),
    ("prefix 3 + window 1", False, _meta_masking(max_attn_len=1, contextual_seq_len=3)),
    ("all", True, _meta_masking(max_attn_len=3, contextual_seq_len=2)),
    ("full 2 + window 2", False, _meta_masking(max_attn_len=2, min_full_attn_seq_len=2)),
    ("full 3 + all", True, _meta_masking(3, contextual_seq_len=2, min_full_attn_seq_len=3)),
]
IDS = [name for name, _, _ in CASES]


def _case(lengths, targets, heads=2, d_qk=4, d_v=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, d_qk, generator=g) for _ in range(2))
    v = torch.randn(total, heads, d_v, generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    num_targets = None
    if targets:
        num_targets = torch.tensor(
            [min(n - 3, b % 4) if n > 3 else 0 for b, n in enumerate(lengths)]
        )
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], offsets, num_targets


def _times(lengths, seed=4, same_targets=None):
    """Increasing epoch seconds per sequence: gaps from under a second to days, some ties;
    with ``same_targets`` [B], each sequence's targets share one time (a request's)."""
    g = torch.Generator().manual_seed(seed)
    gaps = torch.exp(torch.rand(sum(lengths), generator=g, dtype=torch.float64) * 14 - 2)
    gaps[::5] = 0.0
    times, start = [], 0
    for b, n in enumerate(lengths):
        sequence = 1.7e9 + gaps[start : start + n].cumsum(0)
        if same_targets is not None and int(same_targets[b]):
            sequence[n - int(same_targets[b]) :] = sequence[-1]
        times.append(sequence)
        start += n
    return torch.cat(times)


def _grads(out, inputs, upstream):
    return torch.autograd.grad((out.double() * upstream).sum(), inputs)


@pytest.mark.parametrize("bias", [None, "position", "position + time"])
@pytest.mark.parametrize(("name", "targets", "masking"), CASES, ids=IDS)
def test_reference_and_torch_path_are_metas(name, targets, masking, bias):
    shortest = max(1, masking["contextual_seq_len"])  # a prefix fits in every history
    lengths = [0, shortest, 3, 7, 11, 6]
    (q, k, v), offsets, num_targets = _case(lengths, targets)
    options = dict(alpha=0.7, num_targets=num_targets, **_ours(masking))
    tables = {}
    if bias:  # 2P - 1 = 7 rows: shorter than the sequences, the end rows shared
        tables["position_weights"] = torch.randn(7, dtype=torch.float64, requires_grad=True)
    if bias == "position + time":  # 20 buckets: the longest gaps share the last
        tables["time_weights"] = torch.randn(21, dtype=torch.float64, requires_grad=True)
        options |= {"timestamps": _times(lengths), "time_convention": "next"}
    inputs = [q, k, v, *tables.values()]
    want = meta_hstu_mha(
        q,
        k,
        v,
        offsets,
        12,
        0.7,
        num_targets,
        masking,
        **tables,
        timestamps=options.get("timestamps"),
    )
    options |= tables
    upstream = torch.randn(want.shape, dtype=torch.float64)
    wants = _grads(want, inputs, upstream)
    for got in (
        jagged_attention_reference(q, k, v, offsets, 12, **options),
        jagged_attention(q, k, v, offsets, 12, backend="torch", **options),
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for a, b in zip(_grads(got, inputs, upstream), wants, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("name", "targets", "masking"), CASES, ids=IDS)
def test_triton_is_metas(name, targets, masking):
    # long enough for several tiles: prefix rows, windows and targets across tile edges
    lengths = [0, max(1, masking["contextual_seq_len"]), 33, 70, 5]
    (q, k, v), offsets, num_targets = _case(lengths, targets, d_qk=8, d_v=6, dtype=torch.float32)
    tables = {
        "position_weights": torch.randn(41, requires_grad=True),  # P = 21 < the longest
        "time_weights": torch.randn(25, requires_grad=True),
    }
    timestamps = _times(lengths)
    inputs = [q, k, v, *tables.values()]
    options = dict(alpha=0.7, num_targets=num_targets, **_ours(masking), **tables)
    got = jagged_attention(
        q,
        k,
        v,
        offsets,
        72,
        backend="triton",
        timestamps=timestamps,
        time_convention="next",
        **options,
    )
    want = meta_hstu_mha(
        q, k, v, offsets, 72, 0.7, num_targets, masking, **tables, timestamps=timestamps
    )
    scale = want.abs().max()
    assert (got.double() - want).abs().max() <= 1e-5 * scale
    upstream = torch.randn(want.shape, dtype=torch.float64)
    wants = _grads(want, inputs, upstream)
    gots = _grads(got, inputs, upstream)
    for name_, a, b in zip([*"qkv", *tables], gots, wants, strict=True):
        assert (a.double() - b).abs().max() <= 4e-5 * b.abs().max(), name_


def test_a_window_of_one_keeps_the_previous_key_and_the_diagonal():
    want = torch.eye(5, dtype=torch.bool) | torch.diag(torch.ones(4, dtype=torch.bool), -1)
    assert torch.equal(meta_valid_attn_mask(5, torch.tensor([5]), None, 1, 0, 0)[0], want)
    i, j, n = torch.arange(5)[:, None], torch.arange(5)[None, :], torch.tensor(5)
    assert torch.equal(visible(i, j, n, n, contextual_len=0, max_attn_len=1), want)


def _reversed_targets(offsets, num_targets) -> torch.Tensor:
    """Row order with each sequence's targets reversed (the history in place)."""
    order = []
    for b in range(offsets.numel() - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        history = end - int(num_targets[b])
        order += [*range(start, history), *range(end - 1, history - 1, -1)]
    return torch.tensor(order)


@pytest.mark.parametrize("time_convention", ["own", "next"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_reversing_the_targets_permutes_their_outputs(backend, time_convention):
    # a window shorter than the targets: before, far targets lost the history to it. With
    # "next" a row's time is the next row's, so the targets share their request's time.
    lengths = [9, 40, 37, 4]
    num_targets = torch.tensor([5, 8, 3, 1])
    (q, k, v), offsets, _ = _case(lengths, False, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    times = _times(lengths, same_targets=num_targets if time_convention == "next" else None)
    options = dict(
        time_convention=time_convention,
        alpha=0.7,
        num_targets=num_targets,
        max_attn_len=3,
        contextual_len=2,
        timestamps=times,
        position_weights=torch.randn(9, generator=g),
        time_weights=torch.randn(30, generator=g),
        backend=backend,
    )
    order = _reversed_targets(offsets, num_targets)
    out = jagged_attention(q, k, v, offsets, 40, **options)
    flipped = jagged_attention(
        q[order], k[order], v[order], offsets, 40, **options | {"timestamps": times[order]}
    )
    assert torch.equal(flipped, out[order])


def test_bad_mask_and_time_settings_are_named():
    (q, k, v), offsets, _ = _case([0, 4, 3], False)
    jagged_attention(q, k, v, offsets, 4, contextual_len=3)  # the empty sequence: no rows
    with pytest.raises(ValueError, match="contextual_len = 4; sequence 2 has 3 rows, 3 of them"):
        jagged_attention(q, k, v, offsets, 4, contextual_len=4)
    with pytest.raises(ValueError, match="contextual_len = 3; sequence 1 has 4 rows, 2 of them"):
        jagged_attention(q, k, v, offsets, 4, contextual_len=3, num_targets=torch.tensor([0, 2, 0]))
    with pytest.raises(ValueError, match="min_full_attn_seq_len=-1: expected >= 0"):
        jagged_attention(q, k, v, offsets, 4, min_full_attn_seq_len=-1)
    with pytest.raises(ValueError, match=r"time_convention='previous': expected one of"):
        jagged_attention(q, k, v, offsets, 4, time_convention="previous")
