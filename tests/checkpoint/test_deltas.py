"""Deltas of dynamic tables in a run (checkpoint.delta_every_steps): a base checkpoint or export
plus the deltas after it reproduce the final tables exactly, through evictions and expiry; an
interrupted delta is never applied, a gap in the chain is an error, a resume removes the deltas
the run it continues wrote after its checkpoint."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys.checkpoint.delta_writer import write_delta
from recsys.checkpoint.deltas import (
    DeltaBase,
    DeltaInfo,
    apply_deltas,
    checkpoint_base,
    delta_chain,
    dynamic_table_rows,
    list_deltas,
    read_delta,
    replay_deltas,
)
from recsys.checkpoint.io import CHECKSUMS_FILE, list_checkpoints, load_model
from recsys.checkpoint.lineage import LINEAGE_FILE, Lineage, Session, read_lineage
from recsys.cli import main
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.batch import Batch
from recsys.data.loader import BatchLoader
from recsys.embedding.interface import TableDelta
from recsys.ops.slot_map.hash_map import bucket_of
from recsys.serve.export import export_model, load_exported, predict
from recsys.serve.exported_deltas import apply_exported_deltas
from recsys.train.trainer import train

TINY = [
    "--data.synthetic.cardinalities=[50,300,2000]",
    "--data.synthetic.bag_sizes=[1,3,1]",
    "--data.synthetic.num_dense=3",
    "--data.synthetic.num_train_samples=1536",
    "--data.synthetic.num_valid_samples=256",
    "--data.synthetic.num_test_samples=512",
    "--data.synthetic.id_encoding=raw",
    "--train.batch_size=128",
    "--train.log_every_steps=4",
    "--train.progress_bar=false",
    "--model.embedding_dim=8",
    "--model.dense_arch_layer_sizes=[16,8]",
    "--model.over_arch_layer_sizes=[16,1]",
    # Only the tables train: a delta carries them, not the dense layers.
    '--checkpoint.freeze=["dense_arch", "over_arch"]',
    "--model.dynamic.initial_capacity=32",
    "--model.dynamic.bucket_size=16",
    "--model.dynamic.max_capacity=256",  # cat_1 and cat_2 evict
    '--model.dynamic.overrides=["cat_0.ttl_steps=3"]',  # cat_0 expires
    "--checkpoint.every_steps=4",
    "--checkpoint.delta_every_steps=3",
    "--checkpoint.keep=0",
    "--run.device=cpu",
]
STEPS = 12  # checkpoints at 4, 8, 12; deltas every 3 steps and at every checkpoint
DELTAS = [(3, 0), (4, 3), (6, 4), (8, 6), (9, 8), (12, 9)]  # (step, since)


def _checkpoint(run_dir, step: int):
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(config overrides, TrainResult, run dir) of a raw-id run with deltas."""
    run_dir = tmp_path_factory.mktemp("deltas") / "run"
    overrides = [*TINY, f"--run.dir={run_dir}"]
    return overrides, train(load_config(None, overrides)), run_dir


def _assert_same_tables(got, expected):
    assert sorted(got) == sorted(expected)
    for name, (keys, rows) in expected.items():
        assert torch.equal(got[name][0], keys), name
        assert torch.equal(got[name][1], rows), name


def test_base_and_deltas_reproduce_the_final_tables(run):
    _, result, run_dir = run
    assert result.steps == STEPS
    final = dynamic_table_rows(load_model(result.checkpoint))
    for base in (4, 8, 12):
        _assert_same_tables(apply_deltas(_checkpoint(run_dir, base), run_dir / "deltas"), final)
    _assert_same_tables(apply_deltas(_checkpoint(run_dir, 4), run_dir), final)  # the run dir
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in events if e["split"] == "train"][-1]
    assert last["dynamic/t_cat_2/evictions"] > 0 and last["dynamic/t_cat_0/expirations"] > 0
    deltas = [e for e in events if e["split"] == "delta"]
    assert [(e["step"], e["since"]) for e in deltas] == DELTAS
    for event, info in zip(deltas, list_deltas(run_dir / "deltas"), strict=True):
        assert event["rows"] == sum(t["rows"] for t in info.tables.values()) > 0
        assert event["deletions"] == sum(t["deletions"] for t in info.tables.values())
        assert event["bytes"] == sum(p.stat().st_size for p in info.path.glob("*.parquet"))
    assert sum(e["deletions"] for e in deltas) > 0


