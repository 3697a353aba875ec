"""Command line: ``recsys train`` and ``recsys config``.

    recsys train --config configs/dlrm_synthetic.toml [--section.key=value ...]
    recsys config --config configs/dlrm_synthetic.toml [--section.key=value ...]   # resolved TOML
    recsys config --reference                                                   # all keys

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        if args.command == "config" and args.reference:
            print(config_reference(), end="")
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
