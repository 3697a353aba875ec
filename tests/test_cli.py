"""The command line, in process: every subcommand parses, overrides reach the config, user
errors are one line with exit status 2. The work behind each command (training, ETL, export,
scoring) is replaced by a stand-in that records what it was given; the end-to-end runs are in
test_trainer.py, test_export.py and tests/data."""

from __future__ import annotations

import errno
import runpy
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from recsys.cli import main
from recsys.config import config_reference, load_config, to_toml
from recsys.train.stop import TrainingStopped

SUBCOMMANDS = ["train", "eval", "config", "preprocess", "export", "predict", "report"]


class Called(Exception):
    """Raised by a stand-in with what the command passed it (main lets it through)."""


@pytest.fixture
def trained(monkeypatch):
    """Replace the trainer: the configs ``recsys train`` hands it are recorded."""
    configs = []
    monkeypatch.setattr("recsys.train.trainer.train", configs.append)
    return configs


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "my_recipe.toml"
    path.write_text("[train]\nbatch_size = 512\ndense_lr = 0.01\n[model]\nembedding_dim = 8\n")
    return path


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_train_overrides_reach_the_config(trained, recipe):
    overrides = ["--train.batch_size=77", "--run.seed=5", "--model.over_arch_layer_sizes=32,1"]
    overrides.append("--data.synthetic.zipf_alpha=1")
    assert main(["train", "--config", str(recipe), *overrides]) == 0
    (config,) = trained
    assert config.train.batch_size == 77  # command line beats the recipe
    assert config.train.dense_lr == 0.01  # the recipe beats the default
    assert config.model.embedding_dim == 8
    assert config.run.seed == 5
    assert config.model.over_arch_layer_sizes == [32, 1]
    assert config.data.synthetic.zipf_alpha == 1.0
    assert config.run.name == "my_recipe"
    assert config == load_config(recipe, overrides)


def test_train_without_a_recipe_uses_the_defaults(trained):
    assert main(["train"]) == 0
    assert trained == [load_config(None)]


@pytest.mark.parametrize("command", ["train", "config"])
def test_a_typo_in_a_key_is_one_line_naming_it_and_the_closest(command, trained, capsys):
    assert main([command, "--train.batchsize=4"]) == 2
    line = error_line(capsys)
    assert line.startswith("recsys: error: ")
    assert "unknown config key 'train.batchsize'" in line
    assert "did you mean 'train.batch_size'" in line
    assert trained == []


def test_a_typo_in_a_section_names_the_closest_section(trained, capsys):
    assert main(["train", "--trian.batch_size=4"]) == 2
    line = error_line(capsys)
    assert "unknown config key 'trian'" in line and "did you mean 'train'" in line


def test_an_override_without_equals_sign_is_an_error(trained, capsys):
    assert main(["train", "--train.batch_size", "4"]) == 2
    assert "'--train.batch_size' must look like --section.key=value" in error_line(capsys)
    assert trained == []