def test_delta_files_follow_the_documented_format(run):
    _, _, run_dir = run
    assert sorted(p.name for p in (run_dir / "deltas").iterdir()) == [
        f"step_{s:08d}" for s, _ in DELTAS
    ]
    directory = run_dir / "deltas" / "step_00000009"
    manifest = json.loads((directory / "delta.json").read_text())
    assert (manifest["format"], manifest["version"]) == ("recsys-delta", 1)
    assert (manifest["step"], manifest["since"], manifest["world_size"]) == (9, 8, 1)
    entry = manifest["tables"]["t_cat_2"]
    assert entry["dim"] == 8 and entry["deletions"] > 0
    rows = pq.read_table(directory / "t_cat_2.rank00000.rows.parquet")
    assert rows.schema.types == [pa.int64(), pa.int64(), pa.list_(pa.float32(), 8)]
    assert rows.column_names == ["key", "step", "values"] and rows.num_rows == entry["rows"]
    assert set(rows.column("step").to_pylist()) == {9}
    deleted = pq.read_table(directory / "t_cat_2.rank00000.deleted.parquet")
    assert deleted.column_names == ["key"] and deleted.num_rows == entry["deletions"]
    delta = read_delta(list_deltas(run_dir / "deltas")[4])["t_cat_2"]
    assert delta.keys.tolist() == sorted(rows.column("key").to_pylist())
    assert not set(delta.keys.tolist()) & set(delta.deleted.tolist())


def test_an_interrupted_delta_is_ignored(run, tmp_path):
    _, _, run_dir = run
    deltas = tmp_path / "deltas"
    shutil.copytree(run_dir / "deltas", deltas)
    (deltas / ".tmp-step_00000015").mkdir()  # a write in progress, or crashed
    (deltas / ".tmp-step_00000015" / "t_cat_0.rank00000.rows.parquet").write_bytes(b"PAR1")
    (deltas / "step_00000012" / "delta.json").unlink()  # never committed
    with pytest.warns(UserWarning, match="step_00000012' ignored: no delta.json"):
        assert [d.step for d in list_deltas(deltas)] == [3, 4, 6, 8, 9]
    base_path = _checkpoint(run_dir, 8)
    base = load_model(base_path)
    with pytest.warns(UserWarning, match="step_00000012' ignored"):
        _, step = replay_deltas(dynamic_table_rows(base), checkpoint_base(base_path), deltas)
    assert step == 9  # not 12
    shutil.rmtree(deltas / "step_00000012")
    part = deltas / "step_00000009" / "t_cat_2.rank00000.rows.parquet"
    part.write_bytes(part.read_bytes()[:-10])  # truncated: not the size the manifest says
    with pytest.warns(UserWarning, match="step_00000009' ignored: 't_cat_2.rank00000.rows"):
        assert [d.step for d in list_deltas(deltas)] == [3, 4, 6, 8]


def test_a_gap_in_the_chain_is_an_error(run, tmp_path):
    _, _, run_dir = run
    deltas = tmp_path / "deltas"
    shutil.copytree(run_dir / "deltas", deltas)
    shutil.rmtree(deltas / "step_00000006")
    message = (
        "after base step 4, the next delta 'step_00000008' holds the changes of steps 7..8, "
        "so those of steps 5..6 are missing"
    )
    with pytest.raises(ValueError, match=message):
        apply_deltas(_checkpoint(run_dir, 4), deltas)
    shutil.rmtree(deltas / "step_00000009")  # a later base: 12 starts at 9, after step 8
    with pytest.raises(ValueError, match="after base step 8, .*'step_00000012'"):
        apply_deltas(_checkpoint(run_dir, 8), deltas)


