import json
import zlib

import pytest
import torch
import torchrec
from torch.distributed.checkpoint.api import CheckpointException
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.checkpoint import io as ckpt
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import Adam


def state(value: float, step: int) -> dict:
    return {"model": {"w": torch.full((3, 2), value)}, "step": step}


def test_save_load_round_trip(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 7, state(1.5, 7))
    assert path.name == "step_00000007"
    loaded = ckpt.load_checkpoint(path, state(0.0, 0))
    assert torch.equal(loaded["model"]["w"], torch.full((3, 2), 1.5))
    assert loaded["step"] == 7


def test_keep_prunes_oldest_and_latest_is_newest(tmp_path):
    for step in [5, 10, 15, 20]:
        ckpt.save_checkpoint(tmp_path, step, state(step, step), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000015", "step_00000020"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000020"


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    good = ckpt.save_checkpoint(tmp_path, 1, state(1.0, 1))

    def crash(state, checkpoint_id):
        checkpoint_id.mkdir()
        (checkpoint_id / "partial").write_text("half a tensor")
        raise RuntimeError("killed")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(RuntimeError, match="killed"):
        ckpt.save_checkpoint(tmp_path, 2, state(2.0, 2))
    assert ckpt.latest_checkpoint(tmp_path) == good
    assert (tmp_path / "latest").resolve() == good.resolve()
    assert ckpt.resolve_checkpoint("latest", tmp_path.parent / "x") is None
    assert ckpt.load_checkpoint(tmp_path / "latest", state(0.0, 0))["step"] == 1
    monkeypatch.undo()
    # the next save clears the half-written directory
    ckpt.save_checkpoint(tmp_path, 3, state(3.0, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_00000001",
        "step_00000003",
    ]
    assert (tmp_path / "latest").resolve().name == "step_00000003"


def test_crash_while_writing_tensor_files(tmp_path, monkeypatch):
    """A failure inside DCP's writer, after some bytes hit the disk."""
    good = ckpt.save_checkpoint(tmp_path, 1, state(1.0, 1))
    original = ckpt.dcp.FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        original(self, plan, planner).wait()
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.dcp.FileSystemWriter, "write_data", write_then_fail)
    with pytest.raises(OSError, match="disk full") as error:  # unwrapped from DCP's exception
        ckpt.save_checkpoint(tmp_path, 2, state(2.0, 2))
    assert isinstance(error.value.__cause__, CheckpointException)
    assert ".tmp-step_00000002" in error.value.filename
    assert any(p.name.startswith(".tmp-step_00000002") for p in tmp_path.iterdir())
    assert ckpt.list_checkpoints(tmp_path) == [good]
    assert ckpt.resolve_checkpoint(tmp_path) == good.resolve()
    assert torch.equal(
        ckpt.load_checkpoint(tmp_path / "latest", state(0.0, 0))["model"]["w"],
        torch.full((3, 2), 1.0),
    )


def test_resolve_checkpoint_accepts_checkpoint_checkpoints_and_run_directories(tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "run" / "checkpoints", 4, state(1.0, 4))
    run = tmp_path / "run"
    for spec in [path, run, run / "checkpoints", run / "checkpoints" / "latest", str(run)]:
        assert ckpt.resolve_checkpoint(spec) == path.resolve()
    assert ckpt.resolve_checkpoint("latest", tmp_path / "run") == path.resolve()
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        ckpt.resolve_checkpoint(tmp_path / "empty")


def test_loading_keys_or_shapes_the_checkpoint_lacks_lists_them(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, state(1.0, 1))
    wanted = {"model": {"w": torch.zeros(4, 2), "v": torch.zeros(1)}, "step": 0}
    with pytest.raises(ValueError) as error:
        ckpt.load_checkpoint(path, wanted)
    assert "not in the checkpoint (1): model.v" in str(error.value)
    assert "shape differs: model.w: checkpoint [3, 2], here [4, 2]" in str(error.value)


def test_missing_checkpoint(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path / "none") is None
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        ckpt.load_checkpoint(tmp_path / "none", {})


def table_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="users", embedding_dim=8, num_embeddings=37, feature_names=["u"]),
        EmbeddingBagConfig(name="movies", embedding_dim=4, num_embeddings=5, feature_names=["i"]),
    ]


