"""Tables behind a cache: a model trained with tiered tables exports with those tables outside
its program, and ``recsys predict`` / ``recsys serve`` look their rows up in the row stores
through a bounded cache: the scores equal the trained model's bitwise whatever the cache size
(a cache of ~1/10 of a table included), unknown keys of dynamic tables read the zero row, the
server reports the caches' counters, and a new base switches the cached tables with its version.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys.checkpoint.io import load_model
from recsys.config import load_config
from recsys.serve.cached_tables import CachedTables
from recsys.serve.export import export_model, load_program, predict
from recsys.serve.online.requests import rows_from_json
from recsys.serve.online.served import ServedModel
from recsys.serve.triton_export import export_triton
from recsys.train.trainer import train
from tests.serve.test_server import Server, _json_scores, _samples, _v2_scores

RUN = [
    "--data.synthetic.cardinalities=[50,3000,20000]",
    "--data.synthetic.bag_sizes=[1,3,1]",
    "--data.synthetic.num_dense=3",
    "--data.synthetic.num_train_samples=1536",
    "--data.synthetic.num_valid_samples=256",
    "--data.synthetic.num_test_samples=256",
    "--train.batch_size=128",
    "--train.progress_bar=false",
    "--model.embedding_dim=8",
    "--model.dense_arch_layer_sizes=[16,8]",
    "--model.over_arch_layer_sizes=[16,1]",
    "--model.storage.tier=disk",
    "--model.storage.min_rows=1000",
    "--model.storage.cache_rows=512",
    '--model.dynamic.tables=["cat_2"]',  # cat_1's table stays fixed
    "--checkpoint.every_steps=6",
    "--checkpoint.keep=0",
    "--run.device=cpu",
]
CARDINALITIES = [50, 3000, 20000]
NUM_ROWS = 200
SMALL_CACHE = 64  # the tiered tables hold ~660 trained rows each: about 10x the cache


def _train(directory: Path, *extra: str) -> Path:
    run_dir = directory / "run"
    result = train(load_config(None, [*RUN, *extra, f"--run.dir={run_dir}"]))
    assert result.steps == 12
    return run_dir


@pytest.fixture(scope="module")
def tiered_run(tmp_path_factory):
    """(run dir, export of step 12, rows to score): cat_0's table (50 rows) in memory, cat_1's
    a fixed table and cat_2's a dynamic one, both on the disk tier."""
    tmp = tmp_path_factory.mktemp("cached")
    run_dir = _train(tmp)
    base = export_model(run_dir / "checkpoints" / "step_00000012", tmp / "base.pt2")
    rows = tmp / "rows.parquet"
    _write_rows(run_dir / "checkpoints" / "step_00000012", rows)
    return run_dir, base, rows


def _write_rows(checkpoint: Path, path: Path) -> None:
    """NUM_ROWS samples: 80% of a tiered table's ids rows the checkpoint holds, the rest any
    (mostly rows training never touched)."""
    rng = np.random.default_rng(0)
    columns = {f"int_{i}": rng.standard_normal(NUM_ROWS).astype(np.float32) for i in range(3)}
    for f, cardinality in enumerate(CARDINALITIES):
        keys = np.arange(cardinality)
        if f:
            keys = np.fromfile(checkpoint / f"tiered.t_cat_{f}.keys", dtype="<i8")
        ids = np.where(
            rng.random(NUM_ROWS * 3) < 0.8,
            rng.choice(keys, NUM_ROWS * 3),
            rng.integers(0, cardinality, NUM_ROWS * 3),
        )
        if f == 1:
            lengths = rng.integers(0, 4, NUM_ROWS)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            columns[f"cat_{f}"] = pa.ListArray.from_arrays(offsets, ids[: offsets[-1]])
        else:
            columns[f"cat_{f}"] = ids[:NUM_ROWS]
    pq.write_table(pa.table(columns), path)


def _offline(export: Path, rows: Path, out: Path, cache_rows: int | None = None) -> np.ndarray:
    predict(export, rows, out, overwrite=True, cache_rows=cache_rows)
    return pq.read_table(out).column("score_click").to_numpy()


def _batch(served_spec, rows: Path):
    return rows_from_json(_samples(rows), served_spec, max_ids=64)


def _eager(checkpoint: Path, dense, values, lengths) -> torch.Tensor:
    """The trained model itself (its tiered collection, in eval mode) on the same inputs."""
    model = load_model(checkpoint)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    keys = ["cat_0", "cat_1", "cat_2"]
    sparse = KeyedJaggedTensor(
        keys=keys, values=values, lengths=lengths, offsets=offsets, stride=dense.shape[0]
    )
    with torch.no_grad():
        return torch.sigmoid(model(dense, sparse))


