"""write_delta under torch.distributed: each rank writes its part, the first rank commits one
delta that readers see whole; remove_deltas_after leaves nothing half-deleted. (A run that
writes deltas is tested in test_deltas.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from recsys.checkpoint.delta_writer import remove_deltas_after, write_delta
from recsys.checkpoint.deltas import list_deltas, read_delta
from recsys.checkpoint.lineage import Lineage, Session, new_run
from recsys.embedding.interface import TableDelta
from tests.distributed.spawn import run_ranks

LINEAGE = Lineage("0123456789abcdef", (Session("00000000000000aa", 0), Session("bb", 2)))


def _part(keys: list[int], deleted: list[int], dim: int = 3) -> TableDelta:
    keys_t = torch.tensor(keys, dtype=torch.int64)
    rows = keys_t.float().view(-1, 1) + torch.arange(dim) / 10  # row of key k: k.0, k.1, ...
    return TableDelta(keys_t, rows.view(-1, dim), keys_t * 0 + 5, torch.tensor(deleted))


def _write_two_ranks(rank: int, world_size: int, directory: str) -> None:
    if rank == 0:
        tables = {"user": _part([10, 30], [7]), "item": _part([1], [], dim=2)}
    else:  # no part of "item", no row of "user": deletions only
        tables = {"user": _part([], [8, 9])}
    # Every rank's own lineage: the first rank's is the delta's.
    lineage = LINEAGE if rank == 0 else new_run()
    report = write_delta(directory, 5, 2, tables, lineage)
    assert (report.rows, report.deletions, report.step, report.since) == (3, 3, 5, 2)


def test_every_rank_writes_its_part_and_one_delta_is_committed(tmp_path):
    run_ranks(2, _write_two_ranks, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]
    (info,) = list_deltas(tmp_path)
    assert (info.step, info.since, info.world_size, info.lineage) == (5, 2, 2, LINEAGE)
    manifest = json.loads((info.path / "delta.json").read_text())
    assert manifest["lineage"] == {
        "run_id": "0123456789abcdef",
        "sessions": [{"id": "00000000000000aa", "from_step": 0}, {"id": "bb", "from_step": 2}],
        "parent": None,
    }
    files = {f["name"]: f["rank"] for f in manifest["tables"]["user"]["files"]}
    assert files == {
        "user.rank00000.rows.parquet": 0,
        "user.rank00000.deleted.parquet": 0,
        "user.rank00001.deleted.parquet": 1,
    }
    delta = read_delta(info)
    assert delta["user"].keys.tolist() == [10, 30] and delta["user"].deleted.tolist() == [7, 8, 9]
    assert torch.equal(delta["user"].weights[1], torch.tensor([30.0, 30.1, 30.2]))
    assert delta["item"].weights.shape == (1, 2) and delta["item"].last_seen.tolist() == [5]


def test_a_key_in_two_parts_is_refused(tmp_path):
    write_delta(tmp_path, 5, 2, {"user": _part([10, 30], [])}, LINEAGE)
    (info,) = list_deltas(tmp_path)
    manifest = json.loads((info.path / "delta.json").read_text())
    # Another rank's part holding key 30 again (as a deletion): written by hand.
    write_delta(tmp_path / "other", 5, 2, {"user": _part([], [30])}, LINEAGE)
    (other,) = list_deltas(tmp_path / "other")
    extra = json.loads((other.path / "delta.json").read_text())["tables"]["user"]["files"]
    for file in extra:
        (other.path / file["name"]).rename(info.path / file["name"].replace("00000", "00001"))
        file["name"] = file["name"].replace("00000", "00001")
    manifest["tables"]["user"]["files"] += extra
    (info.path / "delta.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="table 'user': a key appears twice"):
        read_delta(list_deltas(tmp_path)[0])


def test_a_delta_of_a_step_replaces_the_one_there(tmp_path):
    write_delta(tmp_path, 5, 2, {"user": _part([10], [])}, LINEAGE)
    write_delta(tmp_path, 5, 3, {"user": _part([11], [])}, LINEAGE)
    (info,) = list_deltas(tmp_path)
    assert info.since == 3 and read_delta(info)["user"].keys.tolist() == [11]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]


def test_remove_deltas_after_a_step(tmp_path):
    for step in (3, 6, 9):
        write_delta(tmp_path, step, step - 3, {"user": _part([step], [])}, LINEAGE)
    (tmp_path / ".tmp-step_00000012").mkdir()
    (tmp_path / ".stale-step_00000007").mkdir()
    (tmp_path / "notes.txt").write_text("kept")
    removed = remove_deltas_after(tmp_path, 4)
    assert [p.name for p in removed] == ["step_00000006", "step_00000009"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step_00000003"]
    assert remove_deltas_after(tmp_path / "missing", 0) == []
