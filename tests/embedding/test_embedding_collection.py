"""recsys.EmbeddingCollection (unpooled) against torchrec.EmbeddingCollection with the same
weights, and its fused optimizers against a float64 reference of the update."""

import pytest
import torch
import torchrec
from torch import nn
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

from recsys import EmbeddingBagCollection, EmbeddingCollection
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.ops.input_checks import INPUT_ERRORS
from recsys.train.step_audit import StepAudit

BACKENDS = ["torch", "triton", "auto"]  # auto on CPU: FBGEMM's fused backward where it can


def tables(dims=(4, 4, 4)):
    """Three tables: "user" read by two features, "item" shares feature "item_id" with
    "related" (output names item_id@item, item_id@related), a one-row table."""
    return [
        EmbeddingConfig(
            name="user", embedding_dim=dims[0], num_embeddings=20, feature_names=["user", "friend"]
        ),
        EmbeddingConfig(
            name="item", embedding_dim=dims[1], num_embeddings=13, feature_names=["item_id"]
        ),
        EmbeddingConfig(
            name="related",
            embedding_dim=dims[2],
            num_embeddings=13,
            feature_names=["item_id", "one"],
        ),
        EmbeddingConfig(name="single", embedding_dim=dims[0], num_embeddings=1),
    ]


SIZES = {"user": 20, "friend": 20, "item_id": 13, "one": 13, "single": 1, "unused": 5}


def random_kjt(keys=("user", "friend", "item_id", "one", "single"), batch_size=5):
    """Every key has empty bags; ids repeat within and across bags (duplicates)."""
    lengths = {k: torch.randint(0, 5, (batch_size,)) for k in keys}
    for k in keys:
        lengths[k][::2] = 0
    values = torch.cat([torch.randint(0, min(SIZES[k], 6), (int(lengths[k].sum()),)) for k in keys])
    return KeyedJaggedTensor(
        keys=list(keys), values=values, lengths=torch.cat([lengths[k] for k in keys])
    )


def assert_same(ours, theirs):
    assert list(ours) == list(theirs)
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert a.values().shape == b.values().shape, name
        torch.testing.assert_close(a.values(), b.values(), rtol=0, atol=0)
        assert torch.equal(a.lengths(), b.lengths()) and torch.equal(a.offsets(), b.offsets())
        wa, wb = a.weights_or_none(), b.weights_or_none()
        assert (wa is None) == (wb is None) and (wa is None or torch.equal(wa, wb))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("need_indices", [False, True])
def test_matches_torchrec(backend, need_indices):
    ours = EmbeddingCollection(tables(), need_indices=need_indices, backend=backend)
    theirs = torchrec.EmbeddingCollection(tables(), need_indices=need_indices)
    theirs.load_state_dict(ours.state_dict())
    kjt = random_kjt()
    assert_same(ours(kjt), theirs(kjt))
    # keys in another order, an extra key nobody reads
    kjt = random_kjt(keys=("single", "unused", "one", "item_id", "friend", "user"))
    assert_same(ours(kjt), theirs(kjt))


def test_tables_of_different_dims():
    """Each feature's rows have its table's dim; torchrec's collection takes one dim, so each
    table is compared with a torchrec collection of its own."""
    configs = tables(dims=(4, 8, 3))
    ours = EmbeddingCollection(configs, backend="torch")
    kjt = random_kjt()
    out = ours(kjt)
    state = ours.state_dict()
    for config in configs:
        theirs = torchrec.EmbeddingCollection([config])
        theirs.load_state_dict(
            {f"embeddings.{config.name}.weight": state[f"embeddings.{config.name}.weight"]}
        )
        for name, jt in theirs(kjt).items():
            key = name if name in out else f"{name}@{config.name}"
            torch.testing.assert_close(out[key].values(), jt.values(), rtol=0, atol=0)
            assert out[key].values().shape[1] == config.embedding_dim
    with pytest.raises(ValueError, match=r"dims \[3, 4, 8\]"):
        ours.embedding_dim()


