"""The registry (recsys.build.models) builds every name model.name allows, and nothing else."""

import dataclasses
import typing

import pytest
import torch

from recsys.build.models import MODELS, build_model
from recsys.config import SEQUENCE_MODELS, TARGET_RANKING_MODELS, ModelConfig
from recsys.data.batch import DatasetSpec

SPEC = DatasetSpec(("d0", "d1"), ("a", "b", "c"), (5, 7, 3), ("click",))


def test_every_name_the_config_allows_has_a_builder():
    hint = typing.get_type_hints(ModelConfig)["name"]
    histories = set(SEQUENCE_MODELS) | set(TARGET_RANKING_MODELS)
    assert set(MODELS) | histories == set(typing.get_args(hint))
    assert not set(MODELS) & histories  # built by recsys.build.sequence_models
    for name, entry in MODELS.items():
        assert entry.module.__module__.startswith("recsys.models."), name


def test_an_unknown_name_lists_the_known_ones():
    config = dataclasses.replace(ModelConfig(), name="dlrn")
    with pytest.raises(ValueError, match=r"unknown model.name 'dlrn'; available: dlrm, dlrm_dcn"):
        build_model(config, SPEC, torch.device("cpu"))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_first_order_term_has_its_own_dimension_1_tables(name):
    model = build_model(dataclasses.replace(ModelConfig(), name=name), SPEC, torch.device("cpu"))
    tables = [n for n in model.state_dict() if n.endswith(".weight") and ".t_" in n]
    linear = [n for n in tables if n.endswith("_linear.weight")]
    assert len(tables) - len(linear) == 3  # one table per feature
    assert len(linear) == (3 if MODELS[name].linear else 0)
    for n in linear:
        assert model.state_dict()[n].shape[1] == 1
