"""The registry (recsys.build.models) builds every built-in name model.name allows, and refuses
a name that is none (user classes: tests/build/test_model_classes.py)."""

import dataclasses

import pytest
import torch

from recsys.build.models import MODELS, build_model
from recsys.build.registry import BUILTIN_MODELS, resolve_model
from recsys.config import SEQUENCE_MODELS, TARGET_RANKING_MODELS, ModelConfig, load_config
from recsys.data.batch import DatasetSpec

SPEC = DatasetSpec(("d0", "d1"), ("a", "b", "c"), (5, 7, 3), ("click",))


def test_every_built_in_name_is_a_model_of_its_family():
    histories = set(SEQUENCE_MODELS) | set(TARGET_RANKING_MODELS)
    assert {n for n, e in MODELS.items() if e.family != "click"} == histories
    assert list(MODELS) == list(BUILTIN_MODELS)  # the names model.name resolves, in order
    for name, entry in MODELS.items():
        assert entry.module.__module__.startswith("recsys.models."), name
        assert resolve_model(name).cls is entry.module and resolve_model(name).builtin
        assert load_config(overrides=[f"--model.name={name}"]).model.name == name


def test_an_unknown_name_lists_the_known_ones():
    config = dataclasses.replace(ModelConfig(), name="dlrn")
    message = r"model.name 'dlrn': not a built-in .* did you mean 'dlrm'\? Available: dlrm, "
    with pytest.raises(ValueError, match=message):
        build_model(config, SPEC, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"config key 'model.name' names no model class: not a"):
        load_config(overrides=["--model.name=dlrn"])


CLICK_MODELS = [name for name, entry in MODELS.items() if entry.family == "click"]


@pytest.mark.parametrize("name", CLICK_MODELS)
def test_a_first_order_term_has_its_own_dimension_1_tables(name):
    model = build_model(dataclasses.replace(ModelConfig(), name=name), SPEC, torch.device("cpu"))
    tables = [n for n in model.state_dict() if n.endswith(".weight") and ".t_" in n]
    linear = [n for n in tables if n.endswith("_linear.weight")]
    assert len(tables) - len(linear) == 3  # one table per feature
    assert len(linear) == (3 if MODELS[name].linear else 0)
    for n in linear:
        assert model.state_dict()[n].shape[1] == 1