@pytest.mark.parametrize("dims", [(4, 4, 4), (4, 8, 3)])
def test_dense_gradients_match_torchrec(dims):
    """optimizer=None: ordinary autograd gradients, as torchrec's nn.Embedding gives (tables in
    one dim group join into one view and split back; tables of their own dim pass as they are)."""
    configs = tables(dims)
    ours = EmbeddingCollection(configs, backend="torch")
    kjt = random_kjt()
    out = ours(kjt)
    upstream = {name: torch.randn_like(jt.values()) for name, jt in out.items()}
    sum((out[n].values() * g).sum() for n, g in upstream.items()).backward()
    for config in configs:
        theirs = torchrec.EmbeddingCollection([config])
        weight = ours.embeddings[config.name].weight
        theirs.embeddings[config.name].weight.data.copy_(weight.detach())
        got = theirs(kjt)
        loss = sum(
            (jt.values() * upstream[n if n in upstream else f"{n}@{config.name}"]).sum()
            for n, jt in got.items()
        )
        loss.backward()
        torch.testing.assert_close(weight.grad, theirs.embeddings[config.name].weight.grad)
    assert ours.trainable_parameters() == list(ours.parameters())


def test_state_dict_round_trip_both_ways():
    ours = EmbeddingCollection(tables())
    theirs = torchrec.EmbeddingCollection(tables())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert list(ours.state_dict()) == [f"embeddings.{c.name}.weight" for c in tables()]
    theirs.load_state_dict(ours.state_dict())
    other = EmbeddingCollection(tables())
    other.load_state_dict(theirs.state_dict())
    for key, value in ours.state_dict().items():
        assert torch.equal(other.state_dict()[key], value)
    assert other._views_intact()  # loaded into the packed buffer, not beside it


def reference_update(name, opt, weight, state, grad, step):
    """One fused-optimizer step of the rows in ``grad`` (float64), written out."""
    if name == "sgd":
        return weight - opt.lr * grad
    if name == "adagrad":
        state["sum"] += grad * grad
        return weight - opt.lr * grad / (state["sum"].sqrt() + opt.eps)
    if name == "rowwise_adagrad":
        state["sum"] += (grad * grad).mean(dim=1)
        return weight - opt.lr * grad / (state["sum"].sqrt() + opt.eps).unsqueeze(1)
    b1, b2 = opt.betas
    state["exp_avg"].mul_(b1).add_((1 - b1) * grad)
    state["exp_avg_sq"].mul_(b2).add_((1 - b2) * grad * grad)
    m_hat = state["exp_avg"] / (1 - b1**step)
    v_hat = state["exp_avg_sq"] / (1 - b2**step)
    return weight - opt.lr * m_hat / (v_hat.sqrt() + opt.eps)


OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.3),
    "adagrad": lambda: Adagrad(lr=0.2),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.2),
    "adam": lambda: Adam(lr=0.05),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dims", [(4, 4, 4), (4, 8, 3)])
def test_fused_update_matches_float64_reference(backend, name, dims):
    """Two steps: each touched row gets one update with its duplicates summed; untouched rows
    and their state stay; the step counter and state are in the state dict."""
    configs = tables(dims)
    ours = EmbeddingCollection(configs, backend=backend, optimizer=OPTIMIZERS[name]())
    opt = ours.optimizer
    weights = {c.name: ours.embeddings[c.name].weight.detach().double().clone() for c in configs}
    states = {
        c.name: {
            s: torch.zeros(
                c.num_embeddings, *(() if kind == "row" else (c.embedding_dim,))
            ).double()
            for s, kind in opt.states.items()
        }
        for c in configs
    }
    for step in (1, 2):
        kjt = random_kjt()
        out = ours(kjt)
        upstream = {n: torch.randn_like(jt.values()) for n, jt in out.items()}
        sum((out[n].values() * g).sum() for n, g in upstream.items()).backward()
        # float64 reference: autograd's dense gradient sums the duplicates
        leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
        touched = {n: torch.zeros(w.shape[0], dtype=torch.bool) for n, w in weights.items()}
        loss = 0
        for config, names in zip(configs, ours.embedding_names_by_table(), strict=True):
            for feature, out_name in zip(config.feature_names, names, strict=True):
                ids = kjt[feature].values()
                touched[config.name][ids] = True
                loss = loss + (leaves[config.name][ids] * upstream[out_name].double()).sum()
        loss.backward()
        for n, w in weights.items():
            rows = touched[n]
            state_rows = {s: v[rows] for s, v in states[n].items()}
            w[rows] = reference_update(name, opt, w[rows], state_rows, leaves[n].grad[rows], step)
            for s, v in state_rows.items():
                states[n][s][rows] = v
    assert int(ours.state_dict()["optimizer_step"]) == 2
    for config in configs:
        got = ours.embeddings[config.name].weight
        torch.testing.assert_close(got.double(), weights[config.name], rtol=1e-5, atol=1e-6)
        for s in opt.states:
            saved = ours.state_dict()[f"embeddings.{config.name}.{s}"]
            torch.testing.assert_close(saved.double(), states[config.name][s], rtol=1e-5, atol=1e-6)


