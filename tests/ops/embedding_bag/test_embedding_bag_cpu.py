"""The torch backend's sizes known on the host: with the ids per KJT key (the KJT's
``length_per_key``) and each dim group's distinct rows, its forward and its unfused backward
read nothing from the device, and give bitwise what the reads gave."""

from __future__ import annotations

import pytest
import torch

from recsys.ops.embedding_bag import cpu as embedding_bag_cpu
from recsys.ops.embedding_bag.cpu import backward_torch, pool_packed, pool_torch
from recsys.ops.embedding_bag.layout import LookupPlan, TableLayout
from recsys.ops.embedding_bag.pooled import embedding_bag_reference
from recsys.train.step_audit import StepAudit  # tests may import the train layer
from tests.ops.embedding_bag.test_embedding_bag import as_float64, make_inputs


def _case(weighted: bool, mean: bool):
    torch.manual_seed(3)
    inputs = make_inputs(
        num_rows=(10, 6, 37, 9), dims=(4, 3, 33, 4), feature_to_table=(0, 1, 2, 0, 3, 2),
        batch_size=7, max_bag=5, weighted=weighted,
    )  # fmt: skip
    weights = inputs["weights"]
    layout = TableLayout.build([w.shape[0] for w in weights], [w.shape[1] for w in weights])
    poolings = ["mean" if mean and t % 2 else "sum" for t in range(len(weights))]
    plan = LookupPlan(layout, inputs["feature_to_table"], poolings)
    batch = inputs["batch_size"]
    lengths = inputs["offsets"].diff().view(-1, batch).sum(dim=1)
    return plan, layout.pack(weights), inputs, lengths.tolist()


def _distinct_rows(plan: LookupPlan, inputs, key_lengths) -> list[int]:
    """Per dim group, the distinct group-local rows its features' lookups touch."""
    bounds = [0, *torch.tensor(key_lengths).cumsum(0).tolist()]
    layout, out = plan.layout, []
    for tables, features in zip(layout.groups, plan.group_features, strict=True):
        start = layout.row_offsets[tables[0]]
        rows = set()
        for f in features:
            k, t = inputs["feature_to_key"][f], plan.feature_to_table[f]
            ids = inputs["values"][bounds[k] : bounds[k + 1]]
            rows |= set((ids + layout.row_offsets[t] - start).tolist())
        out.append(len(rows))
    return out


@pytest.mark.parametrize(("weighted", "mean"), [(False, False), (True, True)])
def test_known_sizes_read_nothing_and_change_no_bit(weighted, mean, monkeypatch):
    plan, flat, inputs, key_lengths = _case(weighted, mean)
    args = (
        inputs["values"],
        inputs["offsets"],
        inputs["per_sample_weights"],
        inputs["feature_to_key"],
        inputs["batch_size"],
    )
    tables = plan.layout.table_views(flat)
    pooled = pool_torch(plan, tables, *args)
    with StepAudit() as report:
        known = pool_torch(plan, tables, *args, key_lengths=key_lengths)
    assert report.syncs == [] and torch.equal(known, pooled)

    grad_out = torch.randn_like(pooled)
    tensors = plan.tensors(grad_out.device, inputs["feature_to_key"])
    values, offsets, psw, feature_to_key, batch = args
    backward_args = (plan, flat, grad_out, tensors, values, offsets, psw, batch, None, 1)
    monkeypatch.setattr(embedding_bag_cpu, "CHUNK_BYTES", 64)  # several chunks per group
    keys, reduced = backward_torch(*backward_args)
    group_lookups = [
        sum(key_lengths[feature_to_key[f]] for f in features) for features in plan.group_features
    ]
    distinct = _distinct_rows(plan, inputs, key_lengths)
    with StepAudit() as report:
        got_keys, got_reduced = backward_torch(
            *backward_args, group_lookups=group_lookups, distinct_rows=distinct
        )
    assert report.syncs == [], report.describe()
    assert torch.equal(got_keys, keys) and torch.equal(got_reduced, reduced)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("feature_order", ["identity", "reversed"])