def _random_inputs(cardinalities, batch_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.cat(
        [torch.randint(0, b + 1, (batch_size,), generator=generator) for b in (1, 3, 1)]
    )
    values = torch.cat(
        [
            torch.randint(0, c, (int(lengths[f * batch_size : (f + 1) * batch_size].sum()),))
            for f, c in enumerate(cardinalities)
        ]
    )
    return torch.randn(batch_size, 3, generator=generator), values, lengths


def test_tiered_tables_score_as_the_trained_model(tiered_run):
    run_dir, base, _ = tiered_run
    checkpoint = run_dir / "checkpoints" / "step_00000012"
    dense, values, lengths = _random_inputs(CARDINALITIES, 300, seed=1)
    small, _, _ = load_program(base, cache_rows=SMALL_CACHE)
    whole, _, _ = load_program(base, cache_rows=20000)
    with torch.no_grad():
        scores = small(dense, values, lengths)
        assert torch.equal(scores, whole(dense, values, lengths))
    # The trained model's own tiered lookup gives the same bits: rows the checkpoint holds,
    # a fixed table's rows training never touched (their lazy initial values), a dynamic
    # table's unknown keys (the zero row).
    assert torch.equal(scores, _eager(checkpoint, dense, values, lengths))
    stats = small.cached_tables.stats()
    assert set(stats) == {"t_cat_1", "t_cat_2"}  # cat_0 (50 rows) stays in the program
    assert stats["t_cat_1"]["rows_resident"] == SMALL_CACHE and stats["t_cat_1"]["evicted"] > 0
    assert stats["t_cat_1"]["initialized"] > 0  # fixed rows training never touched
    assert stats["t_cat_2"]["initialized"] == 0  # a dynamic table admits no key here

    bad = values.clone()
    bad[int(lengths[:300].sum())] = 3000  # the first cat_1 id; its table has 3000 rows
    with pytest.raises(ValueError, match=r"t_cat_1.*id 3000 is outside \[0, 3000\)"):
        small(dense, bad, lengths)


def test_unknown_keys_read_the_zero_row(tiered_run):
    run_dir, base, _ = tiered_run
    trained = np.fromfile(
        run_dir / "checkpoints" / "step_00000012" / "tiered.t_cat_2.keys", dtype="<i8"
    )
    unknown = [k for k in range(20000) if k not in set(trained.tolist())][:2]
    module, _, _ = load_program(base, cache_rows=SMALL_CACHE)
    dense = torch.randn(2, 3)
    values = torch.tensor([1, 2, 3, 4, *unknown])  # cat_0 x2, cat_1 x2, cat_2 x2 (unknown)
    with torch.no_grad():
        scores = module(dense, values, torch.ones(6, dtype=torch.int64))
        empty = module(dense, values[:4], torch.tensor([1, 1, 1, 1, 0, 0]))
    assert torch.equal(scores, empty)  # a bag of the zero row pools to zeros, as an empty one


def test_a_cache_a_tenth_of_the_tables_scores_as_predict(tiered_run, tmp_path):
    run_dir, base, rows = tiered_run
    checkpoint = run_dir / "checkpoints" / "step_00000012"
    stored = {
        f"t_cat_{f}": len(np.fromfile(checkpoint / f"tiered.t_cat_{f}.keys", dtype="<i8"))
        for f in (1, 2)
    }
    assert stored["t_cat_1"] >= 9 * SMALL_CACHE and stored["t_cat_2"] >= 9 * SMALL_CACHE
    expected = _offline(base, rows, tmp_path / "whole.parquet", cache_rows=4096)
    np.testing.assert_array_equal(
        _offline(base, rows, tmp_path / "small.parquet", cache_rows=SMALL_CACHE), expected
    )
    served = ServedModel(base, cache_rows=SMALL_CACHE)
    batch = _batch(served.spec, rows)
    for _ in range(2):
        scores, step = served.score(batch.dense, batch.lengths, batch.values)
        assert step == 12
        np.testing.assert_array_equal(scores[:, 0], expected)
    stats = served.cache_stats()
    assert stats["t_cat_1"]["rows_resident"] == SMALL_CACHE and stats["t_cat_1"]["evicted"] > 0
    assert stats["t_cat_2"]["rows_resident"] == SMALL_CACHE and stats["t_cat_2"]["evicted"] > 0


@pytest.mark.slow
def test_server_with_a_cache_a_tenth_of_the_tables(tiered_run, tmp_path):
    run_dir, base, rows = tiered_run
    checkpoint = run_dir / "checkpoints" / "step_00000012"
    stored = {
        f"t_cat_{f}": len(np.fromfile(checkpoint / f"tiered.t_cat_{f}.keys", dtype="<i8"))
        for f in (1, 2)
    }
    expected = _offline(base, rows, tmp_path / "whole.parquet", cache_rows=4096)
    server = Server(tmp_path, "--model", str(base), "--cache-rows", str(SMALL_CACHE))
    try:
        samples = _samples(rows)
        for _ in range(3):  # one request of every row: predict's scores, bitwise
            scores, step = _v2_scores(server, samples)
            assert step == 12 and np.array_equal(scores, expected)
        # Concurrent one-row requests (merged into batches, whose lookups share the caches):
        # each within 1e-6 (another batch size may sum the MLP's products in another order).
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda s: _json_scores(server, s), samples))
        np.testing.assert_allclose([r[0][0] for r in results], expected, rtol=0, atol=1e-6)
        metrics = _cache_metrics(server.metrics())
        for table in stored:
            counters = metrics[table]
            assert counters["capacity_rows"] == SMALL_CACHE
            assert 0 < counters["rows_resident"] <= min(SMALL_CACHE, stored[table])
            assert counters["hits"] + counters["misses"] == counters["lookups"] > 0
            assert counters["hit_rate"] == pytest.approx(counters["hits"] / counters["lookups"])
        for table in ("t_cat_1", "t_cat_2"):  # ~10x their caches: full, evicting
            assert metrics[table]["rows_resident"] == SMALL_CACHE
            assert metrics[table]["evictions"] > 0
        print({t: round(m["hit_rate"], 3) for t, m in metrics.items()})
        assert server.stop() == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()


