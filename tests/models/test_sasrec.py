"""SASRec over an unpooled collection: causality, jagged batches, losses, and that it learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

import recsys
from recsys.data.sequence_batches import SequenceBatch
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import Adam
from recsys.embedding.unpooled_tables import DynamicEmbeddingCollection
from recsys.models.next_item import next_item_loss
from recsys.models.sasrec import CANDIDATES, HISTORY, SASRec
from tests.models.sequence_training import train_and_rank

FEATURES = [HISTORY, CANDIDATES]


def _model(
    num_items: int = 40,
    dim: int = 8,
    max_len: int = 12,
    seed: int = 0,
    layer_norm: str = "pre",
    positions: str = "from_start",
) -> SASRec:
    torch.manual_seed(seed)
    table = EmbeddingConfig(
        name="item",
        num_embeddings=num_items,
        embedding_dim=dim,
        feature_names=[HISTORY, CANDIDATES],
    )
    collection = EmbeddingCollection(tables=[table])
    return SASRec(
        collection,
        max_len=max_len,
        num_heads=2,
        dropout=0.1,
        layer_norm=layer_norm,
        positions=positions,
    )


def _kjt(histories: list[list[int]]) -> tuple[KeyedJaggedTensor, int]:
    lengths = [len(h) for h in histories]
    kjt = KeyedJaggedTensor(
        keys=["items"],
        values=torch.tensor([i for h in histories for i in h], dtype=torch.int64),
        lengths=torch.tensor(lengths),
        stride=len(histories),
    )
    return kjt, max(lengths)


def test_a_position_sees_only_the_past_and_batches_do_not_leak():
    model = _model().eval()
    with torch.no_grad():
        alone, _ = model(*_kjt([[5, 6, 7, 8]]))
        changed, _ = model(*_kjt([[5, 6, 7, 30]]))
        assert torch.allclose(alone[:3], changed[:3], atol=1e-6)  # positions 0..2 see no item 4
        assert not torch.allclose(alone[3], changed[3])
        batched, _ = model(*_kjt([[1, 2], [5, 6, 7, 8], [9], [3, 4, 5, 6, 7, 8, 9]]))
    assert torch.allclose(batched[2:6], alone, atol=1e-5)  # padding to 7 changes nothing


def _reference(model: SASRec, items: list[int]) -> torch.Tensor:
    """One history's hidden states in float64, written from the module docstring's formulas
    (a loop over positions, no padding, no SDPA)."""
    d, heads, post = model.dim, model.blocks[0].heads, model.layer_norm == "post"
    weights = {k: v.double() for k, v in model.state_dict().items()}
    e = weights["embeddings.embeddings.item.weight"][torch.tensor(items)]
    numbered = torch.arange(len(items))
    if model.positions_from == "from_end":
        numbered = numbered.flip(0)
    p = weights["positions.weight"][numbered]

    def norm(x, name):
        eps = 1e-12 if post else 1e-5
        return F.layer_norm(x, (d,), weights[f"{name}.weight"], weights[f"{name}.bias"], eps)

    def linear(x, name):
        return x @ weights[f"{name}.weight"].T + weights[f"{name}.bias"]

    def attend(x, b):
        q, k, v = linear(x, f"blocks.{b}.qkv").view(len(items), 3, heads, -1).unbind(1)
        scores = torch.einsum("ihd,jhd->hij", q, k) / (d // heads) ** 0.5
        causal = torch.ones(len(items), len(items), dtype=torch.bool).tril()
        attention = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        mixed = torch.einsum("hij,jhd->ihd", attention, v).reshape(len(items), d)
        return linear(mixed, f"blocks.{b}.out")

    def ffn(x, b):
        return linear(F.gelu(linear(x, f"blocks.{b}.ffn.0")), f"blocks.{b}.ffn.3")

    h = norm(e + p, "norm") if post else d**0.5 * e + p
    for b in range(len(model.blocks)):
        if post:
            h = norm(h + attend(h, b), f"blocks.{b}.norm1")
            h = norm(h + ffn(h, b), f"blocks.{b}.norm2")
        else:
            h = h + attend(norm(h, f"blocks.{b}.norm1"), b)
            h = h + ffn(norm(h, f"blocks.{b}.norm2"), b)
    return h if post else norm(h, "norm")


@pytest.mark.parametrize(
    ("layer_norm", "positions"),
    [("post", "from_start"), ("pre", "from_start"), ("pre", "from_end")],
)
def test_each_layer_norm_layout_is_its_formula(layer_norm, positions):
    model = _model(layer_norm=layer_norm, positions=positions).eval()
    histories = [[5, 6, 7, 8], [1], [3, 9, 2, 11, 30, 4, 4]]
    with torch.no_grad():
        hidden, _ = model(*_kjt(histories))
    expected = torch.cat([_reference(model, h) for h in histories])
    torch.testing.assert_close(hidden.double(), expected, rtol=1e-5, atol=1e-5)
    if layer_norm == "post":  # BERT's initialization of the blocks' linear layers
        weight = model.blocks[0].qkv.weight
        assert abs(weight.std().item() - 0.02) < 0.005 and not model.blocks[0].qkv.bias.any()


def test_positions_from_start_score_a_prefix_as_a_training_row_sees_it():
    # Under the causal loss position j of a training row predicts item j + 1; numbered from the
    # start, its state is the user vector of the history ending there, what ranking scores.
    history = [5, 6, 7, 8, 9, 10]
    prefixes = [history[: j + 1] for j in range(len(history))]
    for positions, same in (("from_start", True), ("from_end", False)):
        model = _model(positions=positions).eval()
        with torch.no_grad():
            row, _ = model(*_kjt([history]))
            users = model.user_vectors(*_kjt(prefixes))
        torch.testing.assert_close(users[-1], row[-1])  # the whole history: the same either way
        assert torch.allclose(users[:-1], row[:-1], atol=1e-6) is same


def test_user_vectors_are_the_last_state_and_empty_histories_are_zero():
    model = _model().eval()
    kjt, longest = _kjt([[1, 2, 3], [], [4]])
    with torch.no_grad():
        hidden, _ = model(kjt, longest)
        users = model.user_vectors(kjt, longest)
    assert torch.equal(users[0], hidden[2]) and torch.equal(users[2], hidden[3])
    assert torch.equal(users[1], torch.zeros(8)) and torch.isfinite(hidden).all()
    items = model.item_vectors()
    assert torch.equal(items, model.embeddings.embeddings["item"].weight)


def _train_batch(histories: list[list[int]]) -> SequenceBatch:
    kjt, longest = _kjt([h[:-1] for h in histories])
    targets = torch.tensor([i for h in histories for i in h[1:]])
    return SequenceBatch(kjt, torch.zeros(kjt.values().numel()), targets, longest, True)


def test_full_softmax_is_the_cross_entropy_over_every_candidate():
    model = _model().eval()
    batch = _train_batch([[4, 5, 6], [7, 8]])
    loss = next_item_loss(model, batch, full_softmax=True, first_item=3)
    hidden, _ = model(batch.items, batch.max_length)
    table = model.embeddings.embeddings["item"].weight
    logits = hidden @ table[3:].t()
    assert torch.allclose(loss, F.cross_entropy(logits, batch.targets - 3), atol=1e-6)
    loss.backward()
    assert table.grad is not None and table.grad[3:].abs().sum() > 0


def test_sampled_softmax_corrects_for_in_batch_popularity_and_masks_hits():
    model = _model().eval()
    batch = _train_batch([[4, 5, 6, 5], [7, 5]])  # targets 5, 6, 5, 5
    g = torch.Generator().manual_seed(1)
    loss = next_item_loss(model, batch, in_batch=3, uniform=2, first_item=3, generator=g)
    g = torch.Generator().manual_seed(1)  # the same draws, by hand
    targets = batch.targets
    negatives = torch.cat(
        [targets[torch.randint(0, 4, (3,), generator=g)], torch.randint(3, 40, (2,), generator=g)]
    )
    hidden, _ = model(batch.items, batch.max_length)
    table = model.embeddings.embeddings["item"].weight
    counts = torch.bincount(targets, minlength=40).float()
    expected = 3 * counts[negatives] / 4 + 2 / 37
    logits = hidden @ table[negatives].t() - expected.log()
    logits[negatives[None, :] == targets[:, None]] = float("-inf")
    positive = (hidden * table[targets]).sum(1, keepdim=True)
    want = F.cross_entropy(torch.cat([positive, logits], 1), torch.zeros(4, dtype=torch.int64))
    assert torch.allclose(loss, want, atol=1e-6)


def _dynamic_twin(fixed: SASRec, num_items: int) -> SASRec:
    """``fixed`` over a dynamic item table holding keys 0 .. num_items - 1 with its rows."""
    table = EmbeddingConfig(name="item", num_embeddings=8, embedding_dim=8, feature_names=FEATURES)
    items = DynamicEmbeddingCollection([table], DynamicTableOptions(), optimizer=Adam(lr=0.01))
    keys = torch.arange(num_items)
    kjt = KeyedJaggedTensor(keys=FEATURES, values=keys, lengths=torch.tensor([num_items, 0]))
    items(kjt)  # a training lookup inserts every key
    with torch.no_grad():
        weight = items.embeddings["item"].weight
        slots = items.dynamic["item"].find(keys)
        weight[slots] = fixed.embeddings.embeddings["item"].weight[keys]
    twin = SASRec(items, max_len=12, num_heads=2, dropout=0.1, positions=fixed.positions_from)
    twin.load_state_dict(
        {k: v for k, v in fixed.state_dict().items() if not k.startswith("embeddings.")},
        strict=False,
    )
    return twin


@pytest.mark.parametrize("full_softmax", [False, True])
def test_a_dynamic_item_table_holding_every_id_gives_the_fixed_tables_loss(full_softmax):
    """Over raw keys the corpus is the keys held: holding exactly the fixed table's ids, the
    loss (same draws, same logQ) and the ranking vectors are the fixed table's."""
    fixed = _model().eval()
    dynamic = _dynamic_twin(fixed, 40).eval()
    batch = _train_batch([[4, 5, 6, 5, 9], [7, 5], [3, 30, 31]])
    losses = []
    for model in (fixed, dynamic):
        g = torch.Generator().manual_seed(1)
        options = dict(in_batch=3, uniform=5, first_item=3, generator=g, full_softmax=full_softmax)
        losses.append(next_item_loss(model, batch, **options))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(dynamic.item_keys(), torch.arange(40))
    assert torch.equal(dynamic.item_vectors(), fixed.item_vectors())


