"""``recsys serve --compile aoti``: the export compiled by AOTInductor scores as the exported
program does (to float rounding), is compiled once per program and then loaded from the cache
(a checkpoint exported again included), and is refused in one line where it cannot follow the
model (deltas, tiered tables)."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import zipfile

import numpy as np
import pytest
import torch

from recsys.cli import main
from recsys.serve.compiled_program import cache_directory, compile_refusal
from recsys.serve.online.served import ServedModel
from tests.serve.test_server import Server, _offline, _samples, _tensors, run  # noqa: F401

needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="AOTInductor compiles C++: no compiler here",
)


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


@needs_compiler
def test_compiled_scores_match_the_program_and_come_from_the_cache(run, cache, monkeypatch):  # noqa: F811
    run_dir, base, rows = run
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
    # The checkpoint the base was exported from, exported again on load (another random
    # serialization id in the archive): the same program, the same package.
    checkpoint = ServedModel(run_dir / "checkpoints" / "step_00000004", compile="aoti")
    np.testing.assert_array_equal(_scores(checkpoint, rows), _scores(compiled, rows))
    assert len(list(cache.glob("*.pt2"))) == 1


def test_what_cannot_compile_is_refused_in_one_line(run, tmp_path, capsys):  # noqa: F811
    run_dir, base, _ = run
    with pytest.raises(ValueError, match="--deltas puts new rows into its tables"):
        ServedModel(base, deltas=run_dir, compile="aoti")
    tiered = tmp_path / "tiered.pt2"
    with zipfile.ZipFile(tiered, "w") as archive:
        archive.writestr("archive/extra/tiered.json", "{}")
    refusal = compile_refusal(tiered, deltas=False)
    assert "keeps its tables in the host or disk tier" in refusal
    assert refusal.endswith("serve it without --compile")
    assert compile_refusal(base, deltas=False) == ""
    command = ["serve", "--model", str(base), "--deltas", str(run_dir), "--compile", "aoti"]
    assert main(command) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("recsys: error: --compile aoti serves the program as exported")


@needs_compiler
@pytest.mark.slow  # a compile of its own (~20 s) and a server start
def test_a_compiled_server_scores_as_predict(run, tmp_path, monkeypatch):  # noqa: F811
    _, base, rows = run
    monkeypatch.setenv("RECSYS_CACHE_DIR", str(tmp_path / "cache"))  # the server compiles
    server = Server(tmp_path, "--model", str(base), "--compile", "aoti")
    try:
        status, body = server.post("/v2/models/recsys/infer", _tensors(_samples(rows)))
        assert status == 200, body
        scores = np.asarray(body["outputs"][0]["data"], np.float32)
        expected = _offline(base, rows, None, tmp_path / "offline.parquet")
        np.testing.assert_allclose(scores, expected, atol=1e-6)
    finally:
        assert server.stop() == 0
    assert len(list((tmp_path / "cache" / "aoti").glob("*.pt2"))) == 1
    log = server.log.read_text()
    assert f"compiling '{base}' with AOTInductor" in log
    assert f"scoring with '{base}' compiled by AOTInductor" in log


class _Tower(torch.nn.Module):
    """A program AOTInductor compiles to aten ops only (no op run through a proxy executor)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(1000, 64, mode="sum")
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(80, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)
        )

    def forward(self, dense, ids, offsets):
        pooled = self.embedding(ids, offsets)
        return {"scores": torch.sigmoid(self.mlp(torch.cat([dense, pooled], dim=1)))}


@needs_compiler
def test_a_package_runs_through_its_c_interface_with_the_gil_released(tmp_path):
    from recsys.serve.aoti_library import AotiLibrary

    torch.manual_seed(0)
    rows = 16384
    inputs = (torch.randn(rows, 16), torch.randint(0, 1000, (3 * rows,)), torch.arange(rows) * 3)
    program = torch.export.export(_Tower().eval(), inputs)
    package = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "tower.pt2")
    )
    library = AotiLibrary.load(package)
    assert library is not None and (library.num_inputs, library.num_outputs) == (3, 1)
    loaded = torch._inductor.aoti_load_package(package)  # torch's loader, GIL held
    np.testing.assert_array_equal(
        library(*inputs)["scores"].numpy(), loaded(*inputs)["scores"].numpy()
    )
    with pytest.raises(TypeError, match="takes 3 tensors, not 2"):
        library(*inputs[:2])

    # With a switch interval of a minute, another thread runs only while this one lets the
    # GIL go (and gives it back at once: time.sleep lets it go): the library's run does;
    # torch's loader's does not.
    def progress(call) -> int:
        count, stop = [0], threading.Event()

        def spin() -> None:
            while not stop.is_set():
                count[0] += 1
                time.sleep(0)

        interval = sys.getswitchinterval()
        thread = threading.Thread(target=spin)
        sys.setswitchinterval(60.0)
        try:
            thread.start()
            before = count[0]
            for _ in range(20):
                call(*inputs)
            moved = count[0] - before
        finally:
            stop.set()
            sys.setswitchinterval(interval)
            thread.join()
        return moved

    # torch's loader lets the other thread in about once a call, the library for every call's
    # whole length (hundreds of turns per call on a quiet machine, tens under a test run)
    assert progress(library) > 5 * progress(loaded) + 100


def test_packages_laid_out_otherwise_go_to_torchs_loader(tmp_path):
    from recsys.serve.aoti_library import AotiLibrary

    model = "package/data/aotinductor/model"
    layouts = {
        "weights": {f"{model}/m.so": b"", f"{model}/m.cpp": b"", "package/data/weights/w": b""},
        "proxy": {f"{model}/m.so": b"", f"{model}/m.json": b"{}"},
        "two": {f"{model}/m.so": b"", "package/data/aotinductor/other/o.so": b""},
        "cuda": {
            f"{model}/m.so": b"",
            f"{model}/m.wrapper_metadata.json": b'{"AOTI_DEVICE_KEY": "cuda"}',
        },
    }
    for name, members in layouts.items():
        package = tmp_path / f"{name}.pt2"
        with zipfile.ZipFile(package, "w") as archive:
            for member, data in members.items():
                archive.writestr(member, data)
        assert AotiLibrary.load(package) is None, name


def test_the_cache_keeps_the_most_recently_used_packages(tmp_path):
    from recsys.serve.compiled_program import CACHE_PACKAGES, _evict

    packages = [tmp_path / f"{i:02d}.pt2" for i in range(CACHE_PACKAGES + 3)]
    for age, package in enumerate(packages):
        package.write_bytes(b"")
        os.utime(package, (1000 - age, 1000 - age))  # packages[0] the newest
    _evict(tmp_path, keep=packages[-1])  # the oldest, just compiled
    kept = sorted(p.name for p in tmp_path.glob("*.pt2"))
    assert kept == sorted(p.name for p in [*packages[:CACHE_PACKAGES], packages[-1]])
