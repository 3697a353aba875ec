"""[model.storage] through `recsys train`: tiered tables train like tables held in memory, log
their counters, and a killed run resumes bitwise from its last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys.build.tiered_tables import tiered_collections
from recsys.checkpoint.io import find_resumable, load_model, verify_checkpoint
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.train.evaluate import evaluate_checkpoint
from recsys.train.model_setup import setup_model
from recsys.train.trainer import train
from tests.kill_9 import kill_9_after
from tests.small_disk import small_disk

TINY = [
    "--data.synthetic.cardinalities=[50,300,2000]",
    "--data.synthetic.bag_sizes=[1,3,1]",
    "--data.synthetic.num_dense=3",
    "--data.synthetic.num_train_samples=8192",
    "--data.synthetic.num_valid_samples=1024",
    "--data.synthetic.num_test_samples=2048",
    "--train.batch_size=512",
    "--train.log_every_steps=4",
    "--train.eval_every_steps=8",
    "--train.progress_bar=false",
    "--model.dense_arch_layer_sizes=[8,16]",
    "--model.over_arch_layer_sizes=[16,1]",
]
DISK = [
    "--model.storage.tier=disk",
    "--model.storage.min_rows=200",
    "--model.storage.cache_rows=900",
]


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir) -> dict[tuple[str, int], float]:
    out = {}
    for e in events(run_dir):
        if e["split"] in ("train", "test", "valid"):
            out[(e["split"], e["step"])] = e.get("loss", e.get("auc"))
    return out


@pytest.fixture(scope="module")
def tiered_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiered")
    config = load_config(None, [*TINY, *DISK, f"--run.dir={run_dir}", "--checkpoint.every_steps=8"])
    return train(config), run_dir


def test_counters_are_logged(tiered_run):
    _, run_dir = tiered_run
    train_events = [e for e in events(run_dir) if e["split"] == "train"]
    assert train_events
    for e in train_events:
        assert 0 <= e["tiered/t_cat_2/hit_rate"] <= 1
        assert e["tiered/t_cat_2/cache_rows"] == 900
        assert "tiered/t_cat_0/hit_rate" not in e  # 50 rows: below min_rows, on the device
    assert any(e["tiered/t_cat_2/written_back_per_step"] > 0 for e in train_events)
    assert (run_dir / "tables" / "t_cat_2.rows").is_file()


def test_resume_is_bitwise(tiered_run, tmp_path):
    _, run_dir = tiered_run
    overrides = [*TINY, *DISK, f"--run.dir={tmp_path}", "--checkpoint.every_steps=8"]
    train(load_config(None, [*overrides, "--train.max_steps=8"]))
    train(load_config(None, [*overrides, "--checkpoint.resume=latest"]))
    full, resumed = losses(run_dir), losses(tmp_path)
    after = [key for key in full if key[1] > 8]
    assert after
    for key in after:
        assert full[key] == resumed[key], key


def test_tiered_matches_in_memory_run(tiered_run, tmp_path):
    """The same tables on the device (lazily initialized the same way: a dynamic collection
    with every table dynamic would differ in init, so compare with a host tier whose cache
    holds every row)."""
    _, run_dir = tiered_run
    big_cache = [*TINY, "--model.storage.tier=host", "--model.storage.min_rows=200"]
    train(
        load_config(None, [*big_cache, "--model.storage.cache_rows=4096", f"--run.dir={tmp_path}"])
    )
    full, whole = losses(run_dir), losses(tmp_path)
    for key in whole:
        assert full[key] == whole[key], key


def test_storage_config_errors_are_named(tmp_path):
    with pytest.raises(ValueError, match="model.storage.overrides entry 'cat_9.tier=disk'"):
        train(
            load_config(
                None,
                [
                    *TINY,
                    *DISK,
                    f"--run.dir={tmp_path}",
                    "--model.storage.overrides=['cat_9.tier=disk']",
                ],
            )
        )
    with pytest.raises(ValueError, match="fused embedding update"):
        train(
            load_config(
                None,
                [*TINY, *DISK, f"--run.dir={tmp_path}", "--train.fused_embedding_update=false"],
            )
        )


def test_caches_smaller_than_a_batch_grow_train_bitwise_and_resume_after_kill_9(
    tiered_run, tmp_path, capsys
):
    """Caches of 100 rows where a batch touches up to 300 (t_cat_1) and 512 (t_cat_2) rows:
    the run says so, grows them, and trains bitwise as the 900-row caches of ``tiered_run``
    (which train as the tables held whole); killed after its checkpoint of step 8, it
    resumes bitwise."""
    _, run_dir = tiered_run
    small = [*TINY, *DISK, "--model.storage.cache_rows=100", "--checkpoint.every_steps=8"]
    train(load_config(None, [*small, f"--run.dir={tmp_path / 'a'}"]))
    assert (
        "model.storage: 2 tiered table cache(s) smaller than a worst-case batch of 512 x 1 "
        "rank(s): 't_cat_1' caches 100 rows of up to 300 (every row it holds); 't_cat_2' "
        "caches 100 rows of up to 512 (512 samples x 1 id(s))"
    ) in capsys.readouterr().out
    assert losses(tmp_path / "a") == losses(run_dir)
    steps = [e for e in events(tmp_path / "a") if e["split"] == "train"]
    assert sum(e["tiered/t_cat_2/cache_grown"] for e in steps) > 0
    assert steps[-1]["tiered/t_cat_2/cache_rows"] > 100

    command = [sys.executable, "-m", "recsys", "train", *small, f"--run.dir={tmp_path / 'b'}"]
    kill_9_after(command, tmp_path / "b" / "checkpoints" / "step_00000008")
    train(load_config(None, [*small, f"--run.dir={tmp_path / 'b'}", "--checkpoint.resume=latest"]))
    assert losses(tmp_path / "b") == losses(run_dir)


def test_load_model_reads_tiered_rows_without_touching_the_run(tiered_run):
    result, run_dir = tiered_run
    rows_file = run_dir / "tables" / "t_cat_2.rows"
    before = rows_file.read_bytes()
    model = load_model(result.checkpoint)
    assert rows_file.read_bytes() == before  # the run's own store is left alone
    collection = tiered_collections(model)[0]
    private = collection.storage["t_cat_2"]  # on disk still, in a directory of the model's own
    assert private.tier == "disk" and not Path(private.path).is_relative_to(run_dir)
    assert Path(private.path, "t_cat_2.rows").is_file()
    stored = sum(len(keys) for keys, _ in collection.caches["t_cat_2"].store.items(1 << 16))
    saved = json.loads((result.checkpoint / "tiered.t_cat_2.json").read_text())["rows"]
    assert stored == saved > 0


def test_evaluate_scores_a_tiered_checkpoint_as_the_run_did(tiered_run):
    result, run_dir = tiered_run
    rows_file = run_dir / "tables" / "t_cat_2.rows"
    before = rows_file.read_bytes()
    scored = evaluate_checkpoint(result.checkpoint, split="test")
    assert rows_file.read_bytes() == before
    (test,) = [e for e in events(run_dir) if e["split"] == "test"]
    assert scored.metrics["auc"] == pytest.approx(test["auc"], abs=1e-6)


def test_fine_tuning_loads_the_tiered_rows(tiered_run, tmp_path):
    result, _ = tiered_run
    config = load_config(
        None,
        [*TINY, *DISK, f"--run.dir={tmp_path}", f"--checkpoint.init_from={result.checkpoint}"],
    )
    spec = build_dataset(config.data, config.run.seed).spec
    model = setup_model(config, spec, torch.device("cpu"), 1, tmp_path, None, lambda line: None)
    cache = tiered_collections(model)[0].caches["t_cat_2"]
    saved = json.loads((result.checkpoint / "tiered.t_cat_2.json").read_text())["rows"]
    assert sum(len(keys) for keys, _ in cache.store.items(1 << 16)) == saved > 0
    # The checkpoint's weights; the optimizer state starts fresh, as for in-memory tables.
    trained = load_model(result.checkpoint)
    original = tiered_collections(trained)[0].caches["t_cat_2"].store
    weights = cache.codec.widths[0]
    for (keys, records), (saved_keys, saved_records) in zip(
        cache.store.items(1 << 16), original.items(1 << 16), strict=True
    ):
        assert torch.equal(keys, saved_keys)
        assert torch.equal(records[:, :weights], saved_records[:, :weights])
        assert torch.equal(records[:, weights:], cache.fresh(keys)[:, weights:])
        assert not torch.equal(records[:, weights:], saved_records[:, weights:])


def test_evaluation_batches_larger_than_the_cache_are_scored_in_pieces(tmp_path):
    """The cache holds a training batch (512 ids of t_cat_2), not an evaluation batch of 4096
    samples: evaluation pools it in pieces, scoring as a cache of every row does."""
    larger = [
        "--data.synthetic.num_valid_samples=4096",
        "--train.eval_batch_size=4096",
        "--train.max_steps=8",
    ]
    scores = {}
    for cache in (600, 2000):
        run_dir = tmp_path / str(cache)
        train(
            load_config(
                None,
                [
                    *TINY,
                    *DISK,
                    *larger,
                    f"--run.dir={run_dir}",
                    f"--model.storage.cache_rows={cache}",
                ],
            )
        )
        scores[cache] = losses(run_dir)
    assert scores[600] == scores[2000]
    assert ("valid", 8) in scores[600]


HOLDER = """
import sys, time
from recsys.embedding.tiered.row_store import DiskRecords
records = DiskRecords(sys.argv[1], 100, 64)
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_the_same_store_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(store / "t_cat_2.rows")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        overrides = [*TINY, *DISK, f"--run.dir={tmp_path / 'run'}", f"--model.storage.path={store}"]
        with pytest.raises(ValueError, match=r"t_cat_2.rows' is in use by another run \(pid "):
            train(load_config(None, overrides))
        assert (store / "t_cat_2.rows").stat().st_size == 100 * 64  # not truncated
    finally:
        holder.kill()
        holder.wait()
    train(load_config(None, [*overrides, "--train.max_steps=2"]))  # the lock died with it


