"""The registry builds sasrec and hstu over one unpooled item table sized by the data."""

import dataclasses

import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys import EmbeddingCollection
from recsys.build.models import build_model
from recsys.config import ModelConfig, SequenceModelConfig
from recsys.data.batch import DatasetSpec
from recsys.embedding.optim import Adam
from recsys.models.hstu import HSTU
from recsys.models.sasrec import SASRec

ITEMS = DatasetSpec((), ("items",), (37,), ())


def _config(name: str, **sequence) -> ModelConfig:
    options = dataclasses.replace(SequenceModelConfig(), **sequence)
    return dataclasses.replace(ModelConfig(), name=name, embedding_dim=8, sequence=options)


@pytest.mark.parametrize(("name", "module"), [("sasrec", SASRec), ("hstu", HSTU)])
def test_builds_the_model_over_a_fused_item_table(name, module):
    optimizer = Adam(lr=0.01)
    config = _config(name, max_len=7, num_blocks=3, num_heads=2)
    model = build_model(config, ITEMS, torch.device("cpu"), embedding_optimizer=optimizer)
    assert isinstance(model, module) and len(model.blocks) == 3 and model.max_len == 7
    assert isinstance(model.embeddings, EmbeddingCollection)
    assert model.embeddings.optimizer is optimizer
    assert model.state_dict()["embeddings.embeddings.item.weight"].shape == (37, 8)
    history = KeyedJaggedTensor(
        keys=["items"], values=torch.tensor([4, 5, 6, 7]), lengths=torch.tensor([3, 1])
    )
    assert model.user_vectors(history, 3).shape == (2, 8)


def test_refuses_click_log_specs_and_bad_heads():
    ctr = DatasetSpec(("d0",), ("a", "b"), (5, 7), ("click",))
    with pytest.raises(ValueError, match="trains on user histories"):
        build_model(_config("sasrec"), ctr, torch.device("cpu"))
    with pytest.raises(ValueError, match="divisible by model.sequence.num_heads = 3"):
        build_model(_config("sasrec", num_heads=3), ITEMS, torch.device("cpu"))
    with pytest.raises(ValueError, match="num_heads = 9 must be <= model.embedding_dim"):
        build_model(_config("hstu", num_heads=9), ITEMS, torch.device("cpu"))
