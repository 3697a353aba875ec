"""Raw inputs: delimited text read line by line with line numbers, and parquet / CSV tables.

Every reader streams its file in pieces of about ``chunk_bytes`` and checks each row. A bad row
(wrong field count, a label that is not 0/1, a dense value that is not a finite number, ...)
is *malformed*: it is skipped and recorded in :class:`MalformedLines` with file, line (or row)
number, column and value, or stops the read in strict mode with that same message. Missing
values (an empty field, a parquet null) are not malformed: they stay null for a transform to
fill on purpose. A file that cannot be read (a truncated ``.gz``, a corrupt parquet file) gives
one ``ValueError`` naming it.

:func:`read_delimited` is the line-tracking core shared by the Criteo TSV reader
(``recsys.data.criteo.read_criteo``) and the CSV reader here; :func:`read_table` reads the
parquet and CSV inputs of ``recsys preprocess``.

:func:`signed_log1p` is the dense transform of ``recsys preprocess`` and ``CriteoDataset``.
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from recsys._suggest import quoted_with_hints

_EXAMPLES = 10
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4", ".br")
_NUMBER = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"  # no nan, no inf
_LABEL = r"^[01](\.0*)?$"

# (malformed mask, kind and detail per row) for the rows of a table of strings; None: all fine
FieldCheck = Callable[[pa.Table], "tuple[np.ndarray, list[str], list[str]] | None"]


def signed_log1p(x: np.ndarray) -> np.ndarray:
    """sign(x) * log(1 + |x|): log(1 + x) for counts x >= 0, and odd, so negative values keep
    their sign and magnitude order instead of being clipped. Works on pandas series as well
    (NVTabular runs it on each dense column)."""
    return np.sign(x) * np.log1p(np.abs(x))


@dataclass
class MalformedLines:
    """Malformed lines met while reading: counts per reason and the first few examples."""

    count: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, path: Path, line: int, kind: str, detail: str) -> None:
        """Record line ``line`` of ``path``, malformed because of ``kind`` (``detail`` says how)."""
        self.count += 1
        self.reasons[kind] += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(f"{path}:{line}: {detail}")

    def summary(self) -> str:
        if not self.count:
            return "no malformed lines"
        kinds = ", ".join(f"{n} x {r}" for r, n in self.reasons.most_common())
        return f"skipped {self.count} malformed line(s) ({kinds}); first: {self.examples[0]}"


@dataclass
class Roles:
    """Which input column plays which part."""

    categorical: list[str]
    multi_hot: list[str]
    dense: list[str]
    labels: list[str]

    @property
    def sparse(self) -> list[str]:
        return self.categorical + self.multi_hot

    @property
    def all(self) -> list[str]:
        return self.labels + self.dense + self.sparse


def unreadable(path: Path, error: Exception) -> str:
    """One line saying that ``path`` could not be read, and why."""
    reason = " ".join(str(error).split())
    if path.name.endswith(_COMPRESSED):
        return f"'{path}' is truncated or corrupt ({reason}); check or fetch the file again"
    return f"'{path}' could not be read: {reason}"


# ---------------------------------------------------------------------------------------------
# Delimited text, line by line


def read_delimited(
    path: Path,
    *,
    column_names: list[str] | None,
    columns: list[str],
    delimiter: str,
    quote_char: str | bool,
    chunk_bytes: int,
    strict: bool,
    malformed: MalformedLines,
    check: FieldCheck,
) -> Iterator[pa.Table]:
    """Stream a delimited text file (compression detected from the name) as tables of strings.

    Args:
        path: the file.
        column_names: names of the fields; None: the first line is a header naming them.
        columns: the fields to keep (strings; an empty field is ``""``).
        delimiter, quote_char: the field separator and quote character (False: none).
        chunk_bytes: bytes parsed per piece; memory stays a small multiple of this.
        strict: raise ``ValueError`` ``"<path>:<line>: malformed line: <detail>"`` at the first
            malformed line instead of skipping it.
        malformed: collects the skipped lines.
        check: finds the malformed rows of a piece (beyond a wrong field count and an empty
            line, which are found here).

    Yields:
        One table per piece, the rows of the well-formed lines in file order.
    """
    # Lines the parser dropped (line number -> detail), reported (or, in strict mode, raised)
    # in line order with the bad fields of the rows around them.
    wrong_width: dict[int, str] = {}
    reader = _open_delimited(
        path, column_names, columns, delimiter, quote_char, chunk_bytes, wrong_width
    )
    next_line = 1 if column_names else 2
    while True:
        try:
            with _read_errors(path):
                record_batch = reader.read_next_batch()
        except StopIteration:
            break
        table = pa.Table.from_batches([record_batch])
        table, problems, next_line = _check_piece(table, next_line, wrong_width, check)
        _report(path, sorted(problems), strict, malformed)
        yield table
    _report(
        path, [(n, "field count", wrong_width[n]) for n in sorted(wrong_width)], strict, malformed
    )


@contextmanager
def _read_errors(path: Path) -> Iterator[None]:
    """Errors of arrow's reader -> one ``ValueError`` naming ``path``."""
    try:
        yield
    except pa.ArrowInvalid as error:
        raise ValueError(f"{path}: {error}") from None
    except OSError as error:
        raise ValueError(unreadable(path, error)) from None