def test_fbgemm_forward_is_bitwise_the_aten_forward(weighted, feature_order):
    """The torch backend pools with FBGEMM's CPU forward where it may
    (``fbgemm_forward_serves``): sum pooling of fp32 tables of one dim, bitwise ATen's."""
    torch.manual_seed(5)
    inputs = make_inputs(
        num_rows=(10, 6, 370, 9), dims=(16,) * 4, feature_to_table=(0, 1, 2, 0, 3, 2),
        batch_size=33, max_bag=7, weighted=weighted,
    )  # fmt: skip
    if feature_order == "identity":  # make_inputs has feature f read key K-1-f: undo it
        inputs["feature_to_key"] = list(range(len(inputs["feature_to_key"])))
        inputs["feature_to_table"] = inputs["feature_to_table"][::-1]
    weights = inputs["weights"]
    layout = TableLayout.build([w.shape[0] for w in weights], [w.shape[1] for w in weights])
    plan = LookupPlan(layout, inputs["feature_to_table"], ["sum"] * len(weights))
    flat = layout.pack(weights)
    assert embedding_bag_cpu.fbgemm_forward_serves(plan, flat, inputs["values"].numel())
    args = (
        inputs["values"],
        inputs["offsets"],
        inputs["per_sample_weights"],
        inputs["feature_to_key"],
        inputs["batch_size"],
    )
    aten = pool_torch(plan, plan.layout.table_views(flat), *args)
    fbgemm = embedding_bag_cpu.pool_fbgemm(plan, flat, embedding_bag_cpu.fbgemm_inputs(plan, *args))
    assert torch.equal(fbgemm, aten)
    # With the ids per key known (as recsys' batches carry them), no host read.
    key_lengths = inputs["offsets"][:: inputs["batch_size"]].diff().tolist()
    with StepAudit() as report:
        batch = embedding_bag_cpu.fbgemm_inputs(plan, *args, key_lengths)
    assert report.syncs == [], report.describe()
    assert torch.equal(embedding_bag_cpu.pool_fbgemm(plan, flat, batch), aten)


def test_fbgemm_forward_serves_only_what_it_matches_bitwise():
    layout = TableLayout.build([10, 20], [8, 8])
    flat = layout.pack([torch.randn(10, 8), torch.randn(20, 8)])
    serves = embedding_bag_cpu.fbgemm_forward_serves
    assert serves(LookupPlan(layout, [0, 1], ["sum", "sum"]), flat, 100)
    assert not serves(LookupPlan(layout, [0, 1], ["sum", "mean"]), flat, 100)
    assert not serves(LookupPlan(layout, [0, 1], ["sum", "sum"]), flat.half(), 100)
    limit = embedding_bag_cpu.FBGEMM_FORWARD_MAX_IDS
    assert not serves(LookupPlan(layout, [0, 1], ["sum", "sum"]), flat, limit)
    mixed = TableLayout.build([10, 20], [8, 4])
    flat = mixed.pack([torch.randn(10, 8), torch.randn(20, 4)])
    assert not serves(LookupPlan(mixed, [0, 1], ["sum", "sum"]), flat, 100)


@pytest.mark.parametrize(("weighted", "pooling"), [(False, "sum"), (False, "mean"), (True, "mean")])
def test_packed_pooling_matches_float64_reference_and_pool_torch_bitwise(weighted, pooling):
    torch.manual_seed(5)
    rows = (10, 1, 37)
    inputs = make_inputs(num_rows=rows, dims=(4, 4, 4), weighted=weighted, empty_key=1)
    # pool_packed pools the keys in their order: relabel each key as its own feature.
    num_keys = len(inputs["feature_to_key"])
    tables = [
        inputs["feature_to_table"][inputs["feature_to_key"].index(k)] for k in range(num_keys)
    ]
    by_key = dict(inputs, feature_to_key=list(range(num_keys)), feature_to_table=tables)
    layout = TableLayout.build(rows, (4, 4, 4))
    flat = layout.pack(inputs["weights"])
    values, offsets, psw = inputs["values"], inputs["offsets"], inputs["per_sample_weights"]
    key_rows = torch.tensor([layout.rows[t] for t in tables])
    key_base = torch.tensor([layout.row_offsets[t] for t in tables])

    def packed(ids):
        return pool_packed(
            flat.view(-1, 4), ids, offsets.diff(), offsets, psw, key_rows, key_base,
            pooling == "mean", inputs["batch_size"],
        )  # fmt: skip

    out = packed(values)
    expected = embedding_bag_reference(**as_float64(by_key), table_pooling=[pooling] * 3)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    plan = LookupPlan(layout, tables, [pooling] * 3)
    per_table = pool_torch(
        plan, layout.table_views(flat), values, offsets, psw, by_key["feature_to_key"], 5
    )
    assert torch.equal(out, per_table)
    # An id past its own table (though inside the packed matrix) or negative fails the call.
    assert offsets[-1] > offsets[-6]  # the last id is the last key's: table 0, rows 0..9
    for bad in (-1, rows[tables[-1]]):
        ids = values.clone()
        ids[-1] = bad
        with pytest.raises(RuntimeError, match="an id outside its feature's table"):
            packed(ids)
