import tomllib
from pathlib import Path

import pytest

from recsys.config import (
    Config,
    config_differences,
    config_reference,
    load_config,
    load_saved_config,
    to_toml,
)
from recsys.config.loading import RENAMED_KEYS

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "recipe.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_precedence_defaults_toml_cli(tmp_path):
    recipe = write(tmp_path, "[train]\nbatch_size = 512\ndense_lr = 0.01\n[run]\nseed = 7\n")
    config = load_config(recipe, ["--train.batch_size=256"])
    assert config.train.batch_size == 256  # command line beats TOML
    assert config.train.dense_lr == 0.01  # TOML beats default
    assert config.run.seed == 7
    assert config.train.embedding_lr == Config().train.embedding_lr  # default kept
    assert config.run.name == "recipe"  # from the file stem
    assert config.run.dir == str(Path("runs") / "recipe")


def test_nested_sections_and_list_values(tmp_path):
    recipe = write(tmp_path, "[data.synthetic]\ncardinalities = [5, 6, 7]\n")
    config = load_config(
        recipe, ["--model.over_arch_layer_sizes=32,8,1", "--data.synthetic.zipf_alpha=1"]
    )
    assert config.data.synthetic.cardinalities == [5, 6, 7]
    assert config.model.over_arch_layer_sizes == [32, 8, 1]
    assert config.data.synthetic.zipf_alpha == 1.0
    assert isinstance(config.data.synthetic.zipf_alpha, float)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--train.batchsize=5", "did you mean 'train.batch_size'"),
        ("--train.seed=5", "did you mean 'run.seed'"),
        ("--trian.batch_size=5", "unknown config key 'trian'"),
        ("--data.synthetic.cardinality=[3]", "did you mean 'data.synthetic.cardinalities'"),
    ],
)
def test_unknown_key_on_command_line_names_closest(override, expected):
    with pytest.raises(ValueError, match=expected):
        load_config(None, [override])


def test_unknown_key_in_toml_names_file_and_closest(tmp_path):
    recipe = write(tmp_path, "[model]\nembeding_dim = 8\n")
    with pytest.raises(ValueError, match=r"recipe.toml.*model.embeding_dim.*model.embedding_dim"):
        load_config(recipe)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--train.batch_size=abc", "'train.batch_size' expects int, got str 'abc'"),
        ("--train.batch_size=1.5", "expects int, got float"),
        ("--train.progress_bar=1", "expects bool"),
        ("--model.dense_arch_layer_sizes=[1, 'x']", r"dense_arch_layer_sizes\[1\]' expects int"),
        ("--train.dense_optimizer=adm", "must be one of .*did you mean 'adam'"),
    ],
)
def test_wrong_type_is_a_clear_error(override, expected):
    with pytest.raises(ValueError, match=expected):
        load_config(None, [override])