RUN = Lineage("0123456789abcdef", (Session("00000000000000aa", 0),))


def _info(step: int, since: int) -> DeltaInfo:
    return DeltaInfo(Path(f"step_{step:08d}"), step, since, 1, {}, RUN)


def _base(step: int) -> DeltaBase:
    return DeltaBase("base", step, RUN)


def test_the_chain_starts_at_or_before_the_base_and_has_no_gap():
    deltas = [_info(3, 0), _info(6, 3), _info(9, 6)]
    for base, steps in [(0, [3, 6, 9]), (2, [3, 6, 9]), (3, [6, 9]), (5, [6, 9]), (9, [])]:
        assert [d.step for d in delta_chain(deltas, _base(base))] == steps
    with pytest.raises(ValueError, match="after base step 2, .*'step_00000009'.*steps 3..6 are"):
        delta_chain([_info(9, 6)], _base(2))
    with pytest.raises(ValueError, match="after delta step 6, .*'step_00000009' .*steps 7..7"):
        delta_chain([_info(3, 0), _info(6, 3), _info(9, 7)], _base(0))
    with pytest.raises(ValueError, match="do not chain: after delta step 3, .* since step 2,"):
        delta_chain([_info(3, 0), _info(9, 2)], _base(0))  # overlapping: of two runs


def test_resume_removes_the_stale_deltas_and_continues_the_chain(run, exported, tmp_path, capsys):
    overrides, result, run_dir = run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    old_8 = shutil.copytree(_checkpoint(copy, 8), tmp_path / "old_step_8")  # the first branch's
    (copy / "deltas" / "step_00000006" / "stale").write_text("written by the crashed run")
    (copy / "deltas" / ".tmp-step_00000015").mkdir()
    resume = [f"--run.dir={copy}", f"--checkpoint.resume={_checkpoint(copy, 4)}"]
    train(load_config(None, [*overrides, *resume]))
    assert "removed 4 stale delta(s) after step 4" in capsys.readouterr().out
    assert sorted(p.name for p in (copy / "deltas").iterdir()) == [
        f"step_{s:08d}" for s, _ in DELTAS
    ]
    assert not (copy / "deltas" / "step_00000006" / "stale").exists()
    # Written again, the first one after the resume starting at its step, 4.
    assert [(d.step, d.since) for d in list_deltas(copy / "deltas")] == DELTAS
    final = dynamic_table_rows(load_model(result.checkpoint))  # the resume is bitwise
    for base in (4, 8):
        _assert_same_tables(apply_deltas(_checkpoint(copy, base), copy / "deltas"), final)
    # The deltas of the first session (up to step 4) and of the resumed one: one run, the second
    # session appended at step 4; checkpoint 8 is the resumed session's.
    first = read_lineage(_checkpoint(copy, 4))
    lineages = [d.lineage for d in list_deltas(copy / "deltas")]
    assert lineages[:2] == [first, first] and len(set(lineages[2:])) == 1
    resumed = lineages[2]
    assert (resumed.run_id, resumed.sessions[0]) == (first.run_id, first.sessions[0])
    assert [s.from_step for s in resumed.sessions] == [0, 4]
    assert read_lineage(_checkpoint(copy, 8)) == resumed
    # A base of step 8 of the first branch: the resumed branch trained steps 5..8 again.
    session, run_id = resumed.sessions[1].id, first.run_id
    refused = (
        f"delta '{copy / 'deltas' / 'step_00000009'}' (run {run_id}, step 9) does not continue "
        f"base '{old_8}' (run {run_id}, step 8): the delta's branch of run {run_id} resumed from "
        f"step 4 (session {session}), before step 8"
    )
    with pytest.raises(ValueError, match=re.escape(refused)):
        apply_deltas(old_8, copy / "deltas")
    base, _, _ = exported  # an export of the first branch's step 8
    with pytest.raises(ValueError, match=re.escape(f"base '{base}' (run {run_id}, step 8)")):
        load_exported(base, deltas=copy)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """(base export of step 8, final export, test split of the run)."""
    overrides, result, run_dir = run
    directory = tmp_path_factory.mktemp("exports")
    base = export_model(_checkpoint(run_dir, 8), directory / "base.pt2")
    final = export_model(result.checkpoint, directory / "final.pt2")
    config = load_config(None, overrides)
    test = Batch.concat(list(BatchLoader(build_dataset(config.data, config.run.seed), "test", 512)))
    return base, final, test


