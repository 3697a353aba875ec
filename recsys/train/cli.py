"""Command line: ``recsys train`` and ``recsys config``.

    recsys train --config configs/dlrm_synthetic.toml [--section.key=value ...]
    recsys config --config configs/dlrm_synthetic.toml [--section.key=value ...]   # resolved TOML
    recsys config --reference                                                   # all keys
    recsys preprocess --format criteo --input train.txt.gz --output data/criteo     # ETL

User errors (a missing file, a config typo, bad input data) print one ``recsys: error: ...`` line
and exit with status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from recsys.config import config_reference, load_config, to_toml


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recsys",
        description="Train recommendation models. Any config key can be overridden with "
        "--section.key=value (see docs/config.md).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model from a TOML recipe")
    train.add_argument("--config", help="TOML recipe, e.g. configs/dlrm_synthetic.toml")
    show = commands.add_parser("config", help="print the resolved config, or the key reference")
    show.add_argument("--config", help="TOML recipe")
    show.add_argument("--reference", action="store_true", help="print every key with its doc")
    prep = commands.add_parser(
        "preprocess",
        help="raw Criteo TSV / parquet / CSV -> parquet + metadata for training",
        description="Each flag sets the [preprocess] key of the same name; any other key is "
        "--preprocess.key=value (see docs/config.md).",
    )
    prep.add_argument("--config", help="TOML file with a [preprocess] section")
    for flag, help_text in _PREPROCESS_FLAGS.items():
        prep.add_argument(f"--{flag}", help=help_text)
    return parser


_PREPROCESS_FLAGS = {
    "format": "criteo | parquet | csv",
    "input": "training data: file, directory or glob",
    "valid": "validation data (default: carved out of --input)",
    "test": "test data (default: carved out of --input)",
    "output": "directory to write",
    "categorical": "parquet/csv: comma-separated one-id categorical columns",
    "multi-hot": "parquet/csv: comma-separated list columns (CSV bags are a|b|c)",
    "dense": "parquet/csv: comma-separated numeric columns",
    "label": "parquet/csv: comma-separated 0/1 label column(s)",
}


def _preprocess(args: argparse.Namespace, overrides: list[str]) -> None:
    from recsys.data.etl import preprocess

    flags = [
        f"--preprocess.{flag.replace('-', '_')}={value}"
        for flag in _PREPROCESS_FLAGS
        if (value := getattr(args, flag.replace("-", "_"))) is not None
    ]
    config = load_config(args.config, [*flags, *overrides]).preprocess
    report = preprocess(config)
    rows = ", ".join(f"{split} {n:,}" for split, n in report.rows.items())
    tables = ", ".join(f"{c['name']}={c['cardinality']:,}" for c in report.metadata["categorical"])
    print(f"recsys: preprocessed into {report.output} in {report.seconds:.1f} s: rows {rows}")
    print(f"tables: {tables}")
    print(report.malformed.summary())
    for example in report.malformed.examples[1:]:
        print(f"  {example}")
    recipe = "configs/dlrm_synthetic.toml"
    print(f"train on it: recsys train --config {recipe} --data.path={report.output}")


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        if args.command == "config" and args.reference:
            print(config_reference(), end="")
            return 0
        if args.command == "preprocess":
            _preprocess(args, overrides)
            return 0
        config = load_config(args.config, overrides)
        if args.command == "config":
            print(to_toml(config), end="")
            return 0
        from recsys.train.trainer import train

        train(config)
        return 0
    except (ValueError, FileNotFoundError) as error:
        print(f"recsys: error: {error}", file=sys.stderr)
        return 2
