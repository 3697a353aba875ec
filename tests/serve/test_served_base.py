"""A served model loads a new base without a restart: a ``.pt2`` replaced by a new export, or a
run's ``latest`` checkpoint moving on, is loaded beside the served version, the deltas after it
are applied, and both are published as one version that scores exactly as ``recsys predict`` of
the new base with its deltas; an unusable new base is refused while the served one stays."""

from __future__ import annotations

import os
import shutil

import numpy as np

from recsys.serve.export import export_model
from recsys.serve.online.served import ServedModel
from tests.serve.test_server import _offline, run  # noqa: F401  (the module's trained run)


def _scores(served: ServedModel, rows) -> np.ndarray:
    import pyarrow.parquet as pq

    from recsys.serve.online.requests import rows_from_json
    from tests.serve.test_server import _samples

    batch = rows_from_json(_samples(rows), served.spec, max_ids=64)
    scores, _ = served.score(batch.dense, batch.lengths, batch.values)
    assert pq.read_table(rows).num_rows == len(scores)
    return scores[:, 0]


def test_a_replaced_export_is_the_new_base(run, tmp_path):  # noqa: F811
    run_dir, base, rows = run
    served_path = tmp_path / "served.pt2"
    shutil.copy(base, served_path)  # step 4
    served = ServedModel(served_path, deltas=run_dir)
    assert served.refresh() == 4 and served.step == 12  # deltas 6, 8, 10, 12
    export_model(run_dir / "checkpoints" / "step_00000008", served_path, overwrite=True)
    assert served.refresh() == 2  # the new base (step 8), then deltas 10 and 12
    assert served.num_bases == 2 and served.step == 12 and served.num_refused == 0
    expected = _offline(served_path, rows, run_dir / "deltas", tmp_path / "offline.parquet")
    np.testing.assert_array_equal(_scores(served, rows), expected)
    assert served.refresh() == 0 and served.num_bases == 2  # nothing new

    # A corrupt new export is refused (logged once); the served version stays.
    before = served.version
    broken = tmp_path / "broken.pt2"
    broken.write_bytes(b"not an export")
    os.replace(broken, served_path)
    assert served.refresh() == 0 and served.refresh() == 0
    assert served.version is before and served.num_refused == 1 and served.num_bases == 2


def test_a_run_directory_follows_its_latest_checkpoint(run, tmp_path):  # noqa: F811
    run_dir, _, rows = run
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for step in ("step_00000004", "step_00000008"):
        shutil.copytree(run_dir / "checkpoints" / step, checkpoints / step)
    (checkpoints / "latest").symlink_to("step_00000004")
    served = ServedModel(checkpoints)
    assert served.step == 4 and served.refresh() == 0
    (checkpoints / "latest").unlink()
    (checkpoints / "latest").symlink_to("step_00000008")
    served.refresh()
    assert served.step == 8 and served.num_bases == 2
    export = export_model(checkpoints / "step_00000008", tmp_path / "step8.pt2")
    expected = _offline(export, rows, None, tmp_path / "offline.parquet")
    np.testing.assert_array_equal(_scores(served, rows), expected)


def test_the_served_base_skips_torchs_call_check_and_scores_as_predict(run, tmp_path):  # noqa: F811
    run_dir, base, rows = run
    served = ServedModel(base)
    # The graph's own guards check the inputs; the pytree check in front of them is off
    assert served.version.module.validate_inputs is False
    expected = _offline(base, rows, None, tmp_path / "offline.parquet")
    np.testing.assert_array_equal(_scores(served, rows), expected)