def test_section_and_value_confusion():
    with pytest.raises(ValueError, match="'train' is a section"):
        load_config(None, ["--train=3"])
    with pytest.raises(ValueError, match="must look like"):
        load_config(None, ["--train.batch_size"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(write(tmp_path, "[train\n"))


def test_toml_round_trip(tmp_path):
    config = load_config(None, ["--train.batch_size=77", '--run.name=x y "quoted"'])
    again = load_config(write(tmp_path, to_toml(config)))
    assert again == config
    assert tomllib.loads(to_toml(config))["train"]["batch_size"] == 77


def test_every_field_is_documented():
    reference = config_reference()
    assert "| `batch_size` | int >= 1 | `1024` |" in reference
    for line in reference.splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), f"undocumented field: {line}"


def test_recipes_in_configs_load():
    recipes = sorted((REPO / "configs").glob("*.toml"))
    assert recipes
    for recipe in recipes:
        load_config(recipe)


# [model] as earlier versions wrote it into every run directory's and checkpoint's config.toml:
# xdeepfm's and pnn's options were flat keys of [model].
OLD_MODEL_SECTION = """
[model]
name = "xdeepfm"
embedding_dim = 16
pooling = "sum"
embedding_dtype = "fp32"
dense_arch_layer_sizes = [64, 16]
over_arch_layer_sizes = [64, 32, 1]
activation = "relu"
dropout = 0.0
cin_layer_sizes = [16, 16]
pnn_product = "both"

[model.cross]
num_layers = 3
low_rank = 0
version = "v2"
structure = "stacked"

[model.mmoe]
num_experts = 4
expert_layer_sizes = [64, 32]
tower_layer_sizes = [32]
"""

NEW_MODEL_SECTION = """
[model]
name = "xdeepfm"

[model.xdeepfm]
cin_layer_sizes = [16, 16]

[model.pnn]
product = "both"
"""


def test_old_config_toml_loads_as_the_new_one(tmp_path):
    train = "[train]\nbatch_size = 64\n"
    old = load_config(write(tmp_path, OLD_MODEL_SECTION + train, "old.toml"), ["--run.name=r"])
    new = load_config(write(tmp_path, NEW_MODEL_SECTION + train, "new.toml"), ["--run.name=r"])
    assert old.model.xdeepfm.cin_layer_sizes == [16, 16] and old.model.pnn.product == "both"
    assert old == new
    # resuming an old checkpoint with a new config reports no change
    assert config_differences(old, new) == []
    # written back under the new names only
    written = tomllib.loads(to_toml(old))["model"]
    assert written["xdeepfm"] == {"cin_layer_sizes": [16, 16]} and written["pnn"] == {
        "product": "both"
    }
    assert not {"cin_layer_sizes", "pnn_product"} & set(written)


def test_a_saved_config_without_a_key_means_its_earlier_default(tmp_path):
    # SASRec / HSTU numbered positions from the end before the key existed; a config.toml that
    # recsys wrote lists every key, so one without it is older and keeps that meaning
    text = to_toml(load_config(None, ["--model.name=sasrec"])).replace(
        'positions = "from_start"\n', ""
    )
    assert "positions" not in text
    old = write(tmp_path, text, "config.toml")
    assert load_saved_config(old).model.sequence.positions == "from_end"
    assert load_config(old).model.sequence.positions == "from_start"  # a recipe: the default
    now = write(tmp_path, to_toml(load_config(None, ["--model.name=sasrec"])), "now.toml")
    assert load_saved_config(now).model.sequence.positions == "from_start"
    assert load_saved_config(old, ["--train.epochs=2"]).train.epochs == 2
    dlrm = write(tmp_path, text.replace('name = "sasrec"', 'name = "dlrm"'), "dlrm.toml")
    assert load_saved_config(dlrm).model.sequence.positions == "from_start"  # not read by dlrm
    broken = write(tmp_path, "[model\n", "broken.toml")
    with pytest.raises(ValueError, match="broken.toml' is not valid TOML"):
        load_saved_config(broken)


def test_old_keys_on_the_command_line_set_the_new_ones():
    old = load_config(None, ["--model.cin_layer_sizes=4,2", "--model.pnn_product=outer"])
    new = load_config(None, ["--model.xdeepfm.cin_layer_sizes=4,2", "--model.pnn.product=outer"])
    assert old == new and old.model.xdeepfm.cin_layer_sizes == [4, 2]
    with pytest.raises(ValueError, match=r"'model.pnn.product' must be one of .*'outr'"):
        load_config(None, ["--model.pnn_product=outr"])


def test_old_and_new_name_of_a_key_in_one_file_is_an_error(tmp_path):
    both = write(tmp_path, "[model]\npnn_product = 'outer'\n[model.pnn]\nproduct = 'inner'\n")
    with pytest.raises(
        ValueError, match=r"recipe.toml.*both 'model.pnn_product'.*'model.pnn.product'"
    ):
        load_config(both)


def flat_keys(table: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in table.items():
        is_section = isinstance(value, dict)
        keys |= flat_keys(value, f"{prefix}{name}.") if is_section else {f"{prefix}{name}"}
    return keys


def test_renamed_keys_map_keys_gone_to_keys_now():
    keys = flat_keys(tomllib.loads(to_toml(Config())))
    assert "model.cross.num_layers" in keys
    for old, new in RENAMED_KEYS.items():
        assert new in keys and old not in keys
