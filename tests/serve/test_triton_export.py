"""recsys export --format triton: a Triton model repository whose config.pbtxt parses as Triton's
ModelConfig and matches the exported program's inputs and output, and whose AOTInductor package
loads and predicts exactly as the program ``recsys export`` writes (compiling C++ takes over a
minute on 2 cores: that test is slow; the default run checks the config and the refusals)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys.cli import main
from recsys.serve import triton_export
from recsys.serve.export import export_model, load_program
from recsys.serve.exported_deltas import exported_tables
from recsys.serve.triton_export import export_triton, triton_config
from tests.serve.test_server import run  # noqa: F401  (the module's trained run)

# Parsed in a child process: tritonclient's protobuf messages clash with MLServer's, which other
# tests of this session may have registered.
PARSE = """
import json, sys
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
config = text_format.Parse(open(sys.argv[1]).read(), model_config_pb2.ModelConfig())
types = model_config_pb2.DataType.Name
print(json.dumps({
    "name": config.name, "backend": config.backend, "platform": config.platform,
    "max_batch_size": config.max_batch_size,
    "input": [[t.name, types(t.data_type), list(t.dims)] for t in config.input],
    "output": [[t.name, types(t.data_type), list(t.dims)] for t in config.output],
    "kind": [model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)
             for g in config.instance_group],
}))
"""


def _parse(path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PARSE, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_config_matches_the_program(run, tmp_path):  # noqa: F811
    run_dir, base, _ = run
    config_path = tmp_path / "config.pbtxt"
    config_path.write_text(triton_config(torch.export.load(base), "ctr"))
    config = _parse(config_path)
    assert config["name"] == "ctr" and config["backend"] == "pytorch"
    assert config["platform"] == "torch_aoti" and config["max_batch_size"] == 0
    assert config["input"] == [
        ["INPUT__0", "TYPE_FP32", [-1, 3]],  # dense [B, 3]
        ["INPUT__1", "TYPE_INT64", [-1]],  # values [L]
        ["INPUT__2", "TYPE_INT64", [-1]],  # lengths [F * B]
    ]
    assert config["output"] == [["OUTPUT__0", "TYPE_FP32", [-1, 1]]]
    assert config["kind"] == ["KIND_CPU"]


def test_bad_options_are_refused(run, tmp_path):  # noqa: F811
    run_dir, _, _ = run
    with pytest.raises(ValueError, match="--device 'tpu': expected 'cpu' or 'cuda'"):
        export_triton(run_dir, tmp_path, device="tpu")
    with pytest.raises(ValueError, match="--name 'a/b'"):
        export_triton(run_dir, tmp_path, name="a/b")
    (tmp_path / "recsys").mkdir()
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        export_triton(run_dir, tmp_path)
    command = ["export", "--checkpoint", str(run_dir), "--output", str(tmp_path / "m.pt2")]
    assert main([*command, "--device", "cuda"]) == 2  # a Triton option without --format triton
    assert not (tmp_path / "m.pt2").exists()


def test_a_cuda_export_is_refused_without_a_gpu_and_reaches_the_device_with_one(
    run,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    run_dir, _, _ = run
    out = tmp_path / "repository"
    if not torch.cuda.is_available():
        message = "--device cuda compiles the package for this machine's GPU, and torch sees none"
        with pytest.raises(ValueError, match=message):
            export_triton(run_dir, out, device="cuda")
        assert not out.exists()
    moved = []

    def move(program, device):  # torch's pass, up to the device this machine lacks
        assert isinstance(program, torch.export.ExportedProgram)
        moved.append(device)
        raise RuntimeError("stopped at the device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_export, "move_to_device_pass", move)
    with pytest.raises(RuntimeError, match="stopped at the device"):
        export_triton(run_dir, out, device="cuda")
    assert moved == ["cuda"] and not out.exists()  # no empty folder left behind


@pytest.mark.slow
def test_the_package_predicts_as_the_export(run, tmp_path):  # noqa: F811
    run_dir, _, _ = run
    checkpoint = run_dir / "checkpoints" / "step_00000012"
    repository = tmp_path / "models"
    command = ["export", "--checkpoint", str(checkpoint), "--format", "triton", "--name", "ctr"]
    assert main([*command, "--output", str(repository)]) == 0
    files = sorted(str(p.relative_to(repository)) for p in repository.rglob("*"))
    assert files == ["ctr", "ctr/1", "ctr/1/model.pt2", "ctr/config.pbtxt"]
    text = (repository / "ctr" / "config.pbtxt").read_text()
    assert "# INPUT__0 dense, INPUT__1 values, INPUT__2 lengths (the program's" in text
    config = _parse(repository / "ctr" / "config.pbtxt")
    assert config["platform"] == "torch_aoti" and config["input"][0] == [
        "INPUT__0",
        "TYPE_FP32",
        [-1, 3],
    ]

    package = torch._inductor.aoti_load_package(str(repository / "ctr" / "1" / "model.pt2"))
    program, _, info = load_program(export_model(checkpoint, tmp_path / "model.pt2"))
    keys = torch.cat([keys for keys, _ in exported_tables(program, info).values()])
    generator = torch.Generator().manual_seed(0)
    for batch_size in (1, 7, 300):
        lengths = torch.randint(0, 4, (3 * batch_size,), generator=generator)
        ids = keys[torch.randint(0, len(keys), (int(lengths.sum()),), generator=generator)]
        unknown = torch.rand(len(ids), generator=generator) < 0.2  # read the zero row
        ids = torch.where(unknown, ids + 10**12, ids)
        dense = torch.randn(batch_size, 3, generator=generator)
        with torch.no_grad():
            expected = program(dense, ids, lengths)
            assert torch.equal(package(dense, ids, lengths), expected)