def test_a_missing_recipe_is_one_line(trained, tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert error_line(capsys) == f"recsys: error: config file not found: '{tmp_path / 'nope.toml'}'"


def test_config_prints_the_resolved_toml(recipe, capsys):
    assert main(["config", "--config", str(recipe), "--train.batch_size=77"]) == 0
    out = capsys.readouterr().out
    assert out == to_toml(load_config(recipe, ["--train.batch_size=77"]))
    table = tomllib.loads(out)
    assert table["train"]["batch_size"] == 77 and table["train"]["dense_lr"] == 0.01
    assert table["run"]["name"] == "my_recipe"


def test_config_reference_prints_every_key(capsys):
    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    assert out == config_reference()
    assert "`batch_size`" in out and "`forward_precision`" in out


def test_training_stopped_by_a_signal_exits_with_128_plus_its_number(monkeypatch, capsys):
    def stopped(config):
        raise TrainingStopped("SIGTERM", 7, Path("runs/x/checkpoints/step_00000007"))

    monkeypatch.setattr("recsys.train.trainer.train", stopped)
    assert main(["train"]) == 128 + 15
    assert error_line(capsys) == (
        "recsys: stopped by SIGTERM at step 7; checkpoint runs/x/checkpoints/step_00000007; "
        "continue with --checkpoint.resume=latest"
    )


def test_a_stop_under_torchrun_is_reported_by_rank_0_alone(monkeypatch, capsys):
    def stopped(config):
        raise TrainingStopped("SIGTERM", 7, Path("runs/x/checkpoints/step_00000007"))

    monkeypatch.setattr("recsys.train.trainer.train", stopped)
    monkeypatch.setenv("RANK", "1")
    assert main(["train"]) == 128 + 15  # every rank exits with the signal's status
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train"]) == 128 + 15
    assert error_line(capsys).startswith("recsys: stopped by SIGTERM at step 7")


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (
            ValueError("train.batch_size = 9 is too big"),
            2,
            "recsys: error: train.batch_size = 9 is too big",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device", "/data/run/x"),
            2,
            "recsys: error: no space left on the device of '/data/run/x'; free some space and "
            "run again",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "/ro/run"),
            2,
            "recsys: error: cannot write '/ro/run': Permission denied (a read-only directory or "
            "file?)",
        ),
        (KeyboardInterrupt(), 130, "recsys: interrupted"),
    ],
)
def test_errors_during_training_are_one_line(error, code, line, monkeypatch, capsys):
    def failing(config):
        raise error

    monkeypatch.setattr("recsys.train.trainer.train", failing)
    assert main(["train"]) == code
    assert error_line(capsys) == line


def test_other_ranks_say_which_rank_they_are(monkeypatch, capsys):
    def failing(config):
        raise ValueError("no data for this rank")

    monkeypatch.setattr("recsys.train.trainer.train", failing)
    monkeypatch.setenv("RANK", "3")
    assert main(["train"]) == 2
    assert error_line(capsys) == "recsys (rank 3): error: no data for this rank"
    monkeypatch.setenv("RANK", "0")
    assert main(["train"]) == 2
    assert error_line(capsys) == "recsys: error: no data for this rank"


def test_a_bug_is_not_hidden_as_a_user_error(monkeypatch):
    def buggy(config):
        raise RuntimeError("internal")

    monkeypatch.setattr("recsys.train.trainer.train", buggy)
    with pytest.raises(RuntimeError, match="internal"):
        main(["train"])


def test_preprocess_flags_and_overrides_set_the_preprocess_section(monkeypatch, tmp_path):
    def preprocess(config):
        raise Called(config)

    monkeypatch.setattr("recsys.data.etl.preprocess", preprocess)
    recipe = tmp_path / "etl.toml"
    recipe.write_text('[preprocess]\nformat = "parquet"\nseed = 4\nchunk_mb = 8\n')
    argv = ["preprocess", "--config", str(recipe), "--format", "csv", "--input", "in.csv"]
    argv += ["--output", "out", "--categorical", "a,b", "--multi-hot", "tags", "--dense", "x"]
    argv += ["--label", "click,like", "--preprocess.freq_threshold=3", "--preprocess.seed=9"]
    with pytest.raises(Called) as called:
        main(argv)
    (config,) = called.value.args
    assert config.format == "csv"  # the flag beats the recipe
    assert (config.input, config.output) == ("in.csv", "out")
    assert config.categorical == ["a", "b"]
    assert config.multi_hot == ["tags"]
    assert config.dense == ["x"]
    assert config.label == ["click", "like"]
    assert config.freq_threshold == 3
    assert config.seed == 9  # the command line beats the recipe
    assert config.chunk_mb == 8  # the recipe beats the default
    assert config.valid == "" and config.apply == ""  # flags not given keep their values


def test_preprocess_typo_names_the_closest_key(monkeypatch, capsys):
    monkeypatch.setattr("recsys.data.etl.preprocess", lambda config: pytest.fail("ran"))
    assert main(["preprocess", "--input", "x", "--preprocess.categorcal=a"]) == 2
    line = error_line(capsys)
    assert "'preprocess.categorcal'" in line and "did you mean 'preprocess.categorical'" in line


