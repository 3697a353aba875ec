"""``recsys serve --compile aoti``: the export compiled by AOTInductor scores as the exported
program does (to float rounding), is compiled once per export and then loaded from the cache,
and is refused in one line where it cannot follow the model (deltas, tiered tables)."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch

from recsys.cli import main
from recsys.serve.compiled_program import cache_directory, compile_refusal
from recsys.serve.online.served import ServedModel
from tests.serve.test_server import Server, _offline, _samples, _tensors, run  # noqa: F401


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compile cache for the module (``RECSYS_CACHE_DIR``, which servers inherit)."""
    root = tmp_path_factory.mktemp("recsys-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RECSYS_CACHE_DIR", str(root))
        yield root / "aoti"


def _scores(served: ServedModel, rows) -> np.ndarray:
    from recsys.serve.online.requests import rows_from_json

    batch = rows_from_json(_samples(rows), served.spec, max_ids=64)
    return served.score(batch.dense, batch.lengths, batch.values)[0][:, 0]


def test_compiled_scores_match_the_program_and_come_from_the_cache(run, cache, monkeypatch):  # noqa: F811
    _, base, rows = run
    compiled = ServedModel(base, compile="aoti")
    assert cache_directory() == cache and len(list(cache.glob("*.pt2"))) == 1
    exported = ServedModel(base)
    assert compiled.step == exported.step == 4
    np.testing.assert_allclose(_scores(compiled, rows), _scores(exported, rows), atol=1e-6)

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compile)
    again = ServedModel(base, compile="aoti")  # the cached package
    np.testing.assert_array_equal(_scores(again, rows), _scores(compiled, rows))


def test_what_cannot_compile_is_refused_in_one_line(run, tmp_path, capsys):  # noqa: F811
    run_dir, base, _ = run
    with pytest.raises(ValueError, match="--deltas puts new rows into its tables"):
        ServedModel(base, deltas=run_dir, compile="aoti")
    tiered = tmp_path / "tiered.pt2"
    with zipfile.ZipFile(tiered, "w") as archive:
        archive.writestr("archive/extra/tiered.json", "{}")
    assert "keeps its tables in the host or disk tier" in compile_refusal(tiered, deltas=False)
    assert compile_refusal(base, deltas=False) == ""
    command = ["serve", "--model", str(base), "--deltas", str(run_dir), "--compile", "aoti"]
    assert main(command) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("recsys: error: --compile aoti serves the program as exported")


def test_a_compiled_server_scores_as_predict(run, cache, tmp_path):  # noqa: F811
    _, base, rows = run
    server = Server(tmp_path, "--model", str(base), "--compile", "aoti")
    try:
        status, body = server.post("/v2/models/recsys/infer", _tensors(_samples(rows)))
        assert status == 200, body
        scores = np.asarray(body["outputs"][0]["data"], np.float32)
        expected = _offline(base, rows, None, tmp_path / "offline.parquet")
        np.testing.assert_allclose(scores, expected, atol=1e-6)
    finally:
        assert server.stop() == 0