def _cache_metrics(text: str) -> dict[str, dict[str, float]]:
    """recsys_serve_cache_<name>{table="t"} value -> {t: {name: value}}."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("recsys_serve_cache_"):
            name, _, value = line.partition(" ")
            metric, _, label = name.partition("{")
            table = label.split('"')[1]
            out.setdefault(table, {})[metric.removeprefix("recsys_serve_cache_")] = float(value)
    return out


@pytest.mark.slow
def test_a_new_base_switches_the_cached_tables_with_its_version(tiered_run, tmp_path):
    run_dir, _, rows = tiered_run
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for step in ("step_00000006", "step_00000012"):
        shutil.copytree(run_dir / "checkpoints" / step, checkpoints / step)
    (checkpoints / "latest").symlink_to("step_00000006")
    served = ServedModel(checkpoints, cache_rows=SMALL_CACHE)
    batch = _batch(served.spec, rows)
    first = served.version
    before, step = served.score(batch.dense, batch.lengths, batch.values)
    assert step == 6
    (checkpoints / "latest").unlink()
    (checkpoints / "latest").symlink_to("step_00000012")
    served.refresh()
    assert served.step == 12 and served.num_bases == 2
    assert served.version.module.cached_tables is not first.module.cached_tables
    export = export_model(checkpoints / "step_00000012", tmp_path / "step12.pt2")
    after, step = served.score(batch.dense, batch.lengths, batch.values)
    assert step == 12
    np.testing.assert_array_equal(after[:, 0], _offline(export, rows, tmp_path / "12.parquet"))
    # A request that started on the old version finishes on it: its program still reads the
    # step-6 tables through their own cache.
    lengths = torch.from_numpy(batch.lengths)
    feature = torch.arange(3).repeat(len(batch))
    order = torch.argsort(torch.repeat_interleave(feature, lengths.reshape(-1)), stable=True)
    with torch.no_grad():
        old = first.module(
            torch.from_numpy(batch.dense),
            torch.from_numpy(batch.values)[order],
            lengths.t().reshape(-1),
        )
    np.testing.assert_array_equal(old.numpy(), before)
    assert not np.array_equal(before, after)


def test_deltas_and_bad_options_are_refused(tiered_run, tmp_path):
    # Training writes no deltas for tiered tables (they change with a new base): a deltas
    # directory for such an export is refused, naming why.
    _, base, _ = tiered_run
    deltas = tmp_path / "deltas"
    deltas.mkdir()
    with pytest.raises(ValueError, match="no deltas for tiered tables, which change with a new"):
        ServedModel(base, deltas=deltas)
    module, spec, _ = load_program(base)
    with pytest.raises(ValueError, match="cache_rows must be >= 1, got 0"):
        CachedTables(module.cached_tables.info, list(spec.sparse_names), cache_rows=0)


def test_a_triton_export_is_refused(tiered_run, tmp_path):
    run_dir, _, _ = tiered_run
    with pytest.raises(ValueError, match="Triton cannot serve them"):
        export_triton(run_dir, tmp_path / "models")
    assert not (tmp_path / "models" / "recsys").exists()


def test_the_export_keeps_its_rows_when_the_checkpoint_is_rotated_away(tiered_run, tmp_path):
    """The export links its tiered tables' rows beside it (``<export>.tables/``): the
    checkpoint deleted, as ``checkpoint.keep`` rotation deletes it, the export still loads and
    scores as before; without that directory the error names it."""
    run_dir, base, rows = tiered_run
    checkpoint = shutil.copytree(run_dir / "checkpoints" / "step_00000012", tmp_path / "step_12")
    export = export_model(checkpoint, tmp_path / "out" / "model.pt2")
    beside = tmp_path / "out" / "model.pt2.tables"
    assert sorted(p.name for p in beside.iterdir()) == sorted(
        p.name for p in checkpoint.glob("tiered.*")
    )
    shutil.rmtree(checkpoint)  # rotated away
    expected = _offline(base, rows, tmp_path / "expected.parquet")
    assert np.array_equal(_offline(export, rows, tmp_path / "kept.parquet"), expected)
    shutil.rmtree(beside)
    with pytest.raises(FileNotFoundError, match="keep the '<export>.tables' directory"):
        load_program(export)
