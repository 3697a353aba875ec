"""The run directory rule (recsys/train/run_dir.py): what counts as another run, the error
that refuses it, and what overwriting deletes. Through the trainer: test_run_safety.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.config import load_config, names_its_run
from recsys.train.run_dir import (
    check_run_dir,
    clear_previous_run,
    fresh_start_note,
    previous_run,
    unused_run_dir,
)


def events(*pairs: tuple[str, int]) -> str:
    return "".join(json.dumps({"split": s, "step": n, "time": 0.0}) + "\n" for s, n in pairs)


@pytest.fixture
def old_run(tmp_path):
    """A run directory holding another run: two committed checkpoints (plus an uncommitted
    one and the latest link), logged events, its config, and a file of the user's."""
    run = tmp_path / "dlrm"
    checkpoints = run / "checkpoints"
    for name in ["step_00000010", "step_00000020", ".tmp-step_00000030"]:
        (checkpoints / name).mkdir(parents=True)
    (checkpoints / "latest").symlink_to("step_00000020")
    (run / "config.toml").write_text("[train]\n")
    metrics = events(("train", 10), ("valid", 20), ("train", 25)) + "not json\n"
    (run / "metrics.jsonl").write_text(metrics + events(("stop", 30)))
    (run / "notes.txt").write_text("mine")
    return run


def test_previous_run_lists_committed_checkpoints_and_the_last_logged_step(old_run):
    assert previous_run(old_run) == [
        "2 checkpoint(s) up to checkpoints/step_00000020",
        "metrics.jsonl with events up to step 25",  # train / eval events only
    ]


@pytest.mark.parametrize(
    "contents",
    [
        {},
        {"config.toml": "[train]\n"},  # a run that failed before it logged anything
        {"metrics.jsonl": events(("stop", 3)) + "\n{broken\n"},  # nothing trained or evaluated
    ],
)
def test_nothing_to_lose_is_not_another_run(tmp_path, contents):
    for name, text in contents.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "checkpoints" / ".tmp-step_00000001").mkdir(parents=True)
    assert previous_run(tmp_path) == []
    check_run_dir(tmp_path, continuing=False, overwrite=False)
    assert previous_run(tmp_path / "missing") == []


def test_a_new_run_is_refused_with_every_way_out(old_run):
    (old_run.parent / "dlrm_2").mkdir()  # taken: the suggestion moves on to _3
    with pytest.raises(ValueError) as refused:
        check_run_dir(old_run, continuing=False, overwrite=False)
    message = str(refused.value)
    assert message.startswith(f"run directory '{old_run}' holds another run (2 checkpoint(s)")
    assert "metrics.jsonl with events up to step 25" in message
    assert f"--run.dir={old_run.parent / 'dlrm_3'};" in message
    assert f"--config {old_run / 'config.toml'} --checkpoint.resume=latest" in message
    assert message.endswith("--run.overwrite=true")


def test_continuing_or_overwriting_is_allowed(old_run):
    check_run_dir(old_run, continuing=True, overwrite=False)
    check_run_dir(old_run, continuing=False, overwrite=True)
    assert (old_run / "checkpoints" / "step_00000020").is_dir()  # checking deletes nothing


def test_clear_previous_run_deletes_only_what_recsys_wrote(old_run):
    removed = clear_previous_run(old_run)
    assert removed == [
        "2 checkpoint(s) up to checkpoints/step_00000020",
        "metrics.jsonl with events up to step 25",
    ]
    assert sorted(p.name for p in old_run.iterdir()) == ["notes.txt"]
    assert previous_run(old_run) == []
    assert clear_previous_run(old_run) == []  # nothing left: a no-op