def test_torchrec_collection_checkpoint_loads_into_recsys_and_back(tmp_path):
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "i"],
        values=torch.tensor([3, 36, 0, 4, 4, 1, 2]),
        lengths=torch.tensor([2, 0, 1, 1, 2, 1]),
    )
    theirs = torchrec.EmbeddingBagCollection(table_configs())
    saved = ckpt.save_checkpoint(tmp_path / "a", 1, {"model": theirs.state_dict()})

    # into a recsys collection training with a fused optimizer: its extra state is not read
    ours = EmbeddingBagCollection(table_configs(), optimizer=Adam(lr=0.1))
    wanted = {"model": {k: v for k, v in ours.state_dict().items() if k.endswith(".weight")}}
    ours.load_state_dict(ckpt.load_checkpoint(saved, wanted)["model"], strict=False)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values(), rtol=0, atol=1e-6)

    ours(kjt).values().sum().backward()  # one fused Adam step changes the tables
    back = ckpt.save_checkpoint(tmp_path / "b", 2, {"model": ours.state_dict()})
    again = torchrec.EmbeddingBagCollection(table_configs())
    state = ckpt.load_checkpoint(back, {"model": again.state_dict()})
    again.load_state_dict(state["model"])
    for key, value in again.state_dict().items():
        assert torch.equal(value, ours.state_dict()[key]), key
    assert not torch.equal(
        again.state_dict()["embedding_bags.users.weight"],
        theirs.state_dict()["embedding_bags.users.weight"],
    )


# ------------------------------------------------------------------------------------------
# Integrity: checksums written at save, verified at load


def flip_byte(path, offset=-40):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_save_writes_the_size_and_checksum_of_every_file(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, state(1.0, 1))
    manifest = json.loads((path / ckpt.CHECKSUMS_FILE).read_text())
    on_disk = {p.name for p in path.iterdir()} - {ckpt.CHECKSUMS_FILE}
    assert set(manifest["files"]) == on_disk
    assert {".metadata", "__0_0.distcp"} <= on_disk
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (path / name).stat().st_size
        assert entry["crc32"] == zlib.crc32((path / name).read_bytes())


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, state(1.5, 1))
    flip_byte(path / "__0_0.distcp")
    with pytest.raises(ckpt.CheckpointError, match=r"'__0_0.distcp' does not match the checksum"):
        ckpt.load_checkpoint(path, state(0.0, 0))
    with pytest.raises(ckpt.CheckpointError, match="__0_0.distcp"):
        ckpt.load_model(path)  # every loader verifies, not only the trainer


def test_a_truncated_file_is_refused_with_its_sizes(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, state(1.5, 1))
    metadata = path / ".metadata"
    size = metadata.stat().st_size
    metadata.write_bytes(metadata.read_bytes()[: size // 2])
    with pytest.raises(
        ckpt.CheckpointError, match=rf"'.metadata' is {size // 2:,} bytes, {size:,}"
    ):
        ckpt.verify_checkpoint(path)
    (path / ckpt.CHECKSUMS_FILE).unlink()  # even unverified, it is one clear error
    with (
        pytest.warns(UserWarning, match="not verified"),
        pytest.raises(ckpt.CheckpointError, match=r"\.metadata does not read back"),
    ):
        ckpt.load_checkpoint(path, state(0.0, 0))


def test_resumable_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    directory = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        ckpt.save_checkpoint(directory, step, state(step, step))
    flip_byte(directory / "step_00000015" / "__0_0.distcp")
    (directory / "step_00000010" / "__0_0.distcp").write_bytes(b"")
    found, skipped = ckpt.find_resumable(tmp_path)
    assert found == (directory / "step_00000005").resolve()
    assert len(skipped) == 2
    assert skipped[0].startswith("skipped step_00000015:") and "checksum" in skipped[0]
    assert skipped[1].startswith("skipped step_00000010:") and "0 bytes" in skipped[1]
    flip_byte(directory / "step_00000005" / ".metadata", offset=10)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint of .* verifies"):
        ckpt.find_resumable(tmp_path)


def test_latest_follows_the_link_not_the_highest_step(tmp_path):
    """A run that resumed step 5 commits step 8 beside a later step 20 it abandoned: latest is
    step 8, and pruning never deletes the later checkpoint nor the new one."""
    for step in (5, 20):
        ckpt.save_checkpoint(tmp_path, step, state(step, step))
    for step in (6, 7, 8):
        ckpt.save_checkpoint(tmp_path, step, state(step, step), keep=2)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000008"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_00000007",
        "step_00000008",
        "step_00000020",
    ]
    assert ckpt.resolve_checkpoint(tmp_path).name == "step_00000008"


def test_load_model_accepts_a_run_directory(tmp_path):
    run = tmp_path / "run"
    from recsys.config import load_config
    from recsys.train.trainer import train

    result = train(
        load_config(
            None,
            [
                f"--run.dir={run}",
                "--data.synthetic.cardinalities=[20,30]",
                "--data.synthetic.num_train_samples=1024",
                "--data.synthetic.num_valid_samples=256",
                "--data.synthetic.num_test_samples=256",
                "--train.batch_size=256",
                "--train.progress_bar=false",
                "--run.device=cpu",
            ],
        )
    )
    from_run, from_checkpoint = ckpt.load_model(run), ckpt.load_model(result.checkpoint)
    for key, value in from_checkpoint.state_dict().items():
        assert torch.equal(from_run.state_dict()[key], value), key