_DELIMITER_NAMES = {"\t": "tab", ",": "comma", ";": "semicolon", "|": "pipe"}


def _open_delimited(
    path: Path,
    column_names: list[str] | None,
    columns: list[str],
    delimiter: str,
    quote_char: str | bool,
    chunk_bytes: int,
    wrong_width: dict[int, str],
) -> pcsv.CSVStreamingReader:
    """Arrow's streaming reader of ``path`` (see :func:`read_delimited` for the arguments).

    The lines with a wrong field count are skipped; the reader records them in ``wrong_width``
    (line number -> detail) as it meets them.
    """
    separated = _DELIMITER_NAMES.get(delimiter, repr(delimiter))

    def on_invalid_row(row: pcsv.InvalidRow) -> str:
        detail = f"expected {row.expected_columns} {separated}-separated fields, found "
        wrong_width[row.number] = detail + str(row.actual_columns) + _other_format(row, delimiter)
        return "skip"

    with _read_errors(path):
        return pcsv.open_csv(
            pa.input_stream(str(path), compression="detect"),
            read_options=pcsv.ReadOptions(
                column_names=column_names, block_size=chunk_bytes, use_threads=False
            ),
            parse_options=pcsv.ParseOptions(
                delimiter=delimiter,
                quote_char=quote_char,
                ignore_empty_lines=False,  # an empty line is reported, and counted in line numbers
                invalid_row_handler=on_invalid_row,
            ),
            convert_options=pcsv.ConvertOptions(
                column_types={c: pa.string() for c in columns},
                include_columns=columns,
                strings_can_be_null=False,
            ),
        )


def _other_format(row: pcsv.InvalidRow, delimiter: str) -> str:
    """A hint for a line without a single ``delimiter`` that another delimiter splits (a CSV
    read as Criteo's tab-separated text, or the reverse); empty otherwise."""
    if row.actual_columns != 1 or not row.text:
        return ""
    for other, name in _DELIMITER_NAMES.items():
        if other != delimiter and (count := row.text.count(other)):
            own = _DELIMITER_NAMES.get(delimiter, repr(delimiter))
            return f" (no {own} in the line but {count} {name}(s): is it another format?)"
    return ""


def _check_piece(
    table: pa.Table, next_line: int, wrong_width: dict[int, str], check: FieldCheck
) -> tuple[pa.Table, list[tuple[int, str, str]], int]:
    """Split a piece read from line ``next_line`` on into its well-formed rows and the problems
    of the lines it spans: those the parser dropped (taken out of ``wrong_width``) and the rows
    ``check`` (or the empty-line check) finds.

    Returns:
        (the well-formed rows, (line, kind, detail) per problem, the line after the piece).
    """
    lines = _line_numbers(next_line, table.num_rows, wrong_width)
    last = int(lines[-1]) if len(lines) else next_line
    problems = [(n, "field count", wrong_width.pop(n)) for n in list(wrong_width) if n < last]
    next_line = last + 1 if len(lines) else next_line
    bad = _check_lines(table, check)
    if bad is not None:
        mask, kinds, details = bad
        problems += [(int(lines[r]), kinds[r], details[r]) for r in np.flatnonzero(mask)]
        table = table.filter(pa.array(~mask))
    return table, problems, next_line


def _report(
    path: Path, problems: list[tuple[int, str, str]], strict: bool, malformed: MalformedLines
) -> None:
    if strict and problems:
        line, _, detail = problems[0]
        raise ValueError(f"{path}:{line}: malformed line: {detail}")
    for line, kind, detail in problems:
        malformed.add(path, line, kind, detail)


def _line_numbers(first: int, num_rows: int, skipped: dict[int, str]) -> np.ndarray:
    """Line numbers of the ``num_rows`` rows read from line ``first`` on, skipping the lines
    the parser dropped."""
    later = sum(1 for n in skipped if n >= first)
    candidates = np.arange(first, first + num_rows + later)
    if later:
        candidates = candidates[~np.isin(candidates, list(skipped))]
    return candidates[:num_rows]


