import pytest
import torch

from recsys.train import checkpoint as ckpt


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
    assert ckpt.load_checkpoint(good, state(0.0, 0))["step"] == 1


def test_missing_checkpoint(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path / "none") is None
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        ckpt.load_checkpoint(tmp_path / "none", {})
