"""embedding_bag against its float64 reference: forward, gradients, awkward inputs, bad inputs.

Every test of the op runs both backends: ``torch`` and ``triton`` (under the interpreter on CPU).
"""

import pytest
import torch

from recsys.ops.embedding_bag.pooled import embedding_bag, embedding_bag_reference


def make_inputs(
    num_rows=(10, 1, 37),
    dims=(4, 3, 33),
    feature_to_table=(0, 1, 2, 0),
    batch_size=5,
    max_bag=4,
    dtype=torch.float32,
    index_dtype=torch.int64,
    weighted=False,
    empty_key=None,
):
    """KJT-layout inputs: one key per feature, keys in reverse feature order (so feature f
    reads key K-1-f), bags of 0..max_bag ids."""
    weights = [torch.randn(n, d, dtype=dtype) for n, d in zip(num_rows, dims, strict=True)]
    num_keys = len(feature_to_table)
    feature_to_key = [num_keys - 1 - f for f in range(num_keys)]
    lengths = torch.randint(0, max_bag + 1, (num_keys, batch_size))
    if empty_key is not None:
        lengths[empty_key] = 0
    values = []
    for k in range(num_keys):
        table = feature_to_table[feature_to_key.index(k)]
        values.append(torch.randint(0, num_rows[table], (int(lengths[k].sum()),)))
    values = torch.cat(values).to(index_dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.flatten().cumsum(0)])
    per_sample_weights = torch.rand(values.numel(), dtype=dtype) if weighted else None
    return dict(
        weights=weights,
        values=values,
        offsets=offsets.to(index_dtype),
        feature_to_key=feature_to_key,
        feature_to_table=list(feature_to_table),
        batch_size=batch_size,
        per_sample_weights=per_sample_weights,
    )


def as_float64(inputs):
    out = dict(inputs, weights=[w.double() for w in inputs["weights"]])
    if inputs["per_sample_weights"] is not None:
        out["per_sample_weights"] = inputs["per_sample_weights"].double()
    return out


def poolings(kind, num_tables=3):
    return [kind] * num_tables if kind != "mixed" else ["sum", "mean", "sum"][:num_tables]


BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooling", ["sum", "mean", "mixed"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_forward_matches_float64_reference(pooling, weighted, index_dtype, backend):
    inputs = make_inputs(weighted=weighted, index_dtype=index_dtype, empty_key=1)
    table_pooling = poolings(pooling)
    out = embedding_bag(**inputs, table_pooling=table_pooling, backend=backend)
    expected = embedding_bag_reference(**as_float64(inputs), table_pooling=table_pooling)
    assert out.shape == (5, 4 + 3 + 33 + 4) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_low_precision_tables_accumulate_in_float32(dtype, pooling, backend):
    # Long bags: pooling in bf16 itself would be off by far more than this tolerance.
    inputs = make_inputs(dtype=dtype, weighted=True, max_bag=300)
    out = embedding_bag(**inputs, table_pooling=poolings(pooling), backend=backend)
    expected = embedding_bag_reference(**as_float64(inputs), table_pooling=poolings(pooling))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_bags_and_empty_batch_give_zeros(backend):
    inputs = make_inputs(max_bag=0)
    for w in inputs["weights"]:
        w.requires_grad_(True)
    out = embedding_bag(**inputs, table_pooling=poolings("mean"), backend=backend)
    assert torch.count_nonzero(out) == 0
    grads = torch.autograd.grad(out, inputs["weights"], torch.ones_like(out))
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    inputs = make_inputs(batch_size=0)
    out = embedding_bag(**inputs, table_pooling=poolings("sum"), backend=backend)
    assert out.shape == (0, 44)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dim", [1, 3, 100, 129])