def test_same_update_as_the_bag_collection_with_one_id_bags():
    """The unpooled lookup is the bag collection's lookup with one id per bag: the same
    kernels give bitwise the same rows and the same fused update."""
    config = dict(name="movies", embedding_dim=6, num_embeddings=30, feature_names=["history"])
    ec = EmbeddingCollection([EmbeddingConfig(**config)], optimizer=Adam(lr=0.1))
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(**config)], optimizer=Adam(lr=0.1))
    ebc.embedding_bags.movies.weight.data.copy_(ec.embeddings.movies.weight)
    ids = torch.randint(0, 8, (40,))
    lengths = torch.tensor([15, 0, 25])
    rows = ec(KeyedJaggedTensor(keys=["history"], values=ids, lengths=lengths))["history"]
    one_id_bags = KeyedJaggedTensor(keys=["history"], values=ids, lengths=torch.ones(40).long())
    pooled = ebc(one_id_bags).values()
    assert torch.equal(rows.values(), pooled)
    upstream = torch.randn(40, 6)
    (rows.values() * upstream).sum().backward()
    (pooled * upstream).sum().backward()
    assert torch.equal(ec.embeddings.movies.weight, ebc.embedding_bags.movies.weight)
    assert torch.equal(ec.embeddings.movies.exp_avg_sq, ebc.embedding_bags.movies.exp_avg_sq)


def test_no_ids_at_all():
    ours = EmbeddingCollection(tables(), optimizer=SGD(lr=0.1))
    kjt = KeyedJaggedTensor(
        keys=["user", "friend", "item_id", "one", "single"],
        values=torch.zeros(0, dtype=torch.long),
        lengths=torch.zeros(10, dtype=torch.long),
    )
    out = ours(kjt)
    assert out["user"].values().shape == (0, 4) and out["user"].lengths().tolist() == [0, 0]
    before = ours.state_dict()["embeddings.user.weight"].clone()
    sum(jt.values().sum() for jt in out.values()).backward()
    assert torch.equal(ours.embeddings.user.weight, before)


