"""``recsys report``: the table's numbers from hand-made metrics.jsonl files (a plain run of an
older format, a resumed run, a torchrun-like run with collectives, a compiled run), the PNG it
writes for one and several runs, what its panels draw (tick labels, AUC axis and legend, the
oracle line, the step-time bars), and its errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from recsys.cli import main
from recsys.report import (
    REPORT_FILE,
    format_table,
    load_run,
    output_path,
    plot_report,
    run_names,
    summarize,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, events: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps(e) + "\n" for e in events)
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def train(step: int, loss: float, rate: float) -> dict:
    return {"split": "train", "step": step, "epoch": 0, "loss": loss, "samples_per_s": rate}


def timed(step: int, loss: float, rate: float, **parts: float) -> dict:
    """A train event with the step-time fields ``time_<part>`` (seconds per step)."""
    event = train(step, loss, rate)
    event.update({f"time_{part}": seconds for part, seconds in parts.items()})
    event.update(lr_dense=0.001, lr_embedding=0.05)
    return event


def evaluation(split: str, step: int, auc: float, logloss: float) -> dict:
    return {"split": split, "step": step, "auc": auc, "logloss": logloss, "oracle_auc": 0.87}


@pytest.fixture
def plain(tmp_path) -> Path:
    """A run logged before the step-time fields existed: no time_* anywhere."""
    return write_run(
        tmp_path / "plain",
        [
            train(100, 0.50, 1000.0),
            evaluation("valid", 100, 0.70, 0.48),
            train(200, 0.45, 2000.0),
            evaluation("valid", 200, 0.75, 0.44),
            evaluation("test", 200, 0.76, 0.43),
        ],
    )


@pytest.fixture
def resumed(tmp_path) -> Path:
    """Stopped after step 250 and resumed from its checkpoint: the window after the resume is
    50 steps long; the breakdown is logged."""
    parts = {"data": 0.001, "forward": 0.004, "backward": 0.006, "optimizer": 0.002}
    later = {**parts, "forward": 0.010}
    return write_run(
        tmp_path / "resumed",
        [
            timed(100, 0.50, 1000.0, **parts),
            timed(200, 0.45, 1000.0, **parts),
            evaluation("valid", 250, 0.74, 0.45),
            {"split": "stop", "step": 250, "signal": "SIGTERM", "checkpoint": "c/step_250"},
            {"split": "resume", "step": 250, "checkpoint": "c/step_250"},
            timed(300, 0.44, 500.0, **later),
            evaluation("valid", 300, 0.77, "nan"),
            evaluation("test", 300, 0.78, 0.42),
        ],
    )


@pytest.fixture
def torchrun(tmp_path) -> Path:
    """A run on several ranks: collectives logged too."""
    parts = {"data": 0.002, "forward": 0.003, "backward": 0.004, "optimizer": 0.001}
    return write_run(
        tmp_path / "torchrun",
        [
            timed(100, 0.52, 4000.0, **parts, collectives=0.005),
            timed(200, 0.46, 4000.0, **parts, collectives=0.007),
            evaluation("valid", 200, 0.74, 0.45),
            evaluation("test", 200, 0.75, 0.44),
        ],
    )


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, channels = matplotlib.image.imread(path).shape
    assert width > 1000 and height > 700 and channels in (3, 4)


def test_summaries_of_a_plain_a_resumed_and_a_torchrun_run(plain, resumed, torchrun):
    old = summarize(load_run(plain))
    assert (old.name, old.steps, old.valid_auc, old.valid_step) == ("plain", 200, 0.75, 200)
    assert (old.test_auc, old.test_logloss) == (0.76, 0.43)
    # 100 steps at 1000/s and 100 at 2000/s: 200 steps in 0.1 + 0.05 time units.
    assert old.samples_per_s == pytest.approx(200 / (100 / 1000 + 100 / 2000))
    assert old.step_ms == {}

    run = load_run(resumed)
    assert run.resumed_at == [250]
    new = summarize(run)
    assert (new.steps, new.valid_auc, new.valid_step, new.test_auc) == (300, 0.77, 300, 0.78)
    # Windows of 100, 100 and 50 steps (the last one starts at the resume, not at step 200).
    assert new.samples_per_s == pytest.approx(250 / (200 / 1000 + 50 / 500))
    assert new.step_ms["forward"] == pytest.approx(1000 * (200 * 0.004 + 50 * 0.010) / 250)
    assert new.step_ms["backward"] == pytest.approx(6.0)
    assert set(new.step_ms) == {"data", "forward", "backward", "optimizer"}

    ranks = summarize(load_run(torchrun))
    assert ranks.step_ms["collectives"] == pytest.approx(6.0)
    assert ranks.samples_per_s == pytest.approx(4000.0)


def test_the_table_has_one_row_per_run_with_its_numbers(plain, resumed, torchrun):
    summaries = [summarize(load_run(d)) for d in (plain, resumed, torchrun)]
    header, *rows = format_table(summaries).splitlines()
    assert header.split() == [
        "run", "steps", "valid", "auc", "at", "step", "test", "auc", "test", "logloss",
        "samples/s", "data", "ms", "forward", "ms", "backward", "ms", "optimizer", "ms",
        "collectives", "ms",
    ]  # fmt: skip
    assert rows[0].split() == [
        "plain", "200", "0.7500", "200", "0.7600", "0.4300", "1,333", "-", "-", "-", "-", "-",
    ]  # fmt: skip
    assert rows[1].split() == [
        "resumed", "300", "0.7700", "300", "0.7800", "0.4200", "833",
        "1.00", "5.20", "6.00", "2.00", "-",
    ]  # fmt: skip
    assert rows[2].split()[-5:] == ["2.00", "3.00", "4.00", "1.00", "6.00"]
    widths = {len(line) for line in (header, rows[1], rows[2])}
    assert len(widths) == 1  # aligned columns


def test_a_table_without_breakdown_has_no_time_columns(plain):
    table = format_table([summarize(load_run(plain))])
    assert "data ms" not in table and "forward" not in table


def test_one_run_writes_report_png_in_its_directory(plain, capsys):
    assert main(["report", str(plain)]) == 0
    assert_png(plain / REPORT_FILE)
    out = capsys.readouterr().out
    assert out.startswith("run ")
    assert f"recsys: wrote {plain / REPORT_FILE}" in out
    assert main(["report", str(plain)]) == 0  # a report is replaced by the next one
    assert_png(plain / REPORT_FILE)


def test_several_runs_overlay_in_one_png(plain, resumed, torchrun, tmp_path):
    output = tmp_path / "out" / "compare.png"
    with pytest.raises(ValueError, match=r"directory '.*out' does not exist \(create it first\)"):
        write_report([plain, resumed, torchrun], output)  # a typo'd folder is not created
    assert not output.parent.exists()
    output.parent.mkdir()
    report = write_report([plain, resumed, torchrun], output)
    assert report.output == output
    assert_png(output)
    assert [s.name for s in report.summaries] == ["plain", "resumed", "torchrun"]
    assert report.table == format_table(report.summaries)
    assert not (plain / REPORT_FILE).exists()


def test_runs_without_any_breakdown_still_get_a_picture(plain, tmp_path):
    write_run(tmp_path / "only_evals", [evaluation("test", 0, 0.5, 0.69)])
    report = write_report([plain, tmp_path / "only_evals"], tmp_path / "r.png")
    assert_png(report.output)
    assert report.summaries[1].samples_per_s is None
    row = report.table.splitlines()[2].split()
    assert row == ["only_evals", "0", "-", "-", "0.5000", "0.6900", "-"]


def test_a_step_logged_twice_keeps_its_last_event(tmp_path):
    run_dir = write_run(
        tmp_path / "twice",
        [train(100, 0.9, 10.0), evaluation("valid", 100, 0.6, 0.5), train(100, 0.5, 30.0)],
    )
    run = load_run(run_dir)
    assert [e["loss"] for e in run.train] == [0.5]
    assert summarize(run).samples_per_s == 30.0


def test_names_clash_then_the_paths_tell_runs_apart(tmp_path):
    a, b, c = tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "z"
    assert run_names([a, b, c]) == [str(a), str(b), "z"]


def test_a_directory_without_metrics_is_an_error_naming_it(plain, tmp_path, capsys):
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="'.*not_a_run' has no metrics.jsonl"):
        write_report([plain, empty], tmp_path / "r.png")
    assert main(["report", str(plain), str(empty)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"recsys: error: '{empty}' has no metrics.jsonl")
    assert not (plain / REPORT_FILE).exists()  # nothing written


def test_missing_directory_and_broken_file_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory not found: '.*nowhere'"):
        load_run(tmp_path / "nowhere")
    broken = write_run(tmp_path / "broken", [train(100, 0.5, 10.0)])
    with (broken / "metrics.jsonl").open("a") as f:
        f.write('{"split": "train", "st\n')
    with pytest.raises(ValueError, match="broken/metrics.jsonl' is not one JSON object per line"):
        load_run(broken)
    silent = write_run(tmp_path / "silent", [{"split": "resume", "step": 4, "checkpoint": "c"}])
    with pytest.raises(ValueError, match="holds no train or eval event yet"):
        load_run(silent)


def test_output_must_be_a_png_file(plain, tmp_path):
    assert output_path([plain], None) == plain / REPORT_FILE
    assert output_path([plain], tmp_path / "B.PNG") == tmp_path / "B.PNG"
    with pytest.raises(ValueError, match="directory '/nonexistent/dir' does not exist"):
        output_path([plain], "/nonexistent/dir/x.png")  # refused, not created at the root
    with pytest.raises(ValueError, match="--output 'report.pdf' must end in .png"):
        output_path([plain], "report.pdf")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        output_path([plain], tmp_path / "dir.png")


def test_report_refuses_config_overrides(plain, capsys):
    assert main(["report", str(plain), "--train.batch_size=4"]) == 2
    assert "unrecognized arguments: --train.batch_size=4" in capsys.readouterr().err
    assert not (plain / REPORT_FILE).exists()


def help_text(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_train_help_says_how_overrides_work_where_the_reference_is_and_shows_an_example(
    capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "100")
    out = help_text(["train"], capsys)
    assert "--section.key=value" in out and "--train.batch_size=4096" in out
    assert "recsys config --reference" in out
    example = out[out.index("example:") :].splitlines()[1:]
    assert example == [
        "  recsys train --config configs/dlrm_synthetic.toml --train.batch_size=4096 \\",
        "      --model.embedding_dim=32 --run.dir=runs/dlrm_dim32",
    ]
    # The example runs: its overrides are valid keys.
    trained = []
    monkeypatch.setattr("recsys.train.trainer.train", trained.append)
    argv = " ".join(line.strip(" \\") for line in example).split()[1:]
    assert main(argv) == 0
    assert trained[0].model.embedding_dim == 32 and trained[0].train.batch_size == 4096


@pytest.mark.parametrize(
    ("command", "keys"),
    [
        (None, "--section.key=value"),
        ("config", "--section.key=value"),
        ("eval", "--section.key=value"),
        ("preprocess", "--preprocess.key=value"),
        ("export", "takes no config keys"),
        ("predict", "takes no config keys"),
        ("report", "takes no config keys"),
    ],
)
def test_every_help_ends_with_config_keys_and_an_example(command, keys, capsys):
    out = help_text([] if command is None else [command], capsys)
    assert keys in out
    if keys != "takes no config keys":
        assert "recsys config --reference" in out
    example = out[out.index("\nexample:\n") :].splitlines()[2]
    assert example.startswith(f"  recsys {command or 'train'} ")


def draw(*run_dirs: Path) -> Figure:
    """The report figure of ``run_dirs``, laid out as in the PNG."""
    runs = [load_run(d) for d in run_dirs]
    figure = plot_report(runs, [summarize(run) for run in runs])
    figure.canvas.draw()
    return figure


def panel(figure: Figure, title: str) -> Axes:
    return next(ax for ax in figure.axes if ax.get_title() == title)


def test_throughput_ticks_say_their_value(tmp_path):
    """2,500 samples/s is "2.5k" (was "2k"), 7,500 "7.5k" (was "8k"); every drawn tick label
    reads back as its tick."""
    run_dir = write_run(tmp_path / "fast", [train(100, 0.5, 16_500.0), train(200, 0.4, 17_000.0)])
    speed = panel(draw(run_dir), "Training throughput")
    label = speed.yaxis.get_major_formatter()
    assert [label(v) for v in (0, 2_500, 7_500, 10_000, 80_000)] == [
        "0", "2.5k", "7.5k", "10k", "80k",
    ]  # fmt: skip
    assert label(1_250_000) == "1.25M"
    ticks = [t for t in speed.get_yticks() if 0 <= t <= speed.get_ylim()[1]]
    assert any(t % 1000 for t in ticks)  # the case that was rounded: ticks 2.5k apart
    for tick in ticks:
        number, unit = re.fullmatch(r"([\d.]+)([kM]?)", label(tick)).groups()
        assert float(number) * {"": 1, "k": 1e3, "M": 1e6}[unit] == pytest.approx(tick)


def near_equal_runs(tmp_path) -> tuple[Path, Path]:
    """Two runs whose AUCs differ in the 6th decimal, the same at step 200 and at the test; no
    oracle (it would widen the axis)."""

    def auc(split: str, step: int, value: float) -> dict:
        return {"split": split, "step": step, "auc": value, "logloss": 0.4}

    return tuple(
        write_run(
            tmp_path / name,
            [
                train(100, 0.5, 1000.0),
                auc("valid", 100, 0.850004 + delta),
                train(200, 0.4, 1000.0),
                auc("valid", 200, 0.850003),
                auc("test", 200, 0.850001),  # the lowest point, at the right end
            ],
        )
        for name, delta in (("a", 0.0), ("b", 0.000002))
    )


def test_near_equal_aucs_get_ticks_of_at_most_4_decimals(tmp_path):
    auc = panel(draw(*near_equal_runs(tmp_path)), "AUC")
    labels = [t.get_text().replace("\u2212", "-") for t in auc.get_yticklabels() if t.get_text()]
    assert len(labels) >= 3 and len(set(labels)) == len(labels)
    assert all(re.fullmatch(r"0\.\d{1,4}", label) for label in labels), labels
    assert auc.yaxis.get_offset_text().get_text() == ""  # no "+8.5e-1" above the axis


def marker_boxes(ax: Axes) -> list[tuple[tuple[float, int], np.ndarray, float]]:
    """(drawing order, display position, radius in pixels) of every marker drawn in ``ax``,
    the markers drawn first first."""
    to_pixels = ax.figure.dpi / 72
    boxes = []
    for index, line in enumerate(ax.get_lines()):
        if line.get_marker() in ("None", None, ""):
            continue
        radius = line.get_markersize() * to_pixels / 2
        for point in ax.transData.transform(line.get_xydata()):
            boxes.append(((line.get_zorder(), index), point, radius))
    return sorted(boxes, key=lambda box: box[0])


def test_auc_markers_stay_inside_the_axes_clear_of_the_legend_and_of_each_other(tmp_path):
    auc = panel(draw(*near_equal_runs(tmp_path)), "AUC")
    frame = auc.get_window_extent()
    legend = auc.get_legend().get_window_extent()
    boxes = marker_boxes(auc)
    assert len(boxes) == 6  # 2 runs x (2 valid + 1 test)
    for _, (x, y), r in boxes:
        assert frame.x0 <= x - r and x + r <= frame.x1 and frame.y0 <= y - r and y + r <= frame.y1
        outside = x + r < legend.x0 or x - r > legend.x1 or y + r < legend.y0 or y - r > legend.y1
        assert outside, ((x, y), legend)
    # Where markers meet (both runs' at step 200, each run's valid and test), the one drawn
    # later is smaller: both show.
    met = 0
    for i, (order_a, at_a, r_a) in enumerate(boxes):
        for order_b, at_b, r_b in boxes[i + 1 :]:
            if order_a != order_b and np.allclose(at_a, at_b, atol=2.0):
                met += 1
                assert r_b < r_a - 1.0, (at_a, r_a, r_b)
    assert met >= 3


def test_a_run_with_only_a_test_evaluation_gets_its_oracle_line(tmp_path):
    run_dir = write_run(
        tmp_path / "test_only",
        [train(100, 0.5, 1000.0), train(200, 0.4, 1000.0), evaluation("test", 200, 0.76, 0.43)],
    )
    figure = draw(run_dir)
    auc = panel(figure, "AUC")
    dashed = [line for line in auc.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1  # the oracle AUC of the test samples, across the run
    assert list(dashed[0].get_xdata()) == [100, 200]
    assert list(dashed[0].get_ydata()) == [0.87, 0.87]
    texts = [t.get_text() for t in auc.get_legend().get_texts()]
    assert texts == ["valid", "test (end)", "oracle (test)"]


@pytest.fixture
def compiled(tmp_path) -> Path:
    """A run under train.compile: its first window compiled for 40 s, which the trainer logs as
    compile_s, apart from the step parts and samples/s."""
    parts = {"data": 0.001, "forward": 0.005, "backward": 0.008, "optimizer": 0.001}
    first = timed(100, 0.50, 2000.0, **parts)
    first["compile_s"] = 40.0
    return write_run(
        tmp_path / "compiled",
        [
            first,
            timed(200, 0.45, 2000.0, **parts),
            evaluation("valid", 200, 0.74, 0.45),
            evaluation("test", 200, 0.75, 0.44),
        ],
    )


def test_compile_time_is_apart_from_the_step_time_bars(compiled, plain):
    summary = summarize(load_run(compiled))
    assert summary.compile_s == 40.0
    assert summary.step_ms == pytest.approx(
        {"data": 1.0, "forward": 5.0, "backward": 8.0, "optimizer": 1.0}
    )
    assert summary.samples_per_s == pytest.approx(2000.0)
    header, compiled_row, plain_row = format_table([summary, summarize(load_run(plain))]).split(
        "\n"
    )[:3]
    assert "samples/s  compile s  data ms" in header
    assert compiled_row.split()[6:9] == ["2,000", "40.0", "1.00"]
    assert plain_row.split()[6:8] == ["1,333", "-"]
    breakdown = panel(draw(compiled), "Where a step's time goes (mean ms per step)")
    widths = [patch.get_width() for patch in breakdown.patches]
    assert sum(widths) == pytest.approx(15.0)  # the bar holds the step parts only
    texts = [t.get_text() for t in breakdown.texts]
    assert "compiled   (+ compile 40.0 s, in no bar)" in texts