def _write_parquet(batch: Batch, path) -> None:
    """The test split as predict reads it: cat_1 (bags of up to 3 raw ids) as a list column."""
    lengths = batch.sparse.lengths().view(3, -1).numpy()
    values = batch.sparse.values().split(batch.sparse.length_per_key())
    columns = {f"int_{j}": batch.dense[:, j].numpy() for j in range(batch.dense.shape[1])}
    for f in range(3):
        ids = values[f].numpy()
        if f == 1:
            offsets = np.concatenate([[0], np.cumsum(lengths[f])]).astype(np.int32)
            columns[f"cat_{f}"] = pa.ListArray.from_arrays(offsets, ids)
        else:
            columns[f"cat_{f}"] = ids
    pq.write_table(pa.table(columns), path, row_group_size=200)


def test_predict_with_deltas_equals_the_final_model(run, exported, tmp_path, capsys):
    _, _, run_dir = run
    base, final, test = exported
    tables = _dynamic(base)["tables"]  # rows in the program's packed matrix of all tables
    assert tables and all(
        t["rows"].endswith("packed") and "first_row" in t for t in tables.values()
    )
    _write_parquet(test, tmp_path / "test.parquet")
    expected = predict(final, tmp_path / "test.parquet", tmp_path / "final.parquet")
    argv = ["predict", "--model", str(base), "--input", str(tmp_path / "test.parquet")]
    # The run directory names its deltas directory.
    argv += ["--deltas", str(run_dir), "--output", str(tmp_path / "scores.parquet")]
    assert main(argv) == 0
    assert "dynamic tables at step 12" in capsys.readouterr().out
    (column,) = expected.columns
    scores = pq.read_table(tmp_path / "scores.parquet").column(column).to_numpy()
    reference = pq.read_table(expected.output).column(column).to_numpy()
    assert len(scores) == 512 and np.array_equal(scores, reference)


def _outgrowing_delta(directory, keys: torch.Tensor, lineage: Lineage) -> None:
    """A delta after step 8 of the run of ``lineage`` giving table t_cat_0 the rows of
    ``keys``."""
    rows = torch.randn(len(keys), 8)
    empty = torch.zeros(0, dtype=torch.int64)
    tables = {"t_cat_0": TableDelta(keys, rows, keys * 0 + 9, empty)}
    write_delta(directory, 9, 8, tables, lineage)


def test_deltas_that_outgrow_the_exported_map_are_an_error(exported, tmp_path):
    base, _, _ = exported
    model, _ = load_exported(base)
    info = json.loads(_archive_member(base, "dynamic.json"))
    table = info["tables"]["t_cat_0"]
    capacity = table["num_buckets"] * table["bucket_size"]
    lineage = Lineage.from_json(info["lineage"])
    _outgrowing_delta(tmp_path / "many", torch.arange(10**9, 10**9 + capacity + 1), lineage)
    with pytest.raises(ValueError, match=f"'t_cat_0'.*map of {capacity} slots.*needs at least"):
        apply_exported_deltas(model, info, tmp_path / "many", base)
    candidates = torch.arange(10**9, 10**9 + 100 * capacity)
    one_bucket = candidates[bucket_of(candidates, table["num_buckets"]) == 0]
    _outgrowing_delta(tmp_path / "bucket", one_bucket[: table["bucket_size"] + 1], lineage)
    with pytest.raises(ValueError, match="'t_cat_0'.*do not fit its buckets"):
        apply_exported_deltas(model, info, tmp_path / "bucket", base)