def test_bad_input_errors():
    ours = EmbeddingCollection(tables())
    kjt = KeyedJaggedTensor(
        keys=["user", "friend", "item_id", "one", "single"],
        values=torch.tensor([1, 2, 13, 4, 0]),
        lengths=torch.tensor([1, 1, 1, 1, 1]),
        stride=1,
    )
    with pytest.raises(ValueError, match=r"item_id@item: id 13 is out of range .* 13 rows"):
        ours(kjt)
    kjt = KeyedJaggedTensor(
        keys=["user", "friend", "item_id", "one", "single"],
        values=torch.tensor([1, 2, 3, 4, 0]),
        offsets=torch.tensor([0, 2, 1, 3, 4, 5]),
    )
    with pytest.raises(ValueError, match="non-decreasing"):
        ours(kjt)
    kjt = KeyedJaggedTensor(keys=["usr"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"missing features .*'user'"):
        ours(kjt)
    pooled = EmbeddingBagConfig(name="bag", embedding_dim=4, num_embeddings=5, feature_names=["x"])
    with pytest.raises(ValueError, match="'bag' is an EmbeddingBagConfig"):
        EmbeddingCollection([pooled])
    items = EmbeddingConfig(name="items", embedding_dim=4, num_embeddings=5)
    with pytest.raises(ValueError, match=r"table names \['items'\] are names of nn.ModuleDict"):
        EmbeddingCollection([items])
    with pytest.raises(ValueError, match="duplicate table names"):
        EmbeddingCollection([tables()[0], tables()[0]])
    with pytest.raises(ValueError, match="share one data_type"):
        EmbeddingCollection(
            [
                tables()[0],
                EmbeddingConfig(
                    name="h", embedding_dim=4, num_embeddings=3, data_type=DataType.FP16
                ),
            ]
        )


def test_async_checks_withhold_the_update_and_raise_later():
    INPUT_ERRORS.raise_first()  # nothing left by an earlier test
    ours = EmbeddingCollection(tables(), validate="async", optimizer=SGD(lr=1.0))
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    kjt = KeyedJaggedTensor(
        keys=["user", "friend", "item_id", "one", "single"],
        values=torch.tensor([1, 25, 3, 4, 0]),
        lengths=torch.tensor([1, 1, 1, 1, 1]),
    )
    out = ours(kjt)
    sum(jt.values().sum() for jt in out.values()).backward()
    for key, value in before.items():
        if key != "optimizer_step":
            assert torch.equal(ours.state_dict()[key], value), key
    with pytest.raises(ValueError, match="friend: id 25 is out of range"):
        INPUT_ERRORS.raise_first()


def test_meta_device_gives_shapes():
    ours = EmbeddingCollection(tables(dims=(4, 8, 3)), device="meta")
    out = ours(random_kjt())
    assert out["item_id@related"].values().device.type == "meta"
    assert out["item_id@related"].values().shape[1] == 3


def test_fp16_tables_return_fp32_rows():
    configs = [
        EmbeddingConfig(name="t", embedding_dim=5, num_embeddings=9, data_type=DataType.BF16)
    ]
    ours = EmbeddingCollection(configs)
    kjt = KeyedJaggedTensor(keys=["t"], values=torch.tensor([1, 8, 1]), lengths=torch.tensor([3]))
    rows = ours(kjt)["t"].values()
    assert rows.dtype == torch.float32
    assert torch.equal(rows, ours.embeddings.t.weight[[1, 8, 1]].float())


class _History(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables(dims=(4, 8, 3)))

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        keys = ["user", "friend", "item_id", "one", "single"]
        out = self.ec(KeyedJaggedTensor(keys=keys, values=values, lengths=lengths))
        return [jt.values() for jt in out.values()]


def test_torch_export_runs_the_tables_parameters():
    model = _History()
    kjt = random_kjt()
    exported = torch.export.export(model, (kjt.values(), kjt.lengths()), strict=False)
    names = [n for n, _ in exported.named_parameters()]
    assert names == [f"ec.embeddings.{c.name}.weight" for c in tables()]
    for a, b in zip(
        exported.module()(kjt.values(), kjt.lengths()),
        model(kjt.values(), kjt.lengths()),
        strict=True,
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dims", [(4, 4, 4), (4, 8, 3)])
def test_a_step_never_waits_on_the_host(dims):
    """With the KJT's sizes on the host (as recsys' loaders hand them) and "async" id checks,
    the Triton path's forward and fused backward read nothing back from the device."""
    ours = EmbeddingCollection(tables(dims), optimizer=Adagrad(lr=0.1), validate="async")
    ours.backend = "triton"
    kjt = random_kjt()
    kjt.length_per_key(), kjt.offset_per_key()
    sum(jt.values().sum() for jt in ours(kjt).values()).backward()  # the step counter read once
    with StepAudit("cpu") as report:
        sum(jt.values().sum() for jt in ours(kjt).values()).backward()
    assert report.num_syncs == 0, report.describe()
    INPUT_ERRORS.raise_first()
