"""A model holding a recsys.EmbeddingCollection (unpooled) through recsys' checkpoint
functions: save and resume with its fused optimizer state, fine-tune from it, freeze it, and
move its tables to and from torchrec's EmbeddingCollection."""

import torch
import torchrec
from torch import nn
from torchrec import EmbeddingConfig, KeyedJaggedTensor

import recsys.checkpoint.io as ckpt
from recsys import EmbeddingCollection
from recsys.checkpoint.finetune import freeze, init_from_checkpoint
from recsys.config import CheckpointConfig
from recsys.embedding.interface import embedding_collections, is_optimizer_state, state_to_load
from recsys.embedding.optim import Adam, RowWiseAdagrad


def table_configs():
    return [
        EmbeddingConfig(name="movies", embedding_dim=4, num_embeddings=17, feature_names=["hist"]),
        EmbeddingConfig(name="cats", embedding_dim=6, num_embeddings=5, feature_names=["cat"]),
    ]


class Sequences(nn.Module):
    """Mean of each feature's rows per sample, then a linear head."""

    def __init__(self, optimizer=None) -> None:
        super().__init__()
        self.sparse = EmbeddingCollection(table_configs(), optimizer=optimizer)
        self.head = nn.Linear(10, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = []
        for jt in self.sparse(kjt).values():
            sample = torch.repeat_interleave(torch.arange(kjt.stride()), jt.lengths())
            sums = torch.zeros(kjt.stride(), jt.values().shape[1]).index_add(0, sample, jt.values())
            pooled.append(sums / jt.lengths().clamp(min=1).unsqueeze(1))
        return self.head(torch.cat(pooled, dim=1))


def batch(seed: int) -> KeyedJaggedTensor:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (8,), generator=generator)
    hist = torch.randint(0, 17, (int(lengths[:4].sum()),), generator=generator)
    cat = torch.randint(0, 5, (int(lengths[4:].sum()),), generator=generator)
    return KeyedJaggedTensor(keys=["hist", "cat"], values=torch.cat([hist, cat]), lengths=lengths)


def train_step(model: Sequences, dense: torch.optim.Optimizer, seed: int) -> None:
    dense.zero_grad()
    model(batch(seed)).square().mean().backward()
    dense.step()


def test_save_and_resume_continue_exactly(tmp_path):
    torch.manual_seed(0)
    model = Sequences(Adam(lr=0.05))
    dense = torch.optim.SGD(model.head.parameters(), lr=0.1)
    for seed in range(2):
        train_step(model, dense, seed)
    path = ckpt.save_checkpoint(tmp_path, 2, {"model": model.state_dict()})
    keys = set(ckpt.checkpoint_shapes(path))
    assert {
        "model.sparse.embeddings.movies.weight",
        "model.sparse.embeddings.movies.exp_avg",
    } <= keys
    assert "model.sparse.optimizer_step" in keys

    torch.manual_seed(1)
    resumed = Sequences(Adam(lr=0.05))
    state = {"model": state_to_load(resumed, ckpt.checkpoint_shapes(path), "model.")}
    resumed.load_state_dict(ckpt.load_checkpoint(path, state)["model"])
    resumed_dense = torch.optim.SGD(resumed.head.parameters(), lr=0.1)
    train_step(model, dense, 7)
    train_step(resumed, resumed_dense, 7)
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_fine_tune_loads_weights_not_optimizer_state(tmp_path):
    torch.manual_seed(0)
    model = Sequences(Adam(lr=0.05))
    train_step(model, torch.optim.SGD(model.head.parameters(), lr=0.1), 0)
    path = ckpt.save_checkpoint(tmp_path, 1, {"model": model.state_dict()})
    assert is_optimizer_state("model.sparse.embeddings.movies.exp_avg_sq")
    assert not is_optimizer_state("model.sparse.embeddings.movies.weight")

    tuned = Sequences(RowWiseAdagrad(lr=0.1))  # another optimizer: its state starts fresh
    report = init_from_checkpoint(tuned, path, CheckpointConfig(init_from=str(path)))
    assert "not loadable" not in report
    assert int(tuned.state_dict()["sparse.optimizer_step"]) == 0
    for key in ["sparse.embeddings.movies.weight", "sparse.embeddings.cats.weight", "head.bias"]:
        assert torch.equal(tuned.state_dict()[key], model.state_dict()[key]), key
    assert tuned.sparse._views_intact()

    assert freeze(tuned, ["embeddings"]) == ["sparse"]
    assert embedding_collections(tuned)["sparse"].is_frozen()
    before = tuned.sparse.embeddings.movies.weight.clone()
    train_step(tuned, torch.optim.SGD(tuned.head.parameters(), lr=0.1), 3)
    assert torch.equal(tuned.sparse.embeddings.movies.weight, before)


def test_torchrec_collection_checkpoint_loads_into_recsys_and_back(tmp_path):
    theirs = torchrec.EmbeddingCollection([table_configs()[0]])
    saved = ckpt.save_checkpoint(tmp_path / "a", 1, {"model": theirs.state_dict()})
    ours = EmbeddingCollection([table_configs()[0]], optimizer=Adam(lr=0.1))
    wanted = {"model": {k: v for k, v in ours.state_dict().items() if k.endswith(".weight")}}
    ours.load_state_dict(ckpt.load_checkpoint(saved, wanted)["model"], strict=False)
    kjt = KeyedJaggedTensor(
        keys=["hist"], values=torch.tensor([3, 16, 3]), lengths=torch.tensor([3])
    )
    assert torch.equal(ours(kjt)["hist"].values(), theirs(kjt)["hist"].values())

    ours(kjt)["hist"].values().sum().backward()  # one fused Adam step
    back = ckpt.save_checkpoint(tmp_path / "b", 2, {"model": ours.state_dict()})
    again = torchrec.EmbeddingCollection([table_configs()[0]])
    again.load_state_dict(ckpt.load_checkpoint(back, {"model": again.state_dict()})["model"])
    assert torch.equal(again.embeddings.movies.weight, ours.embeddings.movies.weight)
    assert not torch.equal(again.embeddings.movies.weight, theirs.embeddings.movies.weight)