def test_bad_models_and_batches_are_named():
    table = EmbeddingConfig(name="item", num_embeddings=10, embedding_dim=8, feature_names=["x"])
    with pytest.raises(ValueError, match="features \\['history', 'candidates'\\]"):
        SASRec(EmbeddingCollection(tables=[table]), max_len=5)
    model = _model(max_len=3)
    with pytest.raises(ValueError, match="a history of 4 items; this SASRec has positions for 3"):
        model(*_kjt([[1, 2, 3, 4]]))
    kjt, longest = _kjt([[1, 2]])
    evaluation = SequenceBatch(kjt, torch.zeros(2), torch.tensor([3]), longest, False)
    with pytest.raises(ValueError, match="needs a train batch"):
        next_item_loss(model, evaluation)


def test_it_learns_the_synthetic_process(tmp_path: Path):
    """A few epochs on a small synthetic log: HR@10 well above popularity, toward the oracle;
    the items in recsys' EmbeddingCollection, updated by its fused Adam inside backward."""

    def make(num_items: int) -> SASRec:
        torch.manual_seed(0)
        table = recsys.EmbeddingConfig(
            name="item", num_embeddings=num_items, embedding_dim=16, feature_names=FEATURES
        )
        collection = recsys.EmbeddingCollection([table], optimizer=Adam(lr=5e-3))
        return SASRec(collection, max_len=20, num_heads=2, dropout=0.1)

    hr, popular, oracle = train_and_rank(make, tmp_path)
    assert hr > popular + 0.1
    assert hr > 0.6 * oracle