def test_awkward_dims_one_row_tables_batch_of_one(dim, backend):
    inputs = make_inputs(
        num_rows=(1, 7), dims=(dim, dim + 1), feature_to_table=(0, 1, 1), batch_size=1
    )
    for w in inputs["weights"]:
        w.requires_grad_(True)
    out = embedding_bag(**inputs, table_pooling=["sum", "mean"], backend=backend)
    expected = embedding_bag_reference(**as_float64(inputs), table_pooling=["sum", "mean"])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs["weights"], upstream)
    ref_weights = [w.detach().double().requires_grad_(True) for w in inputs["weights"]]
    ref = embedding_bag_reference(
        **dict(as_float64(inputs), weights=ref_weights), table_pooling=["sum", "mean"]
    )
    ref_grads = torch.autograd.grad(ref, ref_weights, upstream.double())
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [*BACKENDS, "torch_in_chunks"])
@pytest.mark.parametrize("pooling", ["sum", "mean", "mixed"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gradients_match_float64_reference(pooling, weighted, backend, monkeypatch):
    if backend == "torch_in_chunks":  # reduce 2 rows at a time
        monkeypatch.setattr("recsys.ops.embedding_bag.cpu.CHUNK_BYTES", 2 * 33 * 8)
        backend = "torch"
    # Heavy duplicates: 3 tables of 10, 1 and 37 rows, bags up to 12 ids.
    inputs = make_inputs(weighted=weighted, dtype=torch.float64, max_bag=12)
    table_pooling = poolings(pooling)
    for w in inputs["weights"]:
        w.requires_grad_(True)
    out = embedding_bag(**inputs, table_pooling=table_pooling, backend=backend)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs["weights"], upstream)
    ref_weights = [w.detach().clone().requires_grad_(True) for w in inputs["weights"]]
    expected = embedding_bag_reference(
        **dict(inputs, weights=ref_weights), table_pooling=table_pooling
    )
    ref_grads = torch.autograd.grad(expected, ref_weights, upstream)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_reference_gradcheck():
    inputs = make_inputs(num_rows=(6, 1, 4), dims=(3, 2, 5), batch_size=3, dtype=torch.float64)
    inputs["per_sample_weights"] = torch.rand(inputs["values"].numel(), dtype=torch.float64)

    def f(w0, w1, w2, psw):
        return embedding_bag_reference(
            **dict(inputs, weights=[w0, w1, w2], per_sample_weights=psw),
            table_pooling=["sum", "mean", "sum"],
        )

    args = [w.requires_grad_(True) for w in inputs["weights"]]
    args.append(inputs["per_sample_weights"].requires_grad_(True))
    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic(backend):
    inputs = make_inputs(weighted=True, max_bag=8)
    results = []
    for _ in range(2):
        weights = [w.clone().requires_grad_(True) for w in inputs["weights"]]
        out = embedding_bag(
            **dict(inputs, weights=weights), table_pooling=poolings("mean"), backend=backend
        )
        grads = torch.autograd.grad(out, weights, torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out, grads))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def bad(inputs, **changes):
    return dict(inputs, **changes)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda x: bad(x, values=x["values"].clone().fill_(37)), "id 37 is out of range.*37 rows"),
        (lambda x: bad(x, values=x["values"] - 40), "id -.* is out of range"),
        (lambda x: bad(x, values=x["values"].float()), "ids must be a 1-D int32/int64"),
        (lambda x: bad(x, offsets=x["offsets"].flip(0)), "offsets must start at 0"),
        (
            lambda x: bad(x, offsets=torch.cat([x["offsets"][:3], x["offsets"][3:] - 1])),
            "non-decreasing|offsets end at",
        ),
        (lambda x: bad(x, offsets=x["offsets"][:-1]), "offsets has 20 entries"),
        (
            lambda x: bad(x, per_sample_weights=torch.ones(x["values"].numel() + 1)),
            "one weight per id",
        ),
        (
            lambda x: bad(x, weights=[x["weights"][0].half(), *x["weights"][1:]]),
            "share one dtype",
        ),
    ],
)
def test_bad_input_is_a_clear_error(mutate, message):
    inputs = make_inputs(num_rows=(37, 37, 37), max_bag=3)
    inputs["values"][0] = 0  # so the bag stays in range before mutation
    with pytest.raises(ValueError, match=message):
        embedding_bag(**mutate(inputs), table_pooling=poolings("sum"))


def test_decreasing_offsets_named():
    inputs = make_inputs(max_bag=3)
    offsets = inputs["offsets"].clone()
    offsets[2] = offsets[3] + 1
    with pytest.raises(ValueError, match=r"non-decreasing.*offsets\[2\]"):
        embedding_bag(**dict(inputs, offsets=offsets), table_pooling=poolings("sum"))


def test_error_names_the_feature():
    inputs = make_inputs(num_rows=(3, 3, 3), max_bag=2)
    end_of_key0 = int(inputs["offsets"][inputs["batch_size"]])
    inputs["values"][:end_of_key0] += 3  # key 0 is read by the last feature, "user_id"
    inputs["values"][0] = 3
    with pytest.raises(ValueError, match="^user_id: id"):
        embedding_bag(
            **inputs, table_pooling=poolings("sum"), feature_names=["a", "b", "c", "user_id"]
        )


def test_backend_selection(monkeypatch):
    inputs = make_inputs()
    with pytest.raises(ValueError, match="backend='cuda'"):
        embedding_bag(**inputs, table_pooling=poolings("sum"), backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device or TRITON_INTERPRET=1"):
        embedding_bag(**inputs, table_pooling=poolings("sum"), backend="triton")
