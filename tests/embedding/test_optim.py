"""Fused optimizers: EmbeddingBagCollection(optimizer=...) against a float64 reference that
computes dense gradients with autograd and applies the update to the touched rows."""

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from recsys import EmbeddingBagCollection
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.ops.embedding_bag.pooled import embedding_bag_reference, stochastic_round

BACKENDS = ["torch", "triton"]
OPTIMIZERS = [
    SGD(lr=0.1),
    SGD(lr=0.05, weight_decay=0.01),
    Adagrad(lr=0.1),
    Adagrad(lr=0.1, eps=1e-6, initial_accumulator_value=0.1, weight_decay=0.01),
    RowWiseAdagrad(lr=0.1),
    RowWiseAdagrad(lr=0.1, weight_decay=0.01),
    Adam(lr=0.01),
    Adam(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01),
]

# Awkward shapes: dims 1, 3, 100 and 129, a one-row table, one table shared by two features,
# mean and sum pooling; rows few enough that every batch repeats ids many times.
TABLES = [
    ("t_small", 5, 3, ["f_a", "f_b"], PoolingType.SUM),
    ("t_one_row", 1, 129, ["f_c"], PoolingType.MEAN),
    ("t_wide", 7, 100, ["f_d"], PoolingType.SUM),
    ("t_scalar", 4, 1, ["f_e"], PoolingType.MEAN),
]


# FBGEMM's fused CPU backward serves one dim and one pooling (a shared table is fine).
FBGEMM_TABLES = [
    ("t_shared", 6, 8, ["f_a", "f_b"], PoolingType.SUM),
    ("t_one_row", 1, 8, ["f_c"], PoolingType.SUM),
    ("t_big", 40, 8, ["f_d", "f_e"], PoolingType.SUM),
]


def table_configs(dtype_name="FP32", tables=TABLES):
    from torchrec.modules.embedding_configs import DataType

    return [
        EmbeddingBagConfig(
            name=name,
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=list(features),
            pooling=pooling,
            data_type=getattr(DataType, dtype_name),
        )
        for name, rows, dim, features, pooling in tables
    ]


def make_batch(generator, batch_size=6, max_bag=6, weighted=False, tables=TABLES):
    keys = ["f_e", "f_a", "f_c", "f_b", "f_d", "unused"]  # not in table order
    rows = {f: r for _, r, _, fs, _ in tables for f in fs} | {"unused": 3}
    lengths = torch.randint(0, max_bag + 1, (len(keys), batch_size), generator=generator)
    values = torch.cat(
        [
            torch.randint(0, rows[k], (int(lengths[i].sum()),), generator=generator)
            for i, k in enumerate(keys)
        ]
    )
    weights = torch.rand(values.numel(), generator=generator) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.flatten(), weights=weights)


class Reference:
    """Float64 tables and state, updated by the optimizer's reference math on touched rows."""

    def __init__(self, ebc: EmbeddingBagCollection, optimizer) -> None:
        self.optimizer = optimizer
        self.weighted = ebc.is_weighted()
        self.configs = ebc.embedding_bag_configs()
        state = ebc.state_dict()
        self.weights = [state[f"embedding_bags.{c.name}.weight"].double() for c in self.configs]
        self.states = [
            {name: state[f"embedding_bags.{c.name}.{name}"].double() for name in optimizer.states}
            for c in self.configs
        ]
        self.step = 0

    def train_step(self, kjt: KeyedJaggedTensor, upstream: torch.Tensor) -> None:
        feature_to_table = [t for t, c in enumerate(self.configs) for _ in c.feature_names]
        features = [f for c in self.configs for f in c.feature_names]
        keys = kjt.keys()
        weights = [w.clone().requires_grad_(True) for w in self.weights]
        out = embedding_bag_reference(
            weights,
            kjt.values(),
            kjt.offsets(),
            [keys.index(f) for f in features],
            feature_to_table,
            ["mean" if c.pooling == PoolingType.MEAN else "sum" for c in self.configs],
            kjt.stride(),
            kjt.weights().double() if self.weighted else None,
        )
        grads = torch.autograd.grad(out, weights, upstream.double())
        self.step += 1
        per_key = kjt.to_dict()
        for t, config in enumerate(self.configs):
            touched = torch.cat([per_key[f].values() for f in config.feature_names]).unique()
            if touched.numel() == 0:
                continue
            state = {name: s[touched] for name, s in self.states[t].items()}
            new = self.optimizer.update(
                self.weights[t][touched], grads[t][touched], state, self.step
            )
            self.weights[t][touched] = new
            for name, rows in state.items():
                self.states[t][name][touched] = rows


