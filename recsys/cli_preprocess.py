"""``recsys preprocess``: its flags (each sets the ``[preprocess]`` key of the same name) and
what it prints of a preprocessing report (:mod:`recsys.cli` parses the command line)."""

from __future__ import annotations

import argparse

from recsys.config import PreprocessConfig, load_config

__all__ = ["PREPROCESS_FLAGS", "run_preprocess"]

PREPROCESS_FLAGS = {
    "format": "criteo | parquet | csv | interactions",
    "input": "training data: file, directory or glob",
    "valid": "validation data (default: carved out of --input)",
    "test": "test data (default: carved out of --input)",
    "output": "directory to write",
    "categorical": "parquet/csv: comma-separated one-id categorical columns",
    "multi-hot": "parquet/csv: comma-separated list columns (CSV bags are a|b|c)",
    "dense": "parquet/csv: comma-separated numeric columns",
    "label": "parquet/csv: comma-separated 0/1 label column(s)",
    "apply": "DATA_DIR written by preprocess: transform the input with its fitted workflow "
    "(same ids, table sizes and fingerprint; roles come from there)",
    "user": "interactions: the user column",
    "item": "interactions: the item column",
    "time": "interactions: the time column (a user's events are ordered by it)",
    "max-len": "interactions: the most recent events kept of a history (default 0: all)",
}


def run_preprocess(args: argparse.Namespace, overrides: list[str]) -> None:
    """Preprocess as the flags and ``--preprocess.key=value`` overrides say, and print the
    report."""
    from recsys.data.etl import preprocess

    flags = [
        f"--preprocess.{flag.replace('-', '_')}={value}"
        for flag in PREPROCESS_FLAGS
        if (value := getattr(args, flag.replace("-", "_"))) is not None
    ]
    config = load_config(args.config, [*flags, *overrides]).preprocess
    if config.format == "interactions":
        _preprocess_interactions(config)
        return
    report = preprocess(config)
    rows = ", ".join(f"{split} {n:,}" for split, n in report.rows.items())
    tables = ", ".join(f"{c['name']}={c['cardinality']:,}" for c in report.metadata["categorical"])
    print(f"recsys: preprocessed into {report.output} in {report.seconds:.1f} s: rows {rows}")
    if report.metadata.get("id_encoding") == "raw":  # no tables: count distinct train keys
        tables = ", ".join(
            f"{c['name']}~{c['distinct_estimate']:,}"
            for c in report.metadata["categorical"]
            if "distinct_estimate" in c
        )
        print(f"ids: raw 64-bit keys, no vocabulary; distinct train values (estimated): {tables}")
    else:
        print(f"tables: {tables}")
    if mlperf := report.metadata.get("mlperf"):
        drawn = mlperf["lookup_tables"]
        print(
            f"multi-hot: the reference's lookup tables ({drawn['bytes'] / 1e9:.2f} GB, deleted "
            f"after) drawn in {drawn['seconds']:.1f} s; distinct values per column: "
            + ", ".join(f"{n:,}" for n in mlperf["distinct_values"])
        )
    _print_malformed_and_notes(report)
    if report.rows["valid"]:  # an --apply output for scoring has train/ only
        recipe = (
            "configs/dlrm_dcnv2_mlperf.toml"
            if report.metadata.get("mlperf")
            else "configs/dlrm_synthetic.toml"
        )
        print(f"train on it: recsys train --config {recipe} --data.path={report.output}")


def _preprocess_interactions(config: PreprocessConfig) -> None:
    from recsys.data.sequences import preprocess_interactions

    report = preprocess_interactions(config)
    rows = ", ".join(f"{split} {n:,}" for split, n in report.rows.items())
    read = report.metadata["input"]
    sequence = report.metadata["sequence"]
    items = f"{sequence['num_items']:,} item ids" if sequence["num_items"] else "raw item keys"
    print(
        f"recsys: {read['interactions']:,} interactions of {read['users']:,} users -> histories "
        f"in {report.output} in {report.seconds:.1f} s: users {rows}; {items} "
        f"({report.metadata['encoding']}), max_len {sequence['max_len']}"
    )
    _print_malformed_and_notes(report)


def _print_malformed_and_notes(report) -> None:
    print(report.malformed.summary())
    print("".join(f"  {example}\n" for example in report.malformed.examples[1:]), end="")
    print("".join(f"{note}\n" for note in report.notes()), end="")
