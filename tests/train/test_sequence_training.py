"""`recsys train` of a sequence model end to end: ranking metrics in metrics.jsonl, checkpoints,
a resume that continues the run exactly, the report's columns, and the config errors."""

import json
import shutil
from pathlib import Path

import pytest

from recsys._files import file_checksum
from recsys.checkpoint.io import CHECKSUMS_FILE, latest_checkpoint, read_config
from recsys.config import load_config
from recsys.report import format_table, load_run, summarize
from recsys.train.evaluate import evaluate_checkpoint
from recsys.train.metrics import read_metrics
from recsys.train.trainer import train

TINY = [
    "--model.name=sasrec",
    "--model.embedding_dim=8",
    "--model.sequence.max_len=10",
    "--model.sequence.num_blocks=1",
    "--data.synthetic_sequences.num_users=200",
    "--data.synthetic_sequences.num_items=60",
    "--data.synthetic_sequences.num_topics=4",
    "--data.synthetic_sequences.mean_events=10",
    "--data.synthetic_sequences.max_events=20",
    "--train.batch_size=32",
    "--train.epochs=2",
    "--train.log_every_steps=3",
    "--train.eval_every_steps=6",
    "--train.eval_batch_size=64",
    "--train.embedding_optimizer=adam",
    "--train.embedding_lr=0.01",
    "--train.dense_lr=0.01",
    "--train.next_item.in_batch_negatives=16",
    "--train.next_item.uniform_negatives=16",
    "--train.progress_bar=false",
    "--run.device=cpu",
    "--run.tensorboard=false",
]
REPO = Path(__file__).resolve().parents[2]
RANKING = {"hr@10", "ndcg@10", "mrr", "hr@50", "ndcg@50", "num_users"}


def _run(run_dir: Path, *extra: str):
    return train(load_config(None, [*TINY, f"--run.dir={run_dir}", *extra]))


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    return run_dir, _run(run_dir, "--checkpoint.keep_best=valid_hr@10")


def test_run_logs_ranking_metrics_and_saves_a_checkpoint(whole_run):
    run_dir, result = whole_run
    # 200 users' histories (up to 20 events) cut into windows of 11: 7 batches of 32 rows per
    # epoch, 2 epochs
    assert result.steps == 14
    events = read_metrics(run_dir / "metrics.jsonl")
    valid = [e for e in events if e["split"] == "valid"]
    (test,) = [e for e in events if e["split"] == "test"]
    assert [e["step"] for e in valid] == [6, 12]
    assert set(valid[0]) >= RANKING and set(test) >= RANKING
    assert {"popularity_hr@10", "oracle_hr@10", "oracle_ndcg@10"} <= set(test)
    assert 0 <= test["ndcg@10"] <= test["hr@10"] <= test["hr@50"] <= 1
    assert test["num_users"] == result.test["num_users"] > 100
    assert result.checkpoint == latest_checkpoint(run_dir / "checkpoints")
    assert (run_dir / "checkpoints" / "best").exists()
    train_losses = [e["loss"] for e in events if e["split"] == "train"]
    assert train_losses[-1] < train_losses[0]


def test_resume_continues_the_run_exactly(whole_run, tmp_path):
    run_dir, result = whole_run
    _run(tmp_path, "--checkpoint.keep_best=valid_hr@10", "--train.max_steps=6")
    resumed = _run(tmp_path, "--checkpoint.keep_best=valid_hr@10", "--checkpoint.resume=latest")
    assert resumed.steps == 14
    events = read_metrics(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in events if e["split"] == "resume"] == [6]
    whole = [e for e in read_metrics(run_dir / "metrics.jsonl") if e["split"] == "train"]
    after = [e for e in events if e["split"] == "train" and e["step"] > 6]
    assert [e["step"] for e in after] == [9, 12, 14]
    assert [e["loss"] for e in after] == [e["loss"] for e in whole if e["step"] > 6]
    assert resumed.test["hr@10"] == result.test["hr@10"]
    assert resumed.test["mrr"] == result.test["mrr"]


def test_a_checkpoint_saved_before_positions_resumes_with_its_numbering(whole_run, tmp_path):
    # A config.toml written before model.sequence.positions existed meant positions counted
    # from the end: eval reads it so, and a resume must say which numbering it continues with.
    run_dir, _ = whole_run
    old = tmp_path / "old"
    shutil.copytree(run_dir, old, symlinks=True)
    for config in old.rglob("config.toml"):
        text = config.read_text()
        assert 'positions = "from_start"\n' in text
        config.write_text(text.replace('positions = "from_start"\n', ""))
        manifest = config.parent / CHECKSUMS_FILE  # a checkpoint's: the file as it was saved
        if manifest.is_file():
            sums = json.loads(manifest.read_text())
            size, crc = file_checksum(config)
            sums["files"]["config.toml"] = {"bytes": size, "crc32": crc}
            manifest.write_text(json.dumps(sums))
    checkpoint = latest_checkpoint(old / "checkpoints")
    assert read_config(checkpoint).model.sequence.positions == "from_end"
    resume = ["--checkpoint.keep_best=valid_hr@10", "--checkpoint.resume=latest"]
    more = [*resume, "--train.epochs=3"]
    with pytest.raises(ValueError, match="resume it with --model.sequence.positions=from_end"):
        _run(old, *more)
    assert _run(old, *more, "--model.sequence.positions=from_end").steps == 21


