"""The directory ``recsys preprocess`` writes: its metadata, its fingerprint, and replacing it
without losing data.

Layout: ``metadata.json`` (column roles, cardinalities, id encoding, row counts, dense
transform, fingerprint), ``train/``, ``valid/``, ``test/`` (``part_*.parquet``, each carrying the
fingerprint in its schema metadata under ``recsys.preprocess``), ``workflow/`` (the fitted
NVTabular workflow) and ``categories/`` (neither for ``encoding = "raw"``: nothing is fitted).
"""

from __future__ import annotations

import glob
import json
import secrets
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from recsys._files import is_inside

METADATA = "metadata.json"
SPLITS = ("train", "valid", "test")
FORMAT_VERSION = 1
FINGERPRINT_KEY = b"recsys.preprocess"
_WRITTEN = {METADATA, *SPLITS, "workflow", "categories"}  # what an output directory holds


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata.json of a preprocessed directory, with a clear error when it is not one.

    Directories written before fingerprints existed read with ``"fingerprint": ""`` and the
    dense transform they were made with (log(1 + max(x, 0))); those written before raw keys
    existed with ``"id_encoding": "index"``.
    """
    file = Path(path) / METADATA
    if not file.is_file():
        raise FileNotFoundError(
            f"'{path}' is not a preprocessed dataset (no {METADATA}); create one with "
            "`recsys preprocess`"
        )
    metadata = json.loads(file.read_text())
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"'{file}' has format_version {metadata.get('format_version')}; this recsys reads "
            f"{FORMAT_VERSION}: preprocess the data again"
        )
    metadata.setdefault("fingerprint", "")
    metadata.setdefault("id_encoding", "index")  # written before raw keys existed
    if "dense_transform" not in metadata:  # written before the signed transform
        options = metadata.get("preprocess", {})
        metadata["dense_transform"] = dense_transform(
            options.get("log_dense", True), options.get("normalize_dense", False), clipped=True
        )
    return metadata


def file_fingerprint(path: str | Path) -> str | None:
    """The fingerprint (see ``metadata.json``) of the preprocessed dataset a parquet file was
    written for, or None when recsys preprocess did not write it (raw input). ``""``: written
    by a preprocess run from before fingerprints (or applied from such a directory)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no such parquet file: '{path}'")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"'{path}' is not a readable parquet file: {error}") from None
    value = (schema.metadata or {}).get(FINGERPRINT_KEY)
    return None if value is None else value.decode()


def dense_transform(log: bool, normalize: bool, clipped: bool = False) -> str:
    """The dense transform in words (``dense_transform`` in metadata.json); ``clipped``: the
    log(1 + max(x, 0)) of directories written before the signed transform."""
    steps = ["missing -> 0"]
    if log:
        steps.append("log(1 + max(x, 0))" if clipped else "sign(x) * log(1 + |x|)")
    if normalize:
        steps.append("standardized with the train split's mean and std")
    return ", then ".join(steps)


def check_output(output: Path, overwrite: bool, inputs: list[Path]) -> None:
    """Refuse an output that would lose data: one holding an input, a file, or a non-empty
    directory that preprocess did not write; one it wrote needs ``overwrite``."""
    for path in inputs:
        if is_inside(path, output):
            raise ValueError(
                f"input '{path}' is inside the output directory '{output}', which preprocess "
                "replaces; write the output somewhere else"
            )
    if not output.exists() and not output.is_symlink():
        return
    if output.is_symlink() or not output.is_dir():
        raise ValueError(f"output '{output}' exists and is not a directory; give a new path")
    entries = sorted(p.name for p in output.iterdir())
    if not entries:
        return  # an empty directory: nothing to lose
    refuse = f"refusing to replace output '{output}'"
    if not written_by_preprocess(output):
        raise ValueError(
            f"{refuse}: it is not empty and recsys preprocess did not write it (no valid "
            f"{METADATA}); give a new or empty directory"
        )
    foreign = [e for e in entries if e not in _WRITTEN]
    for split in SPLITS:
        if (output / split).is_dir():
            foreign += [
                f"{split}/{p.name}"
                for p in sorted((output / split).iterdir())
                if not (p.name.startswith("part_") and p.suffix == ".parquet")
            ]
    if foreign:
        raise ValueError(
            f"{refuse}: it holds files recsys preprocess did not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); move them out or give another directory"
        )
    if not overwrite:
        raise ValueError(
            f"output '{output}' already exists (written by recsys preprocess); pass "
            "--preprocess.overwrite=true to replace it"
        )


def written_by_preprocess(directory: Path) -> bool:
    try:
        metadata = json.loads((directory / METADATA).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(metadata, dict) and {"format_version", "splits"} <= metadata.keys()


def new_directory_beside(output: Path, kind: str) -> Path:
    """A new directory ``.<name>.<random>.<kind>`` beside ``output`` that only this call created
    (unlike ``tempfile.mkdtemp``, with the permissions the umask gives, as the output's)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    while True:
        directory = output.parent / f".{output.name}.{secrets.token_hex(4)}.{kind}"
        try:
            directory.mkdir()
            return directory
        except FileExistsError:
            continue


def replace_output(output: Path, work: Path) -> None:
    """Move the finished ``work`` to ``output``. An old output is renamed aside first and
    deleted last, so a crash at any moment leaves the old or the new dataset on disk."""
    if not output.exists():
        work.rename(output)
        return
    aside = new_directory_beside(output, "old")
    old = output.rename(aside / output.name)
    try:
        work.rename(output)
    except BaseException:
        old.rename(output)
        aside.rmdir()
        raise
    shutil.rmtree(aside)


def input_files(spec: str, what: str) -> list[Path]:
    """The files ``spec`` names (a file, a directory's visible files, or a glob), sorted;
    ``what`` names the option in errors."""
    if not spec:
        raise ValueError(f"preprocess.{what} is empty; give the file(s) to read (--{what} PATH)")
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    elif any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec))
    else:
        files = [path]
    missing = [str(p) for p in files if not p.is_file()]
    if missing or not files:
        raise FileNotFoundError(f"{what}: no such file(s): {', '.join(missing) or spec}")
    return files