def _check_lines(table: pa.Table, check: FieldCheck) -> tuple[np.ndarray, list, list] | None:
    """``check``, with rows whose every field is empty reported as an empty line (the parser
    turns an empty line into such a row)."""
    empty = np.ones(table.num_rows, dtype=bool)
    for column in table.columns:
        empty &= pc.equal(column, "").to_numpy(zero_copy_only=False)
        if not empty.any():
            break
    bad = check(table)
    if not empty.any():
        return bad
    mask, kinds, details = bad or (
        np.zeros(table.num_rows, bool),
        [""] * table.num_rows,
        [""] * table.num_rows,
    )
    for row in np.flatnonzero(empty):
        kinds[row] = details[row] = "empty line"
    return mask | empty, kinds, details


def field_failures(
    table: pa.Table, checks: list[tuple[str, Callable[[pa.ChunkedArray], np.ndarray], str]]
) -> tuple[np.ndarray, list[str], list[str]] | None:
    """Rows of a table of strings with a bad field.

    Args:
        checks: (column, valid-value mask of its values, message with ``{!r}`` for the value),
            in the order of the fields: a row is reported for its first bad field.
    """
    mask = np.zeros(table.num_rows, dtype=bool)
    failures = []
    for column, valid, message in checks:
        values = table.column(column)
        column_bad = ~valid(values)
        if column_bad.any():
            failures.append((column, column_bad, values, message))
            mask |= column_bad
    if not mask.any():
        return None
    kinds = [""] * table.num_rows
    details = [""] * table.num_rows
    for column, column_bad, values, message in reversed(failures):  # keep the first bad field
        for row in np.flatnonzero(column_bad):
            kinds[row] = column
            details[row] = message.format(values[int(row)].as_py())
    return mask, kinds, details


def matching(pattern: str, empty_allowed: bool) -> Callable[[pa.ChunkedArray], np.ndarray]:
    """A field check: the values match ``pattern`` (or are empty, when allowed)."""

    def valid(values: pa.ChunkedArray) -> np.ndarray:
        ok = pc.match_substring_regex(values, pattern)
        if empty_allowed:
            ok = pc.or_(ok, pc.equal(values, ""))
        return ok.to_numpy(zero_copy_only=False)

    return valid


def _finite_or_empty(values: pa.ChunkedArray) -> np.ndarray:
    """A field check: a number that is finite as float32 (not ``nan``, ``inf``, ``1e999``)."""
    number = pc.match_substring_regex(values, _NUMBER)
    parsed = pc.cast(pc.cast(pc.if_else(number, values, None), pa.float64()), pa.float32())
    ok = pc.or_kleene(pc.equal(values, ""), pc.is_finite(parsed))
    return pc.fill_null(ok, False).to_numpy(zero_copy_only=False)


def empty_to_null(values: pa.ChunkedArray) -> pa.ChunkedArray:
    """``""`` -> null: an empty field is a missing value."""
    return pc.if_else(pc.equal(values, ""), pa.scalar(None, values.type), values)


# ---------------------------------------------------------------------------------------------
# Parquet and CSV tables with named columns


def column_names(path: Path, format: str) -> list[str]:
    """The column names of a parquet file or a CSV file's header."""
    if format == "parquet":
        return _parquet_file(path).schema_arrow.names
    try:
        with pa.input_stream(str(path), compression="detect") as stream:
            head = b""
            while b"\n" not in head and (piece := stream.read(1 << 16)):
                head += piece
    except OSError as error:
        raise ValueError(unreadable(path, error)) from None
    header = head.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8-sig", errors="replace")
    return next(csv.reader([header]), [])


