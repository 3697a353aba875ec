"""Run lineages (recsys.checkpoint.lineage) and the rule that applies a delta only to what it
continues (delta_chain): the same run, the same history up to the base's step. Runs that write
them are tested in test_deltas.py."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.checkpoint.deltas import DeltaBase, DeltaInfo, delta_chain
from recsys.checkpoint.lineage import (
    Lineage,
    Session,
    divergence,
    new_run,
    read_lineage,
    resumed_run,
)


def _rng_states() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def test_ids_are_random_and_move_no_training_generator():
    torch.manual_seed(0)
    before = _rng_states()
    runs = [new_run() for _ in range(3)]
    resumed = resumed_run(runs[0], 40)
    after = _rng_states()
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert before[2] == after[2]
    ids = {r.run_id for r in runs} | {s.id for r in runs for s in r.sessions}
    assert len(ids) == 6 and all(re.fullmatch("[0-9a-f]{16}", i) for i in ids)
    assert [s.from_step for s in runs[0].sessions] == [0] and runs[0].parent is None
    assert resumed.run_id == runs[0].run_id and resumed.sessions[0] == runs[0].sessions[0]
    assert [s.from_step for s in resumed.sessions] == [0, 40]


def test_a_resume_without_lineage_and_a_fine_tuning_start_new_runs():
    legacy = resumed_run(None, 40)  # a checkpoint saved before lineages
    assert [s.from_step for s in legacy.sessions] == [40] and legacy.parent is None
    parent = new_run()
    child = new_run(parent, 100)
    assert child.run_id != parent.run_id and child.parent == (parent.run_id, 100)
    assert new_run(None, 100).parent == (None, 100)  # a parent saved before lineages


def test_the_json_form_reads_back(tmp_path):
    lineage = resumed_run(new_run(new_run(), 7), 12)
    assert Lineage.from_json(lineage.to_json()) == lineage
    assert lineage.to_json()["parent"] == {"run_id": lineage.parent[0], "step": 7}
    assert Lineage.from_json(None) is None
    for bad in ({"run_id": "a"}, {"run_id": "a", "sessions": []}, [1], {"sessions": [{}]}):
        with pytest.raises(ValueError, match="not a run lineage"):
            Lineage.from_json(bad)
    assert read_lineage(tmp_path) is None  # a checkpoint saved before lineages
    (tmp_path / "lineage.json").write_text("{")
    with pytest.raises(ValueError, match=f"checkpoint '{tmp_path}': lineage.json is unreadable"):
        read_lineage(tmp_path)


RUN = Lineage("r" * 16, (Session("s0", 0),))
AT_4 = Lineage(RUN.run_id, (*RUN.sessions, Session("s1", 4)))  # resumed at step 4
AT_8 = Lineage(RUN.run_id, (*RUN.sessions, Session("s2", 8)))  # resumed at step 8
AT_4_AGAIN = Lineage(RUN.run_id, (*RUN.sessions, Session("s3", 4)))  # another resume at 4


def test_the_same_tables_are_one_run_with_one_history_up_to_the_step():
    assert divergence(RUN, RUN, 8) is None
    for step in (4, 8):
        assert divergence(RUN, AT_8, step) is None  # resumed at or after the base's step
    assert divergence(AT_4, AT_4_AGAIN, 4) is None  # both loaded the first session's step 4
    assert divergence(RUN, AT_4, 4) is None
    assert "different runs" in divergence(RUN, new_run(), 8)
    assert divergence(RUN, AT_4, 8).startswith(
        f"the delta's branch of run {RUN.run_id} resumed from step 4 (session s1), before step "
        "8, and trained steps 5..8 again"
    )
    assert divergence(AT_4, RUN, 8).startswith(
        f"the base's branch of run {RUN.run_id} resumed from step 4 (session s1)"
    )
    assert "resumed from step 4 (session s3)" in divergence(AT_4, AT_4_AGAIN, 8)


def _delta(step: int, since: int, lineage: Lineage | None) -> DeltaInfo:
    return DeltaInfo(Path(f"d/step_{step:08d}"), step, since, 1, {}, lineage)


def test_each_delta_must_continue_the_base_or_the_delta_before_it():
    base = DeltaBase("b.pt2", 8, RUN)
    ok = [_delta(4, 0, RUN), _delta(9, 8, AT_8), _delta(12, 9, AT_8)]
    assert [d.step for d in delta_chain(ok, base)] == [9, 12]
    with pytest.raises(ValueError) as refused:
        delta_chain([_delta(9, 8, AT_4)], base)
    assert str(refused.value).startswith(
        f"delta 'd/step_00000009' (run {RUN.run_id}, step 9) does not continue base 'b.pt2' "
        f"(run {RUN.run_id}, step 8): the delta's branch"
    )
    # Two deltas of branches that split after the base: the second does not continue the first.
    other = Lineage(RUN.run_id, (*RUN.sessions, Session("s4", 8)))
    with pytest.raises(ValueError) as refused:
        delta_chain([_delta(9, 8, AT_8), _delta(12, 9, other)], base)
    assert str(refused.value).startswith(
        f"delta 'd/step_00000012' (run {RUN.run_id}, step 12) does not continue delta "
        f"'d/step_00000009' (run {RUN.run_id}, step 9) after base 'b.pt2' (run {RUN.run_id}, "
        "step 8): the delta's branch"
    )


def test_a_missing_lineage_is_checked_by_steps_only_or_refused_after_one():
    legacy = DeltaBase("old.pt2", 8, None)
    unchecked = r"delta\(s\) 'step_00000009', 'step_00000012' to base 'old.pt2' \(no lineage"
    with pytest.warns(UserWarning, match=unchecked):
        assert len(delta_chain([_delta(9, 8, None), _delta(12, 9, None)], legacy)) == 2
    # A run resumed from a checkpoint without lineage: its first delta is unchecked, the rest are.
    resumed = resumed_run(None, 8)
    with pytest.warns(UserWarning, match=r"delta\(s\) 'step_00000009' to"):
        delta_chain([_delta(9, 8, resumed), _delta(12, 9, resumed)], legacy)
    with pytest.raises(ValueError, match=r"'d/step_00000012' \(run .*does not continue delta "):
        delta_chain([_delta(9, 8, resumed), _delta(12, 9, new_run())], legacy)
    with pytest.raises(ValueError, match=r"\(no lineage, step 9\) .*: the delta has no run line"):
        delta_chain([_delta(9, 8, None)], DeltaBase("b", 8, RUN))
