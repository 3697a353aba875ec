"""``[model.dynamic]`` in a run: which tables are dynamic, per-table overrides, their counters in
metrics.jsonl, and resume, fine-tuning, eval and export of a model with dynamic tables."""

import json

import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys.build.dynamic_tables import dynamic_features, dynamic_options, key_balance
from recsys.build.models import build_model
from recsys.checkpoint.finetune import init_from_checkpoint
from recsys.checkpoint.io import load_model, read_spec
from recsys.config import DynamicConfig, load_config
from recsys.data.batch import DatasetSpec
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.interface import EmbeddingCollectionInterface
from recsys.models import table_configs
from recsys.serve.export import export_model, load_exported
from recsys.train.trainer import train

SPEC = DatasetSpec(("d0",), ("a", "b", "c"), (10, 20, 30), ("click",))
TINY = [
    "--data.synthetic.cardinalities=[50,300,2000]",
    "--data.synthetic.bag_sizes=[1,3,1]",
    "--data.synthetic.num_dense=3",
    "--data.synthetic.num_train_samples=8192",
    "--data.synthetic.num_valid_samples=1024",
    "--data.synthetic.num_test_samples=2048",
    "--train.batch_size=512",
    "--train.log_every_steps=4",
    "--train.progress_bar=false",
    "--model.embedding_dim=8",
    "--model.dense_arch_layer_sizes=[16,8]",
    "--model.over_arch_layer_sizes=[16,1]",
    '--model.dynamic.tables=["all"]',
    "--model.dynamic.initial_capacity=32",
    "--model.dynamic.bucket_size=16",
    '--model.dynamic.overrides=["cat_2.max_capacity=512", "cat_2.score=lfu"]',
    "--run.device=cpu",
]


def _options(**fields):
    tables = table_configs(SPEC.sparse_names, SPEC.cardinalities, 4)
    return dynamic_options(DynamicConfig(**fields), SPEC, tables)


def test_which_tables_are_dynamic():
    assert dynamic_features(DynamicConfig(), SPEC) == []
    assert dynamic_features(DynamicConfig(tables=["c", "a"]), SPEC) == ["a", "c"]
    assert dynamic_features(DynamicConfig(tables=["all"]), SPEC) == ["a", "b", "c"]
    raw = DatasetSpec(("d0",), ("a", "b"), (0, 0), ("click",), id_encoding="raw")
    assert dynamic_features(DynamicConfig(), raw) == ["a", "b"]
    with pytest.raises(ValueError, match="'bb'.*did you mean 'b'"):
        dynamic_features(DynamicConfig(tables=["bb"]), SPEC)


def test_overrides_change_one_table():
    options = _options(tables=["b", "c"], max_capacity=100, overrides=["c.ttl_steps=7"])
    assert list(options) == ["t_b", "t_c"]
    assert options["t_b"].ttl_steps == 0 and options["t_c"].ttl_steps == 7
    assert options["t_c"].max_capacity == 100
    assert options["t_b"].init_bound == pytest.approx(20**-0.5)  # as a fixed table of 20 rows


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("c.ttl_steps", "expected '<feature>.<key>=<value>'"),
        ("a.ttl_steps=3", "'a'.*not a dynamic table"),
        ("c.ttl=3", "unknown key 'ttl'; expected one of .*'ttl_steps'"),
        ("c.ttl_steps=soon", "ttl_steps = 'soon'; expected int"),
        ("c.score=fifo", "expected 'lru' or 'lfu'"),
        ("c.ttl_steps=-2", "feature 'c'.*ttl_steps=-2"),
    ],
)
def test_bad_overrides_are_named(entry, message):
    with pytest.raises(ValueError, match=message):
        _options(tables=["c"], overrides=[entry])