def read_table(
    format: str,
    path: Path,
    roles: Roles,
    chunk_bytes: int,
    strict: bool,
    malformed: MalformedLines,
) -> Iterator[pa.Table]:
    """Stream a parquet or CSV file as checked tables with the columns of ``roles``.

    Labels become float32 0/1, dense values float32 (null when missing), categorical values
    as they are (null when missing; CSV: strings, an empty field is missing) and multi-hot
    values lists (CSV: ``a|b|c``, an empty field an empty bag, an empty item null).

    Malformed rows are reported by line number for CSV (the header is line 1) and by row number
    (from 1) for parquet.
    """
    names = column_names(path, format)
    _require_columns(names, roles, path)
    if format == "csv":
        yield from _read_csv(path, roles, chunk_bytes, strict, malformed)
        return
    file = _parquet_file(path)
    _require_types(file.schema_arrow, roles, path)
    num_rows = max(file.metadata.num_rows, 1)
    size = sum(file.metadata.row_group(i).total_byte_size for i in range(file.num_row_groups))
    rows_per_piece = max(1024, chunk_bytes * num_rows // max(size, 1))
    first_row = 1
    try:
        for batch in file.iter_batches(batch_size=rows_per_piece, columns=roles.all):
            table = pa.Table.from_batches([batch])
            yield _check_parquet(table, roles, path, first_row, strict, malformed)
            first_row += table.num_rows
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(unreadable(path, error)) from None


def _parquet_file(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"'{path}' is not a readable parquet file: {error}") from None


def _require_columns(names: list[str], roles: Roles, path: Path) -> None:
    missing = [c for c in roles.all if c not in names]
    if missing:
        hints = quoted_with_hints(missing, names, taken=roles.all)
        raise ValueError(f"'{path}' has no column(s) {hints}; its columns: {names}")


def _require_types(schema: pa.Schema, roles: Roles, path: Path) -> None:
    """Numbers where numbers are needed, lists where bags are: else one error naming the column
    (instead of a cast failure deep inside the pipeline)."""
    for role, names in (("label", roles.labels), ("dense", roles.dense)):
        for name in names:
            kind = schema.field(name).type
            numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
            if not (numeric or (role == "label" and pa.types.is_boolean(kind))):
                raise ValueError(f"'{path}': {role} column '{name}' is {kind}, not numeric")
    for name in roles.multi_hot:
        if not pa.types.is_list(schema.field(name).type):
            raise ValueError(
                f"'{path}': multi-hot column '{name}' is {schema.field(name).type}, not a list; "
                "give one-id columns as --categorical"
            )
    for name in roles.categorical:
        if pa.types.is_list(schema.field(name).type):
            raise ValueError(
                f"'{path}': categorical column '{name}' is a list; give it as --multi-hot"
            )


def _check_parquet(
    table: pa.Table,
    roles: Roles,
    path: Path,
    first_row: int,
    strict: bool,
    malformed: MalformedLines,
) -> pa.Table:
    """Labels must be 0/1 and dense values finite (null means missing and is allowed)."""
    checks = []  # (role, column, values, malformed mask, what is wrong)
    columns = {}
    for name in roles.labels:
        values = pc.cast(table.column(name), pa.float32()).to_numpy(zero_copy_only=False)
        checks.append(("label", name, values, ~np.isin(values, [0.0, 1.0]), "is not 0 or 1"))
        columns[name] = pa.array(np.nan_to_num(values), pa.float32())
    for name in roles.dense:
        column = pc.cast(table.column(name), pa.float32())
        values = column.to_numpy(zero_copy_only=False)  # null -> nan here
        missing = column.is_null().to_numpy(zero_copy_only=False)
        checks.append(("dense", name, values, ~np.isfinite(values) & ~missing, "is not finite"))
        columns[name] = column
    for name in roles.sparse:
        columns[name] = table.column(name)
    bad = np.zeros(table.num_rows, dtype=bool)
    problems = []
    for role, name, values, wrong, what in checks:
        for row in np.flatnonzero(wrong & ~bad):  # report the first bad field of a row
            number = first_row + int(row)
            problems.append((number, name, f"row {number}: {role} {name} {values[row]!r} {what}"))
        bad |= wrong
    for number, kind, detail in sorted(problems):
        if strict:
            raise ValueError(f"{path}: {detail}")
        malformed.add(path, number, kind, detail)
    return pa.table(columns).filter(pa.array(~bad))


def _read_csv(
    path: Path, roles: Roles, chunk_bytes: int, strict: bool, malformed: MalformedLines
) -> Iterator[pa.Table]:
    checks = [
        (c, matching(_LABEL, False), "label " + c + " {!r} is not 0 or 1") for c in roles.labels
    ]
    checks += [
        (c, _finite_or_empty, "dense " + c + " {!r} is not a finite number") for c in roles.dense
    ]
    columns = [c for c in column_names(path, "csv") if c in set(roles.all)]
    pieces = read_delimited(
        path,
        column_names=None,
        columns=columns,
        delimiter=",",
        quote_char='"',
        chunk_bytes=chunk_bytes,
        strict=strict,
        malformed=malformed,
        check=lambda table: field_failures(table, checks),
    )
    for table in pieces:
        converted = {}
        for name in roles.labels:
            converted[name] = pc.cast(pc.cast(table.column(name), pa.float64()), pa.float32())
        for name in roles.dense:
            values = empty_to_null(table.column(name))
            converted[name] = pc.cast(pc.cast(values, pa.float64()), pa.float32())
        for name in roles.categorical:
            converted[name] = empty_to_null(table.column(name))
        for name in roles.multi_hot:  # a CSV bag is "a|b|c"
            values = table.column(name).combine_chunks()
            bags = pc.split_pattern(values, "|")
            bags = pc.if_else(pc.equal(values, ""), pa.scalar([], bags.type), bags)
            converted[name] = _with_items(bags, empty_to_null(pc.list_flatten(bags)))
        yield pa.table({name: converted[name] for name in roles.all})


def _with_items(bags: pa.ListArray, items: pa.Array) -> pa.ListArray:
    """``bags`` (without nulls) with their flattened items replaced by ``items``."""
    offsets = pc.subtract(bags.offsets, bags.offsets[0])
    return pa.ListArray.from_arrays(offsets, items)