def test_the_docs_quote_the_refusal_as_recsys_prints_it(tmp_path, monkeypatch):
    """The getting-started page's example of the error, rebuilt from the run it describes (one
    checkpoint and events up to step 976 in runs/dlrm_synthetic), is what check_run_dir says."""
    readme = (Path(__file__).parents[2] / "docs" / "getting-started.md").read_text()
    (quoted,) = [
        line
        for line in readme.splitlines()
        if line.startswith("recsys: error: run directory 'runs/dlrm_synthetic' holds another run")
    ]
    monkeypatch.chdir(tmp_path)
    run = Path("runs/dlrm_synthetic")
    (run / "checkpoints" / "step_00000976").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(events(("train", 976)))
    with pytest.raises(ValueError) as refused:
        check_run_dir(run, continuing=False, overwrite=False)
    assert f"recsys: error: {refused.value}" == quoted


def test_a_fresh_start_names_close_runs_that_hold_checkpoints(tmp_path):
    runs = tmp_path / "runs"
    for name in ("dlrm_synthetic", "dlrm_synthetic_2", "other"):
        (runs / name / "checkpoints" / "step_00000008").mkdir(parents=True)
    (runs / "dlrm_synthetik").mkdir()  # close, but no checkpoint: nothing to resume there
    note = fresh_start_note(runs / "dlrm_synthtic")
    assert note.startswith(f"resume=latest: no checkpoint under {runs / 'dlrm_synthtic'}: ")
    assert f"starting fresh (close names that hold checkpoints: {runs / 'dlrm_synthetic'}, " in note
    assert str(runs / "dlrm_synthetik") not in note and str(runs / "other") not in note
    assert fresh_start_note(runs / "zzz") == (
        f"resume=latest: no checkpoint under {runs / 'zzz'}: starting fresh"
    )
    assert fresh_start_note(tmp_path / "nowhere" / "run").endswith("starting fresh")


def test_an_unnamed_run_takes_the_next_free_directory_a_named_one_keeps_its_own(
    tmp_path, monkeypatch, capsys
):
    """A second `make train` trains again (into runs/dlrm_synthetic_2, then _3); a run named by
    --run.dir or --run.name keeps its directory (and the trainer refuses it)."""
    from recsys.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = Path(__file__).parents[2] / "configs" / "dlrm_synthetic.toml"
    first = Path("runs/dlrm_synthetic")
    (first / "checkpoints" / "step_00000976").mkdir(parents=True)
    (first / "metrics.jsonl").write_text(events(("train", 976)))
    Path("runs/dlrm_synthetic_2").mkdir()  # exists but holds no run: free
    trained = []
    monkeypatch.setattr("recsys.train.trainer.train", trained.append)
    assert main(["train", "--config", str(recipe)]) == 0
    assert trained[-1].run.dir == "runs/dlrm_synthetic_2"
    assert (
        "recsys: runs/dlrm_synthetic holds an earlier run: this one writes to "
        "runs/dlrm_synthetic_2 (--run.name or --run.dir names a run)"
    ) in capsys.readouterr().err
    for named in (["--run.dir=runs/dlrm_synthetic"], ["--run.name=dlrm_synthetic"]):
        assert main(["train", "--config", str(recipe), *named]) == 0
        assert trained[-1].run.dir == "runs/dlrm_synthetic"
    assert main(["train", "--config", str(recipe), "--checkpoint.resume=latest"]) == 0
    assert trained[-1].run.dir == "runs/dlrm_synthetic"  # continues its own run
    Path("recipe.toml").write_text('[run]\nname = "dlrm_synthetic"\n')
    assert names_its_run("recipe.toml") and not names_its_run(recipe)
    assert names_its_run(recipe, ["--run.dir=x"]) and not names_its_run(None, ["--seed=1"])


def test_unused_run_dir_skips_directories_that_hold_runs(old_run):
    config = load_config(None, [f"--run.dir={old_run}"])
    second = old_run.with_name(f"{old_run.name}_2")
    assert unused_run_dir(config) == second
    (second / "checkpoints" / "step_00000001").mkdir(parents=True)
    assert unused_run_dir(config) == old_run.with_name(f"{old_run.name}_3")
    config.run.overwrite = True
    assert unused_run_dir(config) == old_run
