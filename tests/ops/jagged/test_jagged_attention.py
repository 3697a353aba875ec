"""HSTU jagged attention: the torch path and the Triton kernels (interpreted) against the
float64 reference, forward and backward, for every mask option, with and without the relative
attention bias (position and time tables, whose gradients are checked too)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from recsys.ops.jagged.attention import jagged_attention, jagged_attention_reference

MASKS = {
    "causal": {},
    "targets": {"targets": True},
    "context": {"contextual_len": 3},
    "window": {"max_attn_len": 5},
    "all": {"targets": True, "contextual_len": 2, "max_attn_len": 7},
}


def _fit(lengths, mask):
    """``lengths`` with every non-empty sequence at least as long as ``mask``'s contextual
    prefix (``jagged_attention`` refuses a prefix longer than a history)."""
    prefix = MASKS[mask].get("contextual_len", 0)
    return [max(n, prefix) if n else 0 for n in lengths]


def _case(lengths, heads=2, d_qk=8, d_v=12, seed=0, dtype=torch.float32, targets=False, prefix=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, d_qk, generator=g) for _ in range(2))
    v = torch.randn(total, heads, d_v, generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    num_targets = None
    if targets:
        # the targets leave the contextual prefix in the history
        room = [max(n - prefix, 0) for n in lengths]
        num_targets = torch.tensor([min(r, (3 * i) % 4) for i, r in enumerate(room)])
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], offsets, num_targets


BIASES = [None, "position", "time", "both"]


def _bias(lengths, kind, seed=1, dtype=torch.float32, reach=20, buckets=24):
    """The relative bias options of ``kind`` (None: none): position table of 2 * reach - 1
    rows (shorter than the longest test sequence, so the end rows are shared), a time table of
    buckets + 1 rows, and per-sequence increasing timestamps (epoch seconds, gaps from under a
    second to days, some ties) whose log buckets reach past the table."""
    if kind is None:
        return {}
    g = torch.Generator().manual_seed(seed)
    gaps = torch.exp(torch.rand(sum(lengths), generator=g, dtype=torch.float64) * 14 - 2)
    gaps[::5] = 0.0
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    times = torch.cat([1.7e9 + gaps[a:b].cumsum(0) for a, b in itertools.pairwise(starts)])
    options = {}
    if kind in ("position", "both"):
        options["position_weights"] = torch.randn(2 * reach - 1, generator=g).to(dtype)
    if kind in ("time", "both"):
        options["time_weights"] = torch.randn(buckets + 1, generator=g).to(dtype)
        options["timestamps"] = times
    return options


def _options(mask: str, num_targets, bias=None):
    options = dict(MASKS[mask])
    options.pop("targets", None)
    return options | {"num_targets": num_targets, "alpha": 0.7} | (bias or {})


def _tables(options):
    """The bias tables of ``options`` as fresh leaves requiring grad (float64 if ``double``)."""
    return {
        name: value.detach().clone().requires_grad_()
        for name, value in options.items()
        if name.endswith("_weights")
    }


def _grads(out, inputs, upstream):
    return torch.autograd.grad((out.float() * upstream).sum(), inputs)


@pytest.mark.parametrize("bias", [None, "both"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_the_padded_torch_path_is_the_reference(mask, bias):
    lengths = _fit([0, 1, 5, 9, 4], mask)
    prefix = MASKS[mask].get("contextual_len", 0)
    (q, k, v), offsets, num_targets = _case(
        lengths, dtype=torch.float64, targets="targets" in MASKS[mask], prefix=prefix
    )
    options = _options(mask, num_targets, _bias(lengths, bias, dtype=torch.float64, reach=4))
    tables = _tables(options)
    inputs = [q, k, v, *tables.values()]
    want = jagged_attention_reference(q, k, v, offsets, 10, **options | tables)
    got = jagged_attention(q, k, v, offsets, 10, backend="torch", **options | tables)
    assert torch.allclose(got, want, atol=1e-12)
    upstream = torch.randn_like(want)
    for a, b in zip(_grads(got, inputs, upstream), _grads(want, inputs, upstream), strict=True):
        assert torch.allclose(a, b, atol=1e-12)


def _dense_hstu(q, k, v, offsets, max_seq_len, alpha, num_targets, bias_options):
    """A padded dense HSTU written independently of the op (Meta's research formulation, with
    target positions pinned): [B, N, N] bias built by explicit loops."""
    lengths = offsets.diff().tolist()
    heads = q.shape[1]
    out = torch.zeros(q.shape[0], heads, v.shape[2], dtype=torch.float64)
    positions = bias_options.get("position_weights")
    times = bias_options.get("time_weights")
    stamps = bias_options.get("timestamps")
    for b, n in enumerate(lengths):
        start = int(offsets[b])
        history = n - int(num_targets[b])
        for i in range(n):
            for j in range(n):
                target_i, target_j = i >= history, j >= history
                if (not target_i and j > i) or (target_i and target_j and i != j):
                    continue
                rab = 0.0
                if positions is not None:
                    reach = (positions.numel() + 1) // 2
                    gap = min(j, history) - min(i, history) + reach - 1
                    rab += float(positions[min(max(gap, 0), 2 * reach - 2)])
                if times is not None:
                    dt = max(abs(float(stamps[start + i]) - float(stamps[start + j])), 1e-6)
                    bucket = math.floor(math.log(dt / 1.0) / float(torch.tensor(0.301).float()))
                    rab += float(times[min(max(bucket, 0), times.numel() - 1)])
                for h in range(heads):
                    s = alpha * float(q[start + i, h].double() @ k[start + j, h].double()) + rab
                    weight = s / (1.0 + math.exp(-s)) / max_seq_len
                    out[start + i, h] += weight * v[start + j, h].double()
    return out


def test_the_reference_matches_a_dense_loop_with_bias_and_targets():
    lengths = [0, 1, 6, 9]
    (q, k, v), offsets, _ = _case(lengths, heads=2, d_qk=3, d_v=2, dtype=torch.float64)
    num_targets = torch.tensor([0, 1, 2, 3])
    bias = _bias(lengths, "both", dtype=torch.float64, reach=3, buckets=40)
    want = _dense_hstu(q.detach(), k.detach(), v.detach(), offsets, 12, 0.7, num_targets, bias)
    got = jagged_attention_reference(
        q, k, v, offsets, 12, alpha=0.7, num_targets=num_targets, **bias
    )
    assert torch.allclose(got, want, atol=1e-12)


def test_gradcheck_of_the_torch_path():
    (q, k, v), offsets, num_targets = _case(
        [3, 0, 4], d_qk=3, d_v=2, dtype=torch.float64, targets=True
    )
    torch.autograd.gradcheck(
        lambda q, k, v: jagged_attention(
            q, k, v, offsets, 5, num_targets=num_targets, contextual_len=1, backend="torch"
        ),
        (q, k, v),
    )


def test_gradcheck_with_the_relative_bias():
    lengths = [3, 0, 4]
    (q, k, v), offsets, num_targets = _case(
        lengths, d_qk=3, d_v=2, dtype=torch.float64, targets=True
    )
    bias = _bias(lengths, "both", dtype=torch.float64, reach=2, buckets=10)
    position_weights, time_weights = _tables(bias).values()

    def attend(q, k, v, position_weights, time_weights):
        return jagged_attention_reference(
            q,
            k,
            v,
            offsets,
            5,
            num_targets=num_targets,
            timestamps=bias["timestamps"],
            position_weights=position_weights,
            time_weights=time_weights,
        )

    torch.autograd.gradcheck(attend, (q, k, v, position_weights, time_weights))


# every mask with and without the bias in fp32; bf16 without it and with everything at once
TRITON_CASES = [(mask, bias, torch.float32) for mask in MASKS for bias in (None, "both")]
TRITON_CASES += [("causal", "position", torch.float32), ("targets", "time", torch.float32)]
TRITON_CASES += [(mask, None, torch.bfloat16) for mask in MASKS]
TRITON_CASES += [("all", "both", torch.bfloat16), ("causal", "position", torch.bfloat16)]


@pytest.mark.parametrize(("mask", "bias", "dtype"), TRITON_CASES)
def test_triton_matches_the_reference(mask, bias, dtype):
    # empty, one row (or the prefix), a tile - 1, a tile, a tile + 1
    lengths = _fit([0, 1, 31, 32, 33, 7], mask)
    prefix = MASKS[mask].get("contextual_len", 0)
    (q, k, v), offsets, num_targets = _case(
        lengths, dtype=dtype, targets="targets" in MASKS[mask], prefix=prefix
    )
    options = _options(mask, num_targets, _bias(lengths, bias))
    tables = _tables(options)
    got = jagged_attention(q, k, v, offsets, 40, backend="triton", **options | tables)
    assert got.dtype == dtype
    reference_tables = {name: w.detach().double().requires_grad_() for name, w in tables.items()}
    reference_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = jagged_attention_reference(*reference_inputs, offsets, 40, **options | reference_tables)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = want.abs().max()
    assert (got.double() - want).abs().max() <= tol * scale
    upstream = torch.randn(want.shape, dtype=torch.float64)
    wants = _grads(want, [*reference_inputs, *reference_tables.values()], upstream)
    gots = _grads(got, [q, k, v, *tables.values()], upstream.to(dtype))
    names = [*"qkv", *tables]
    for name, a, b in zip(names, gots, wants, strict=True):
        assert a.dtype == (dtype if name in "qkv" else torch.float32), name
        assert (a.double() - b).abs().max() <= 4 * tol * b.abs().max(), name


def test_zipf_lengths_up_to_a_few_tiles():
    g = torch.Generator().manual_seed(3)
    lengths = torch.clamp(torch.distributions.Pareto(1.0, 1.2).sample((12,)).long(), max=150)
    lengths[0] = 150
    lengths = _fit(lengths.tolist(), "all")
    (q, k, v), offsets, num_targets = _case(
        lengths, heads=1, d_qk=16, d_v=16, targets=True, prefix=MASKS["all"]["contextual_len"]
    )
    options = _options("all", num_targets, _bias(lengths, "both", reach=64))
    got = jagged_attention(q, k, v, offsets, 150, backend="triton", **options)
    want = jagged_attention_reference(q, k, v, offsets, 150, **options)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    del g


def test_bad_inputs_are_named():
    (q, k, v), offsets, _ = _case([3, 4])
    with pytest.raises(ValueError, match="sequence 1 has 4 rows; max_seq_len is 3"):
        jagged_attention(q, k, v, offsets, 3)
    with pytest.raises(ValueError, match=r"num_targets\[0\] = 5; sequence 0 has 3 rows"):
        jagged_attention(q, k, v, offsets, 4, num_targets=torch.tensor([5, 0]))
    with pytest.raises(ValueError, match="expected q and k"):
        jagged_attention(q, k[:, :1], v, offsets, 4)
    with pytest.raises(ValueError, match="offsets"):
        jagged_attention(q, k, v, offsets.float(), 4)
    with pytest.raises(ValueError, match=r"position_weights \(4,\): expected \[2P - 1\]"):
        jagged_attention(q, k, v, offsets, 4, position_weights=torch.zeros(4))
    with pytest.raises(ValueError, match=r"timestamps None: the time bias needs one per row"):
        jagged_attention(q, k, v, offsets, 4, time_weights=torch.zeros(5))
    with pytest.raises(ValueError, match="time_bucket_div=0.0"):
        jagged_attention(
            q,
            k,
            v,
            offsets,
            4,
            timestamps=torch.zeros(7),
            time_weights=torch.zeros(5),
            time_bucket_div=0.0,
        )