def _archive_member(path, name: str) -> str:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        (member,) = [n for n in archive.namelist() if n.endswith(f"/extra/{name}")]
        return archive.read(member).decode()


def test_delta_every_steps_is_validated():
    with pytest.raises(ValueError, match="delta_every_steps"):
        load_config(None, ["--checkpoint.delta_every_steps=-1"])


def test_deltas_without_a_dynamic_table_are_an_error(tmp_path):
    fixed = [o for o in TINY if "dynamic" not in o and "id_encoding" not in o]
    config = load_config(None, [*fixed, f"--run.dir={tmp_path}"])
    with pytest.raises(ValueError, match="delta_every_steps = 3, but the model has no dynamic"):
        train(config)


# ---------------------------------------------------------------------------------- lineage


@pytest.fixture(scope="module")
def other_run(run, tmp_path_factory):
    """(run dir, export of step 4) of run B: run A's config, another seed, 8 steps."""
    overrides, _, _ = run
    run_dir = tmp_path_factory.mktemp("other") / "run"
    config = [*overrides, f"--run.dir={run_dir}", "--run.seed=7", "--train.max_steps=8"]
    train(load_config(None, config))
    return run_dir, export_model(_checkpoint(run_dir, 4), run_dir.parent / "b.pt2")


def test_deltas_of_another_run_are_refused(run, other_run, tmp_path, capsys):
    _, _, run_a = run
    run_b, export_b = other_run
    id_a, id_b = (read_lineage(_checkpoint(d, 4)).run_id for d in (run_a, run_b))
    assert id_a != id_b
    delta = f"delta '{run_a / 'deltas' / 'step_00000006'}' (run {id_a}, step 6) does not continue"
    with pytest.raises(ValueError) as refused:
        apply_deltas(_checkpoint(run_b, 4), run_a / "deltas")
    assert str(refused.value) == (
        f"{delta} base '{_checkpoint(run_b, 4)}' (run {id_b}, step 4): they are of different "
        "runs; apply a run's deltas to a checkpoint or export of that same run"
    )
    with pytest.raises(ValueError, match=re.escape(f"{delta} base '{export_b}' (run {id_b}")):
        load_exported(export_b, deltas=run_a)
    argv = ["predict", "--model", str(export_b), "--input", str(tmp_path / "in.parquet")]
    argv += ["--deltas", str(run_a / "deltas"), "--output", str(tmp_path / "out.parquet")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"recsys: error: {delta} base '{export_b}' (run {id_b}, step 4)")
    assert error.count("\n") == 1 and not (tmp_path / "out.parquet").exists()
    model_b = load_exported(export_b)[0]
    assert apply_exported_deltas(model_b, _dynamic(export_b), run_b, export_b) == 8  # its own


def _dynamic(export) -> dict:
    return json.loads(_archive_member(export, "dynamic.json"))


def test_a_deltas_path_must_be_a_deltas_or_run_directory(run, exported, tmp_path, capsys):
    _, _, run_dir = run
    base, _, _ = exported
    checkpoints = run_dir / "checkpoints"
    with pytest.raises(ValueError, match=re.escape(f"'{checkpoints}' is not a deltas directory")):
        apply_deltas(_checkpoint(run_dir, 4), checkpoints)
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = ["predict", "--model", str(base), "--input", str(tmp_path / "in.parquet")]
    argv += ["--deltas", str(empty), "--output", str(tmp_path / "out.parquet")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"recsys: error: '{empty}' is not a deltas directory: it holds no delta (step_<N>/ "
        "folders with a delta.json) and no deltas/ folder; give the deltas directory (<run dir>/"
        "deltas) or the run directory of a run trained with checkpoint.delta_every_steps > 0\n"
    )
    (empty / "deltas").mkdir()  # a run that has written no delta yet: the base as it is
    assert apply_exported_deltas(load_exported(base)[0], _dynamic(base), empty, base) == 8