def test_export_passes_its_arguments(monkeypatch, tmp_path, capsys):
    calls = []

    def export_model(checkpoint, output, overwrite, top_k):
        calls.append((checkpoint, output, overwrite, top_k))
        Path(output).write_bytes(b"x" * 2048)
        return Path(output)

    checkpoint = tmp_path / "checkpoints" / "step_00000003"
    monkeypatch.setattr("recsys.checkpoint.io.resolve_checkpoint", lambda spec: checkpoint)
    monkeypatch.setattr("recsys.serve.export.export_model", export_model)
    output = str(tmp_path / "model.pt2")
    assert main(["export", "--checkpoint", str(tmp_path), "--output", output]) == 0
    assert main(["export", "--checkpoint", "x", "--output", output, "--overwrite"]) == 0
    assert main(["export", "--checkpoint", "x", "--output", output, "--top-k", "20"]) == 0
    assert calls == [
        (checkpoint, output, False, None),
        (checkpoint, output, True, None),
        (checkpoint, output, False, 20),
    ]
    out = capsys.readouterr().out
    assert f"recsys: exported {checkpoint} to {output}" in out
    assert f"recsys predict --model {output}" in out


def test_predict_passes_its_arguments(monkeypatch, tmp_path, capsys):
    calls = []

    def predict(model, input, output, batch_size, **options):
        calls.append(((model, input, output, batch_size), options))
        return SimpleNamespace(
            rows=1234,
            files=2,
            output=Path(output),
            columns=["score_click"],
            seconds=0.5,
            deltas_step=None if options["deltas"] is None else 40,
        )

    monkeypatch.setattr("recsys.serve.export.predict", predict)
    argv = ["predict", "--model", "m.pt2", "--input", "in/", "--output", "s.parquet"]
    assert main(argv) == 0
    assert "recsys: scored 1,234 rows of 2 file(s) into s.parquet (score_click) in" in (
        capsys.readouterr().out
    )
    extra = ["--batch-size", "300", "--transform", "--data", "d/", "--format", "csv"]
    extra += ["--cache-rows", "1000"]
    assert main([*argv, *extra, "--overwrite", "--deltas", "runs/r/deltas", "--top-k", "5"]) == 0
    defaults = {
        "overwrite": False,
        "transform": False,
        "data": None,
        "format": None,
        "top_k": None,
    }
    assert calls == [
        (("m.pt2", "in/", "s.parquet", 8192), {**defaults, "deltas": None, "cache_rows": None}),
        (
            ("m.pt2", "in/", "s.parquet", 300),
            {
                "overwrite": True,
                "transform": True,
                "data": "d/",
                "format": "csv",
                "deltas": "runs/r/deltas",
                "cache_rows": 1000,
                "top_k": 5,
            },
        ),
    ]
    assert "(score_click, dynamic tables at step 40) in" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "--checkpoint", "c", "--output", "m.pt2", "--train.batch_size=4"],
        ["predict", "--model", "m", "--input", "i", "--output", "o", "--train.batch_size=4"],
    ],
)
def test_export_and_predict_refuse_config_overrides(argv, monkeypatch, capsys):
    monkeypatch.setattr("recsys.serve.export.export_model", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr("recsys.serve.export.predict", lambda *a, **k: pytest.fail("ran"))
    assert main(argv) == 2
    assert error_line(capsys) == "recsys: error: unrecognized arguments: --train.batch_size=4"


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_of_every_subcommand_exits_0(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: recsys {command or ''}".rstrip())
    if command is None:
        assert all(name in out for name in SUBCOMMANDS)
    if command == "preprocess":
        assert "--multi-hot" in out and "--preprocess.key=value" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: command"),
        (["fit"], "invalid choice: 'fit'"),
        (["export", "--output", "m.pt2"], "the following arguments are required: --checkpoint"),
        (
            ["predict", "--model", "m", "--input", "i", "--output", "o", "--batch-size", "x"],
            "invalid int value: 'x'",
        ),
    ],
)
def test_malformed_command_lines_exit_2_with_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_recsys_runs_main(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["recsys", "config", "--train.batch_size=77"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("recsys", run_name="__main__")
    assert exited.value.code == 0
    assert "[train]\nbatch_size = 77" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["recsys", "config", "--train.batchsize=77"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("recsys", run_name="__main__")
    assert exited.value.code == 2  # main's status is the process's
    assert "did you mean 'train.batch_size'" in capsys.readouterr().err
