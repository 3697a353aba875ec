"""Writing an exported program as a ``.pt2`` file, the one way every export (``recsys export``
of a CTR model, a sequence model's top-K program, a ranking model's candidate scores) does it,
and reading its members."""

from __future__ import annotations

import io
import json
import warnings
import zipfile
from pathlib import Path

import torch

from recsys._files import write_bytes_atomic
from recsys.checkpoint.io import CONFIG_FILE, SPEC_FILE


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse to replace an existing file unless asked, and never a directory."""
    if output.is_dir():
        raise ValueError(f"output '{output}' is a directory; give the file to write")
    if output.exists() and not overwrite:
        raise ValueError(f"output '{output}' exists; pass --overwrite to replace it")


def write_program(
    program: torch.export.ExportedProgram, checkpoint: Path, output: Path, extra: dict[str, str]
) -> Path:
    """Save ``program`` to ``output`` with the checkpoint's spec and config and the ``extra``
    files (name -> text) inside; the file appears only once complete. Returns ``output``."""
    extra_files = {name: (checkpoint / name).read_text() for name in (SPEC_FILE, CONFIG_FILE)}
    extra_files.update(extra)
    # Serialized in memory, then written by Python: torch's zip writer, writing to a full disk
    # itself, raises from its destructor and aborts the process.
    archive = io.BytesIO()
    with warnings.catch_warnings():
        # The tables are views of one packed buffer per collection; the archive stores that
        # buffer once and warns that no single parameter covers all of it.
        warnings.filterwarnings("ignore", message="No complete tensor found")
        torch.export.save(program, archive, extra_files=extra_files)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(output, archive.getbuffer())
    return output


def archive_text(path: Path, member: str) -> str:
    """The text of ``member`` (under the archive's top folder) of a zip archive."""
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(f"/{member}")]
        return archive.read(name).decode()


def archive_has(path: Path, member: str) -> bool:
    """Whether zip archive ``path`` holds ``member`` under its top folder (False: not a zip)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith(f"/{member}") for name in archive.namelist())


def check_served_export(path: Path, deltas: bool) -> None:
    """What ``recsys serve`` checks of an export file before its engine starts, each a one-line
    ``ValueError``: a file cut short (a zip without its end), a file ``recsys export`` did not
    write, a sequence model's export (scored by ``recsys predict``), ``--deltas`` for an export
    without dynamic tables."""
    if not zipfile.is_zipfile(path):
        with path.open("rb") as file:
            zip_start = file.read(4) == b"PK\x03\x04"
        if zip_start:
            raise ValueError(
                f"'{path}' is cut short: a zip archive without its end (a copy or download "
                "stopped early?); copy it again or export it again"
            )
        raise ValueError(f"'{path}' was not written by recsys export (it is not a .pt2 archive)")
    with zipfile.ZipFile(path) as archive:
        members = {name.rsplit("/", 1)[-1] for name in archive.namelist()}
    if SPEC_FILE not in members:
        raise ValueError(
            f"'{path}' was not written by recsys export (a .pt2 archive without {SPEC_FILE})"
        )
    for name in ("retrieval.json", "ranking.json"):
        if name in members:
            raise ValueError(
                f"'{path}' is a sequence model's export ({name} inside): `recsys predict` scores "
                "it; `recsys serve` serves click models"
            )
    if deltas:
        tables = json.loads(archive_text(path, "dynamic.json")) if "dynamic.json" in members else {}
        if not tables.get("tables"):
            raise ValueError(
                f"'{path}' has no dynamic tables for --deltas to update: serve it without "
                "--deltas (deltas carry the rows of dynamic tables)"
            )