def test_a_fine_tuned_run_is_a_new_run(run, tmp_path):
    overrides, _, run_dir = run
    parent = read_lineage(_checkpoint(run_dir, 4))
    child_dir = tmp_path / "child"
    start = [f"--checkpoint.init_from={_checkpoint(run_dir, 4)}", "--train.max_steps=8"]
    train(load_config(None, [*overrides, f"--run.dir={child_dir}", *start]))
    child = read_lineage(_checkpoint(child_dir, 8))
    assert child.run_id != parent.run_id and child.parent == (parent.run_id, 4)
    assert [s.from_step for s in child.sessions] == [0]
    # Its deltas chain on the parent's steps (6 since 4, ...), but are not of the parent's run.
    with pytest.raises(ValueError, match=f"run {child.run_id}, step 6.*they are of different runs"):
        apply_deltas(_checkpoint(run_dir, 4), child_dir)


def _strip_lineage(run_dir) -> None:
    """``run_dir`` as a recsys before lineages wrote it: no lineage in checkpoints or deltas."""
    for checkpoint in list_checkpoints(run_dir / "checkpoints"):
        (checkpoint / LINEAGE_FILE).unlink()
        sums = json.loads((checkpoint / CHECKSUMS_FILE).read_text())
        del sums["files"][LINEAGE_FILE]
        (checkpoint / CHECKSUMS_FILE).write_text(json.dumps(sums))
    for manifest in (run_dir / "deltas").glob("step_*/delta.json"):
        fields = json.loads(manifest.read_text())
        del fields["lineage"]
        manifest.write_text(json.dumps(fields))


def test_checkpoints_and_deltas_without_lineage(run, tmp_path):
    overrides, result, run_dir = run
    old = tmp_path / "run"
    shutil.copytree(run_dir, old, symlinks=True)
    _strip_lineage(old)
    final = dynamic_table_rows(load_model(result.checkpoint))
    unchecked = "'step_00000006', 'step_00000008', 'step_00000009', 'step_00000012' to base"
    with pytest.warns(UserWarning, match=f"{unchecked} .*no lineage, step 4.*steps only"):
        _assert_same_tables(apply_deltas(_checkpoint(old, 4), old), final)
    # After a base with a lineage, a delta without one is another run's.
    with pytest.raises(ValueError, match=r"step_00000006' \(no lineage, step 6\) does not cont"):
        apply_deltas(_checkpoint(run_dir, 4), old)
    # A checkpoint without lineage resumes; the resumed session starts a run of its own.
    resume = [f"--run.dir={old}", f"--checkpoint.resume={_checkpoint(old, 8)}"]
    train(load_config(None, [*overrides, *resume]))
    lineage = read_lineage(_checkpoint(old, 12))
    assert [s.from_step for s in lineage.sessions] == [8]
    assert [d.lineage for d in list_deltas(old / "deltas")[-2:]] == [lineage, lineage]
    # Only the first delta is unchecked: the next one continues it (the same lineage).
    with pytest.warns(UserWarning, match=r"delta\(s\) 'step_00000009' to base .*, step 8\)"):
        _assert_same_tables(apply_deltas(_checkpoint(old, 8), old), final)


def test_predict_refuses_a_reserved_key_as_training_does(exported, tmp_path):
    """-2^63 is refused by training (a reserved key); predict refused nothing and scored it as
    an unknown id."""
    base, _, test = exported
    test = test.slice(0, 8)
    values = test.sparse.values().clone()
    values[0] = -(2**63)  # cat_0 of the first sample
    sparse = KeyedJaggedTensor(
        keys=test.sparse.keys(), values=values, lengths=test.sparse.lengths()
    )
    _write_parquet(Batch(test.dense, sparse, test.labels), tmp_path / "reserved.parquet")
    with pytest.raises(ValueError, match=r"contain -9223372036854775808: .* are reserved"):
        predict(base, tmp_path / "reserved.parquet", tmp_path / "scores.parquet")
    assert not (tmp_path / "scores.parquet").exists()
