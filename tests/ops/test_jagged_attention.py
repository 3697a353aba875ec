"""HSTU jagged attention: the torch path and the Triton kernels (interpreted) against the
float64 reference, forward and backward, for every mask option."""

from __future__ import annotations

import pytest
import torch

from recsys.ops.jagged_attention import jagged_attention, jagged_attention_reference

MASKS = {
    "causal": {},
    "targets": {"targets": True},
    "context": {"contextual_len": 3},
    "window": {"max_attn_len": 5},
    "all": {"targets": True, "contextual_len": 2, "max_attn_len": 7},
}


def _case(lengths, heads=2, d_qk=8, d_v=12, seed=0, dtype=torch.float32, targets=False):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, d_qk, generator=g) for _ in range(2))
    v = torch.randn(total, heads, d_v, generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    num_targets = None
    if targets:
        num_targets = torch.tensor([min(n, (3 * i) % 4) for i, n in enumerate(lengths)])
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], offsets, num_targets


def _options(mask: str, num_targets):
    options = dict(MASKS[mask])
    options.pop("targets", None)
    return options | {"num_targets": num_targets, "alpha": 0.7}


def _grads(out, inputs, upstream):
    return torch.autograd.grad((out.float() * upstream).sum(), inputs)


@pytest.mark.parametrize("mask", list(MASKS))
def test_the_padded_torch_path_is_the_reference(mask):
    lengths = [0, 1, 5, 9, 4]
    (q, k, v), offsets, num_targets = _case(
        lengths, dtype=torch.float64, targets="targets" in MASKS[mask]
    )
    options = _options(mask, num_targets)
    want = jagged_attention_reference(q, k, v, offsets, 10, **options)
    got = jagged_attention(q, k, v, offsets, 10, backend="torch", **options)
    assert torch.allclose(got, want, atol=1e-12)
    upstream = torch.randn_like(want)
    for a, b in zip(
        _grads(got, [q, k, v], upstream), _grads(want, [q, k, v], upstream), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-12)


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


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_reference(mask, dtype):
    lengths = [0, 1, 31, 32, 33, 7]  # empty, one row, a tile - 1, a tile, a tile + 1
    (q, k, v), offsets, num_targets = _case(lengths, dtype=dtype, targets="targets" in MASKS[mask])
    options = _options(mask, num_targets)
    got = jagged_attention(q, k, v, offsets, 40, backend="triton", **options)
    assert got.dtype == dtype
    want = jagged_attention_reference(q, k, v, offsets, 40, **options)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = want.abs().max()
    assert (got.double() - want).abs().max() <= tol * scale
    upstream = torch.randn(want.shape, dtype=torch.float64)
    reference_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want_out = jagged_attention_reference(*reference_inputs, offsets, 40, **options)
    wants = _grads(want_out, reference_inputs, upstream)
    gots = _grads(got, [q, k, v], upstream.to(dtype))
    for name, a, b in zip("qkv", gots, wants, strict=True):
        assert (a.double() - b).abs().max() <= 4 * tol * b.abs().max(), name


def test_zipf_lengths_up_to_a_few_tiles():
    g = torch.Generator().manual_seed(3)
    lengths = torch.clamp(torch.distributions.Pareto(1.0, 1.2).sample((12,)).long(), max=150)
    lengths[0] = 150
    (q, k, v), offsets, num_targets = _case(
        lengths.tolist(), heads=1, d_qk=16, d_v=16, targets=True
    )
    options = _options("all", num_targets)
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