def train(ebc, batches, upstreams):
    for kjt, upstream in zip(batches, upstreams, strict=True):
        ebc(kjt).values().backward(upstream)


def batches_and_upstreams(seed, steps=3, weighted=False, tables=TABLES, max_bag=6):
    generator = torch.Generator().manual_seed(seed)
    batches = [
        make_batch(generator, max_bag=max_bag, weighted=weighted, tables=tables)
        for _ in range(steps)
    ]
    total_dim = sum(dim * len(features) for _, _, dim, features, _ in tables)
    upstreams = [torch.randn(6, total_dim, generator=generator) for _ in range(steps)]
    return batches, upstreams


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=repr)
def test_fused_update_matches_float64_reference(optimizer, backend):
    check_against_reference(optimizer, backend, TABLES)


@pytest.mark.parametrize(
    "optimizer", [SGD(lr=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.01)], ids=repr
)
def test_torch_path_in_chunks_of_three_rows_matches_reference(optimizer, monkeypatch):
    # CHUNK_BYTES of 3 rows of the widest dim: every group is reduced and updated in pieces.
    monkeypatch.setattr("recsys.ops.embedding_bag.cpu.CHUNK_BYTES", 3 * 129 * 4)
    check_against_reference(optimizer, "torch", TABLES)


@pytest.mark.parametrize("backend", ["fbgemm", "auto"])
@pytest.mark.parametrize(
    "optimizer",
    [
        SGD(lr=0.1),
        Adagrad(lr=0.1, eps=1e-6),
        RowWiseAdagrad(lr=0.1),
    ],
    ids=repr,
)
@pytest.mark.parametrize("forward", ["fbgemm", "aten"])  # small batches: FBGEMM's; large: ATen's
def test_fbgemm_fused_backward_matches_float64_reference(optimizer, backend, forward, monkeypatch):
    if forward == "aten":
        monkeypatch.setattr("recsys.ops.embedding_bag.pooled.FBGEMM_FORWARD_MAX_IDS", 0)
    ebc = check_against_reference(optimizer, backend, FBGEMM_TABLES, max_bag=12)
    assert ebc._last_backend == "fbgemm"


def test_fbgemm_backend_refuses_what_it_cannot_do():
    ebc = EmbeddingBagCollection(table_configs(), optimizer=SGD(lr=0.1), backend="fbgemm")
    batches, _ = batches_and_upstreams(seed=0, steps=1)
    with pytest.raises(ValueError, match="fbgemm.*different dims"):
        ebc(batches[0])
    ebc = EmbeddingBagCollection(
        table_configs(tables=FBGEMM_TABLES), optimizer=Adam(lr=0.1), backend="fbgemm"
    )
    with pytest.raises(ValueError, match="no CPU kernel for Adam"):
        ebc(batches[0])
    # What it cannot do, "auto" hands to the torch path.
    ebc = EmbeddingBagCollection(
        table_configs(tables=FBGEMM_TABLES), optimizer=SGD(lr=0.1, weight_decay=0.1)
    )
    ebc(batches[0])
    assert ebc._last_backend == "torch"


def check_against_reference(optimizer, backend, tables, max_bag=6):
    ebc = EmbeddingBagCollection(
        table_configs(tables=tables), is_weighted=True, optimizer=optimizer, backend=backend
    )
    reference = Reference(ebc, optimizer)
    batches, upstreams = batches_and_upstreams(
        seed=1, weighted=True, tables=tables, max_bag=max_bag
    )
    train(ebc, batches, upstreams)
    for kjt, upstream in zip(batches, upstreams, strict=True):
        reference.train_step(kjt, upstream)
    state = ebc.state_dict()
    assert int(state["optimizer_step"]) == 3
    for t, config in enumerate(reference.configs):
        torch.testing.assert_close(
            state[f"embedding_bags.{config.name}.weight"].double(),
            reference.weights[t],
            rtol=1e-5,
            atol=1e-6,
        )
        for name in optimizer.states:
            torch.testing.assert_close(
                state[f"embedding_bags.{config.name}.{name}"].double(),
                reference.states[t][name],
                rtol=1e-5,
                atol=1e-7,
            )
    return ebc


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_builds_no_table_gradient_and_leaves_untouched_rows(backend):
    ebc = EmbeddingBagCollection(table_configs(), optimizer=Adam(lr=0.1), backend=backend)
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    kjt = KeyedJaggedTensor(
        keys=["f_a", "f_b", "f_c", "f_d", "f_e"],
        values=torch.tensor([2, 2, 0]),  # f_a: row 2 twice; f_d: row 0 once
        lengths=torch.tensor([2, 0, 0, 1, 0]),
    )
    ebc(kjt).values().sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in ebc.parameters())
    after = ebc.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {
        "optimizer_step",
        *(
            f"embedding_bags.{table}.{name}"
            for table in ("t_small", "t_wide")
            for name in ("weight", "exp_avg", "exp_avg_sq")
        ),
    }
    small = after["embedding_bags.t_small.weight"] != before["embedding_bags.t_small.weight"]
    assert small.any(dim=1).tolist() == [False, False, True, False, False]