def test_recsys_eval_reproduces_the_test_ranking(whole_run):
    run_dir, result = whole_run
    evaluated = evaluate_checkpoint(run_dir)
    assert evaluated.step == 14
    assert evaluated.metrics == result.test
    assert evaluated.summary().startswith("eval test step 14: hr@10 ")
    assert "users of synthetic interaction log" in evaluated.summary()


def test_report_shows_the_ranking_columns(whole_run):
    run_dir, result = whole_run
    summary = summarize(load_run(run_dir))
    assert summary.ranking["test hr@10"] == pytest.approx(result.test["hr@10"])
    assert summary.test_auc is None
    header, row = format_table([summary]).splitlines()
    assert "test hr@10" in header and "valid hr@10" in header
    assert f"{result.test['hr@10']:.4f}" in row


@pytest.mark.parametrize("recipe", ["sasrec_synthetic", "hstu_synthetic"])
def test_recipe_trains_as_it_is(recipe, tmp_path):
    data = [o for o in TINY if o.startswith("--data.")]
    result = train(
        load_config(
            REPO / "configs" / f"{recipe}.toml",
            [*data, "--train.max_steps=2", "--run.device=cpu", f"--run.dir={tmp_path}"],
        )
    )
    assert result.steps == 2 and set(result.test) >= RANKING
    assert result.test["oracle_hr@10"] > result.test["popularity_hr@10"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--checkpoint.keep_best=valid_auc"], "evaluated by a ranking metric"),
        (["--data.source=synthetic"], "trains on user histories"),
        (
            ["--train.next_item.in_batch_negatives=0", "--train.next_item.uniform_negatives=0"],
            "no negatives to sample",
        ),
        (["--model.sequence.num_heads=3"], "divisible by model.sequence.num_heads"),
        (["--model.sequence.time_bias=true"], "time bias is the second half of hstu's"),
        (
            ["--model.name=hstu", "--model.sequence.time_bias=true"],
            "relative_bias = false: the time bias",
        ),
        (
            ["--model.name=hstu", "--model.sequence.time_convention=next"],
            "time_convention = 'next' with model.sequence.time_bias = false",
        ),
        (["--data.synthetic_sequences.num_topics=100"], "num_items >= num_topics"),
        (["--train.batch_size=500"], "larger than the 227 train rows"),
        (["--train.next_item.window_stride=11"], "window_stride = 11; expected 0"),
        (
            [
                "--data.synthetic_sequences.id_encoding=raw",
                "--model.storage.tier=host",
                "--model.dynamic.max_capacity=64",
            ],
            "is tiered, which keeps every key it admits",
        ),
        (
            ["--model.dynamic.tables=['all']", "--train.fused_embedding_update=false"],
            "trained by the fused embedding update",
        ),
    ],
)
def test_bad_sequence_configs_are_named(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _run(tmp_path, *overrides)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_ctr_model_refuses_user_histories(tmp_path):
    config = load_config(
        None, ["--data.source=synthetic_sequences", f"--run.dir={tmp_path}", "--run.device=cpu"]
    )
    with pytest.raises(ValueError, match="holds user histories, for sequence models"):
        train(config)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--train.next_item.loss=softmax", "must be one of 'sampled', 'full'"),
        ("--train.next_item.negatives=5", "unknown config key 'train.next_item.negatives'"),
        ("--model.sequence.max_len=0", "must be >= 1"),
        ("--train.early_stopping_metric=valid_hr@20", "must be one of"),
        ("--model.name=sasrek", "did you mean 'sasrec'"),
    ],
)
def test_sequence_config_keys_are_checked(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("exclude", [False, True])
def test_ranking_masks_the_whole_history_by_brute_force(exclude):
    """recsys' test ranking (the task's evaluate, as train, torchrun and `recsys eval` run it)
    against a brute-force one per user: the model reads the last max_len = 10 events of
    histories of up to 20, and exclude_history masks every item before the target."""
    import math

    import torch
    from torchrec import KeyedJaggedTensor

    from recsys.build.models import build_model
    from recsys.distributed.parallel import DistributedInfo
    from recsys.train.retrieval import NextItemTask

    config = load_config(None, [*TINY, f"--train.next_item.exclude_history={str(exclude).lower()}"])
    task = NextItemTask(config, torch.device("cpu"), DistributedInfo(), lambda line: None)
    model = build_model(config.model, task.spec, torch.device("cpu"), seed=3).eval()
    result = task.evaluate(model, "test")
    test, first = task.data.splits["test"], task.data.first_item
    assert (
        int(max(test.offsets[1:] - test.offsets[:-1])) > 10
    )  # histories longer than what the model reads
    items = model.item_vectors().double()
    ranks = []
    with torch.no_grad():
        for u in range(test.users):
            history = test.values[test.offsets[u] : test.offsets[u + 1]].tolist()
            read = torch.tensor(history[-10:])
            kjt = KeyedJaggedTensor(["items"], read, lengths=torch.tensor([len(read)]))
            query = model.user_vectors(kjt, len(read))[0].double()
            target = int(test.targets[u])
            scores = {i: float(items[i] @ query) for i in range(first, items.shape[0])}
            masked = set(history) - {target} if exclude else set()
            others = [i for i in scores if i != target and i not in masked]
            ranks.append(sum(scores[i] >= scores[target] for i in others))
    hr = sum(r < 10 for r in ranks) / len(ranks)
    ndcg = sum(1 / math.log2(r + 2) for r in ranks if r < 10) / len(ranks)
    assert result["hr@10"] == pytest.approx(hr) and result["ndcg@10"] == pytest.approx(ndcg)