def test_a_torch_embedding_optimizer_is_refused(tmp_path):
    config = load_config(
        None, [*TINY, f"--run.dir={tmp_path}", "--train.fused_embedding_update=false"]
    )
    with pytest.raises(ValueError, match="fused optimizer"):
        train(config)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A DeepFM run (dynamic tables and their dynamic first-order twins) with a checkpoint
    every 8 steps."""
    run_dir = tmp_path_factory.mktemp("dynamic")
    overrides = [*TINY, "--model.name=deepfm", f"--run.dir={run_dir}", "--checkpoint.every_steps=8"]
    config = load_config(None, overrides)
    return config, train(config), run_dir


def test_counters_are_logged_at_every_train_event(run):
    _, result, run_dir = run
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_events = [e for e in events if e["split"] == "train"]
    assert len(train_events) == 4
    last = train_events[-1]
    for table in ("t_cat_0", "t_cat_2", "t_cat_2_linear"):
        for counter in ("size", "capacity", "load_factor", "hits", "inserts", "evictions"):
            assert f"dynamic/{table}/{counter}" in last
    assert last["dynamic/t_cat_2/capacity"] == 512  # capped by its override
    assert last["dynamic/t_cat_2/evictions"] > 0  # ~2000 ids for 512 rows
    assert last["dynamic/t_cat_0/evictions"] == 0 and last["dynamic/t_cat_0/size"] <= 50
    assert result.test["auc"] > 0.6


def test_resume_is_bitwise(run, tmp_path):
    config, _, run_dir = run
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    overrides = [
        *TINY,
        "--model.name=deepfm",
        f"--run.dir={tmp_path}",
        "--checkpoint.every_steps=8",
    ]
    train(load_config(None, [*overrides, "--train.max_steps=8"]))
    train(load_config(None, [*overrides, "--checkpoint.resume=latest"]))
    resumed = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for split, step in [("train", 12), ("train", 16), ("test", 16)]:
        a = next(e for e in events if (e["split"], e["step"]) == (split, step))
        b = [e for e in resumed if (e["split"], e["step"]) == (split, step)][-1]
        key = "loss" if split == "train" else "auc"
        assert a[key] == b[key]
        assert a.get("dynamic/t_cat_2/size") == b.get("dynamic/t_cat_2/size")


def test_fine_tuning_loads_the_keys_and_their_rows(run, tmp_path):
    _, result, _ = run
    trained = load_model(result.checkpoint)
    overrides = [*TINY, "--model.name=deepfm", f"--run.dir={tmp_path}"]
    config = load_config(None, [*overrides, f"--checkpoint.init_from={result.checkpoint}"])
    model = build_model(config.model, read_spec(result.checkpoint), torch.device("cpu"))
    init_from_checkpoint(model, result.checkpoint, config.checkpoint)
    expected, got = trained.state_dict(), model.state_dict()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_export_carries_the_frozen_map(run, tmp_path):
    _, result, _ = run
    exported = export_model(result.checkpoint, tmp_path / "model.pt2")
    program, spec = load_exported(exported)
    model = load_model(result.checkpoint)
    collection = next(m for m in model.modules() if isinstance(m, DynamicEmbeddingBagCollection))
    known = collection.dynamic["t_cat_2"].map.entries()[0][:4]
    unknown = torch.tensor([10**12, -(10**12), 10**15, 3 * 10**13])  # never seen: zero rows
    dense = torch.randn(4, spec.num_dense)
    for ids in (known, unknown):
        values = torch.cat([torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), ids])
        lengths = torch.tensor([1, 1, 1, 1, 2, 0, 1, 1, 1, 1, 1, 1])
        kjt = KeyedJaggedTensor(keys=list(spec.sparse_names), values=values, lengths=lengths)
        with torch.no_grad():
            expected = torch.sigmoid(model(dense, kjt))
        assert torch.equal(program(dense, values, lengths), expected)


def test_key_balance_lists_keys_per_rank_of_sharded_dynamic_tables():
    class Sharded(EmbeddingCollectionInterface):
        def dynamic_stats(self):
            return {
                "t_user": {
                    "size": 30.0,
                    "size_rank0": 10.0,
                    "size_rank1": 20.0,
                    "size_max_over_mean": 4 / 3,
                }
            }

    model = torch.nn.Sequential(Sharded())
    assert key_balance(model) == (
        "keys per rank of the dynamic tables (rank 0, 1, ...):\n"
        "  t_user: 10 20  (max/mean 1.333)"
    )
    assert key_balance(torch.nn.Linear(1, 1)) == ""


def test_a_cap_in_whole_buckets_is_said_once_with_its_real_value(tmp_path):
    from recsys.data import build_dataset
    from recsys.train.model_setup import setup_model

    config = load_config(
        None,
        [*TINY, f"--run.dir={tmp_path}", "--model.dynamic.max_capacity=1000"],  # buckets of 16
    )
    said = []
    spec = build_dataset(config.data, config.run.seed).spec
    setup_model(config, spec, torch.device("cpu"), 1, tmp_path, None, said.append)
    (line,) = [line for line in said if line.startswith("model.dynamic: caps are")]
    # t_cat_2 keeps its own 512 (32 buckets): only the two tables at 1000 are rounded.
    assert "max_capacity 1,000 is 1,008 rows (2 table(s): t_cat_0, t_cat_1)" in line
    assert "512" not in line
