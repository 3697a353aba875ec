"""update_rows: the in-place row update of a fused optimizer (the torch backend's, and the
replicated tables' of a sharded collection)."""

import pytest
import torch

from recsys.embedding import optim
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.ops.embedding_bag import layout as embedding_bag_layout
from recsys.ops.embedding_bag.layout import RowOptimizer, rounding_seed, stochastic_round
from recsys.ops.embedding_bag.row_update import update_rows

OPTIMIZERS = {
    "sgd": lambda rounding: SGD(lr=0.1, weight_decay=0.01, stochastic_rounding=rounding),
    "adagrad": lambda rounding: Adagrad(lr=0.1, stochastic_rounding=rounding),
    "rowwise_adagrad": lambda rounding: RowWiseAdagrad(lr=0.1, stochastic_rounding=rounding),
    "adam": lambda rounding: Adam(lr=0.05, weight_decay=0.01, stochastic_rounding=rounding),
}


def make_table(optimizer, num_rows=13, dim=5, dtype=torch.float32):
    """A [num_rows, dim] table and random positive state of ``optimizer`` (fp32)."""
    weight = torch.randn(num_rows, dim).to(dtype)
    states = {
        name: torch.rand(num_rows if kind == "row" else (num_rows, dim))
        for name, kind in optimizer.states.items()
    }
    return weight, states


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rounding", [True, False])
def test_bitwise_equal_to_gather_update_scatter(name, dtype, rounding):
    """The same bits as gathering the rows by indexing, updating them in fp32, rounding with a
    generator seeded by rounding_seed(step) and scattering them back."""
    optimizer = OPTIMIZERS[name](rounding)
    weight, states = make_table(optimizer, dtype=dtype)
    grad = torch.randn_like(weight, dtype=torch.float32)  # [N, D] full-table gradient
    rows = torch.tensor([0, 3, 4, 12])
    step = 7
    expected_weight, expected_states = weight.clone(), {k: v.clone() for k, v in states.items()}
    state = {key: buffer[rows] for key, buffer in expected_states.items()}
    new = optimizer.update(expected_weight[rows].float(), grad[rows], state, step)
    if rounding:
        generator = torch.Generator().manual_seed(rounding_seed(step))
        new = stochastic_round(new, dtype, generator)
    expected_weight.index_copy_(0, rows, new.to(dtype))
    for key, buffer in expected_states.items():
        buffer.index_copy_(0, rows, state[key])

    generator = torch.Generator().manual_seed(rounding_seed(step))
    update_rows(optimizer, weight, states, rows, grad[rows], step, generator)

    assert torch.equal(weight.view(torch.uint8), expected_weight.view(torch.uint8))
    for key in states:
        assert torch.equal(states[key], expected_states[key])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updates_only_the_given_rows_in_float64(name):
    """fp64 tables are updated in fp64 by the optimizer's reference math; other rows and
    their state are left alone."""
    optimizer = OPTIMIZERS[name](True)
    weight, states = make_table(optimizer, dtype=torch.float64)
    rows = torch.tensor([5, 1, 9])
    grad = torch.randn(3, weight.shape[1], dtype=torch.float64)
    before, states_before = weight.clone(), {k: v.clone() for k, v in states.items()}

    update_rows(optimizer, weight, states, rows, grad, 2, torch.Generator())

    state_rows = {k: v[rows].clone() for k, v in states_before.items()}
    expected = optimizer.update(before[rows], grad, state_rows, 2)
    torch.testing.assert_close(weight[rows], expected, rtol=0, atol=0)
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert not torch.equal(weight[rows], before[rows])
    assert torch.equal(weight[untouched], before[untouched])
    for key, state in states.items():
        torch.testing.assert_close(state[rows], state_rows[key], rtol=0, atol=0)
        assert torch.equal(state[untouched], states_before[key][untouched])


def test_works_on_a_parameter_outside_no_grad():
    """A table that requires grad (an nn.Parameter) is updated without autograd complaining."""
    optimizer = SGD(lr=1.0)
    weight = torch.nn.Parameter(torch.zeros(4, 2))
    update_rows(optimizer, weight, {}, torch.tensor([2]), torch.ones(1, 2), 1, None)
    assert torch.equal(weight.detach()[2], torch.full((2,), -1.0))
    assert torch.equal(weight.detach()[[0, 1, 3]], torch.zeros(3, 2))


def test_every_fused_optimizer_is_the_row_optimizer_ops_apply():
    """ops declares what it reads of an optimizer (it never imports recsys.embedding): each
    fused optimizer provides it, with the Triton code of its own update."""
    codes = {
        "sgd": "SGD_CODE",
        "adagrad": "ADAGRAD_CODE",
        "rowwise_adagrad": "ROWWISE_ADAGRAD_CODE",
    }
    codes["adam"] = "ADAM_CODE"
    for name, make in optim.OPTIMIZERS.items():
        optimizer = make(lr=0.1)
        assert isinstance(optimizer, RowOptimizer), name
        assert optimizer.code == getattr(embedding_bag_layout, codes[name]), name
        assert getattr(optim, codes[name]) == optimizer.code, name
