"""`recsys preprocess` never loses data: what it may replace, and how it replaces it."""

import json
from pathlib import Path

import pytest

from recsys.config import PreprocessConfig
from recsys.data import prepared
from recsys.data.etl import preprocess, read_metadata

from .test_criteo import line, write


def criteo_input(directory: Path, name: str = "day.txt", rows: int = 40) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [line(label=str(i % 2), cats=[f"{i % 5:08x}"] * 26) for i in range(rows)]
    return write(directory / name, lines)


def run(input: Path, output: Path, **options) -> None:
    options = {"valid_fraction": 0.25, "test_fraction": 0.25, **options}
    preprocess(PreprocessConfig(input=str(input), output=str(output), **options))


def listing(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def test_overwrite_refuses_raw_inputs_and_foreign_files(tmp_path):
    raw = tmp_path / "raw"
    day = criteo_input(raw)
    (raw / "notes.txt").write_text("keep me")
    before = listing(raw)
    with pytest.raises(ValueError, match=r"input '.*day.txt' is inside the output directory"):
        run(day, raw, overwrite=True)
    with pytest.raises(ValueError, match=r"input '.*day.txt' is inside the output directory"):
        run(raw, tmp_path, overwrite=True)  # the output's parent holds the input too
    other = criteo_input(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="recsys preprocess did not write it"):
        run(other, raw, overwrite=True)
    with pytest.raises(ValueError, match="exists and is not a directory"):
        run(other, raw / "notes.txt", overwrite=True)
    assert listing(raw) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "raw"]


def test_overwrite_replaces_only_what_preprocess_wrote(tmp_path):
    day = criteo_input(tmp_path / "raw")
    out = tmp_path / "out"
    out.mkdir()  # an existing empty directory is used
    run(day, out)
    first = read_metadata(out)
    (tmp_path / "probe").mkdir()
    assert out.stat().st_mode == (tmp_path / "probe").stat().st_mode  # as the umask says
    (tmp_path / "probe").rmdir()
    with pytest.raises(ValueError, match="already exists .*--preprocess.overwrite=true"):
        run(day, out, seed=1)
    run(day, out, seed=1, overwrite=True)
    assert read_metadata(out)["preprocess"]["seed"] == 1 != first["preprocess"]["seed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"]  # nothing aside
    for stray in (out / "mine.csv", out / "train" / "notes.txt"):
        stray.write_text("keep me")
        with pytest.raises(ValueError, match=f"did not write \\({stray.relative_to(out)}\\)"):
            run(day, out, overwrite=True)
        assert stray.read_text() == "keep me"
        stray.unlink()


def test_failed_run_leaves_the_old_output_and_other_work_alone(tmp_path):
    day = criteo_input(tmp_path / "raw")
    out = tmp_path / "out"
    run(day, out)
    before = listing(out)
    partial = tmp_path / "out.partial"  # someone's directory, by the old work directory's name
    partial.mkdir()
    (partial / "keep.txt").write_text("keep me")
    bad = write(tmp_path / "raw" / "bad.txt", [line(), line(label="7")])
    with pytest.raises(ValueError, match="bad.txt:2: malformed line"):
        run(bad, out, overwrite=True, strict=True)
    assert listing(out) == before
    run(day, out, overwrite=True)
    assert (partial / "keep.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.partial", "raw"]


def test_replace_output_puts_the_old_one_back_when_the_new_one_cannot_move_in(
    tmp_path, monkeypatch
):
    old, work = tmp_path / "out", tmp_path / ".out.x.partial"
    for directory, text in ((old, "old"), (work, "new")):
        directory.mkdir()
        (directory / prepared.METADATA).write_text(json.dumps({"v": text}))
    rename = Path.rename

    def failing_rename(self, target):
        if self == work:
            raise OSError("disk gone")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="disk gone"):
        prepared.replace_output(old, work)
    assert json.loads((old / prepared.METADATA).read_text()) == {"v": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [work.name, "out"]
    monkeypatch.undo()
    prepared.replace_output(old, work)
    assert json.loads((old / prepared.METADATA).read_text()) == {"v": "new"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_read_only_output_is_one_line(read_only_dir, tmp_path, capsys):
    from recsys.cli import main

    data = criteo_input(tmp_path, rows=1000)
    for output in (read_only_dir / "out", read_only_dir):  # new inside it, or it (empty)
        assert main(["preprocess", "--input", str(data), "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"recsys: error: cannot write '{read_only_dir}"), err
        assert err.endswith("Operation not permitted (a read-only directory or file?)\n")
        assert err.count("\n") == 1


def test_a_full_disk_is_one_line_naming_the_output(small_disk, tmp_path, capsys):
    from recsys.cli import main

    data = criteo_input(tmp_path, rows=20000)
    output = small_disk / "out"
    (small_disk / "ballast").write_bytes(b"x" * (1024 * 1024 - 16 * 1024))  # 16 KiB left
    assert main(["preprocess", "--input", str(data), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"recsys: error: no space left on the device of '{output}'; free some space and run "
        "again\n"
    )
    assert [p.name for p in small_disk.iterdir()] == ["ballast"]  # the partial work is gone