@pytest.mark.parametrize(
    ("backend", "dtype_name", "tables"),
    [
        *((b, d, TABLES) for b in BACKENDS for d in ("FP32", "BF16")),
        ("fbgemm", "FP32", FBGEMM_TABLES),
    ],
    ids=["torch-fp32", "torch-bf16", "triton-fp32", "triton-bf16", "fbgemm-fp32"],
)
def test_two_runs_bitwise_equal(backend, dtype_name, tables):
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(
            table_configs(dtype_name, tables),
            is_weighted=True,
            optimizer=RowWiseAdagrad(lr=0.1),
            backend=backend,
        )
        batches, upstreams = batches_and_upstreams(seed=2, weighted=True, tables=tables)
        train(ebc, batches, upstreams)
        states.append(ebc.state_dict())
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_round_trip_continues_identically(backend):
    torch.manual_seed(0)
    batches, upstreams = batches_and_upstreams(seed=3, steps=4)
    first = EmbeddingBagCollection(table_configs(), optimizer=Adam(lr=0.05), backend=backend)
    train(first, batches[:2], upstreams[:2])
    second = EmbeddingBagCollection(table_configs(), optimizer=Adam(lr=0.05), backend=backend)
    second.load_state_dict(first.state_dict())
    train(first, batches[2:], upstreams[2:])
    train(second, batches[2:], upstreams[2:])
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key


def test_learning_rate_can_change_between_steps():
    ebc = EmbeddingBagCollection(table_configs(), optimizer=SGD(lr=0.1))
    batches, upstreams = batches_and_upstreams(seed=4, steps=1)
    before = ebc.embedding_bags["t_wide"].weight.clone()
    ebc.optimizer.lr = 0.0
    train(ebc, batches, upstreams)
    assert torch.equal(ebc.embedding_bags["t_wide"].weight, before)


def test_stochastic_rounding_is_unbiased():
    generator = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16
    rounded = stochastic_round(x, torch.bfloat16, generator).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean().item() - x[0].item()) < 2e-5
    assert torch.equal(stochastic_round(x, torch.float32), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stochastic", [True, False])
def test_low_precision_tables_keep_small_updates(backend, stochastic):
    # Updates of a sixteenth of a bf16 ulp: round-to-nearest never moves the weight,
    # stochastic rounding moves it by the right amount on average.
    config = EmbeddingBagConfig(
        name="t",
        num_embeddings=1,
        embedding_dim=512,
        feature_names=["f"],
        data_type=table_configs("BF16")[0].data_type,
    )
    optimizer = SGD(lr=2**-11, stochastic_rounding=stochastic)
    ebc = EmbeddingBagCollection([config], optimizer=optimizer, backend=backend)
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.fill_(1.0)
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([0]), lengths=torch.tensor([1]))
    for _ in range(32):
        ebc(kjt).values().sum().backward()  # gradient 1 per element: -2^-11 per step
    mean = ebc.embedding_bags["t"].weight.float().mean().item()
    expected = 1.0 - 32 * 2**-11 if stochastic else 1.0
    assert abs(mean - expected) < 2e-3


def test_bad_optimizer_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="lr=-1"):
        SGD(lr=-1)
    with pytest.raises(ValueError, match="betas"):
        Adam(lr=0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps=0"):
        RowWiseAdagrad(lr=0.1, eps=0)
    with pytest.raises(ValueError, match="fused optimizer from recsys.embedding.optim"):
        EmbeddingBagCollection(table_configs(), optimizer=torch.optim.SGD)