def test_a_store_path_on_a_missing_mount_is_refused(tmp_path):
    missing = tmp_path / "nvme" / "recsys"
    overrides = [*TINY, *DISK, f"--run.dir={tmp_path / 'run'}", f"--model.storage.path={missing}"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(load_config(None, overrides))
    assert not (tmp_path / "nvme").exists()


def test_a_full_disk_stops_the_run_in_one_line_with_its_checkpoint_intact(tmp_path):
    with small_disk(tmp_path / "small", "4m") as mount:
        run_dir = tmp_path / "run"
        tiny = [o.replace("[50,300,2000]", "[50,300,200000]") for o in TINY]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "recsys",
                "train",
                *tiny,
                *DISK,
                f"--run.dir={run_dir}",
                f"--model.storage.path={mount / 'store'}",
                "--checkpoint.every_steps=1",
                "--train.eval_every_steps=0",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])  # not 135: SIGBUS
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("recsys")]
    assert line.startswith("recsys: error: no space left on tmpfs (mounted at ")
    assert f" for '{mount / 'store'}/t_cat_2.rows' (needs " in line
    latest, _ = find_resumable(run_dir)
    assert latest is not None and int(latest.name.removeprefix("step_")) >= 1
    verify_checkpoint(latest)
    # The run goes on from it on a disk with room.
    resumed = [*tiny, *DISK, f"--run.dir={run_dir}", f"--model.storage.path={tmp_path / 'big'}"]
    result = train(load_config(None, [*resumed, "--checkpoint.resume=latest"]))
    assert result.steps == 16
