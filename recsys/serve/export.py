"""Inference: ``recsys export`` (checkpoint -> one ``.pt2`` file) and ``recsys predict`` (score
parquet files with it).

The export is a ``torch.export`` ExportedProgram written by ``torch.export.save``: the model's
forward traced into ATen ops, with the trained weights inside, runnable in one CPU process with
nothing but torch (no recsys, TorchRec or checkpoint directory). Load it with
``torch.export.load(path).module()``, or with :func:`load_exported`, which also returns the
dataset spec saved beside the program. Its forward, with B samples (any B >= 1), F categorical
features and L ids in all (any L >= 0)::

    dense    f32[B, N_dense]   dense features, in spec.dense_names order
    values   int64[L]          every bag's ids, key-major: all of feature 0's bags, then
                               feature 1's, ... (spec.sparse_names order), as a TorchRec
                               KeyedJaggedTensor holds them
    lengths  int64[F * B]      bag lengths in the same order (lengths[f*B + b]: sample b,
                               feature f; 0 is an empty bag)
    ->       f32[B, T]         click probabilities sigmoid(logits), tasks in spec.label_names
                               order

The archive also carries the checkpoint's ``spec.json`` (feature names, table sizes, labels)
and ``config.toml`` (the training config) as extra files. A collection's tables are looked up
by one op (:mod:`recsys.serve.packed_export`); an id outside its table fails the program, and
:func:`predict` checks ids first, naming the column.

Dynamic tables are looked up in a frozen map inside the program: per table a constant of map
keys (``num_buckets`` buckets of ``bucket_size`` slots, fixed in the graph) and its rows. The
extra file ``dynamic.json`` records the checkpoint's step and lineage
(:mod:`recsys.checkpoint.lineage`) and, per dynamic table, the names of those tensors in the
program, so that ``recsys predict --deltas`` (``load_exported(path, deltas=...)``) can bring the
tables forward with the deltas written after that step by the same run
(:mod:`recsys.serve.exported_deltas`: each table's keys and rows rebuilt in place, in the same
map layout; a table whose keys no longer fit the map, or a delta that does not continue the
export's checkpoint, is named). Dense layers and fixed tables stay the export's.

Tables in the host or disk tier (``[model.storage]``) are not inside the program: it takes their
pooled vectors as a fourth input; their rows go beside it (``<output>.tables/``), read through
a bounded cache by :func:`load_program` (:mod:`recsys.serve.tiered_export`,
:mod:`recsys.serve.cached_tables`); the loaded module takes the three inputs above."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from glob import glob
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys._files import is_inside, remove_quietly, write_failure
from recsys._suggest import quoted_with_hints
from recsys.checkpoint.io import (
    CONFIG_FILE,
    SPEC_FILE,
    checkpoint_step,
    load_model,
    read_config,
    read_spec,
    resolve_checkpoint,
)
from recsys.checkpoint.lineage import read_lineage
from recsys.config import SEQUENCE_MODELS, TARGET_RANKING_MODELS
from recsys.data.batch import Batch, DatasetSpec
from recsys.data.parquet import table_to_batch
from recsys.data.prepared import file_fingerprint, new_directory_beside, read_metadata
from recsys.ops.slot_map.hash_map import check_keys
from recsys.serve import ranking_export
from recsys.serve.cached_tables import attach_cached_tables
from recsys.serve.exported_deltas import (
    DYNAMIC_FILE,
    apply_exported_deltas,
    exported_dynamic_tables,
)
from recsys.serve.packed_export import pack_for_export
from recsys.serve.program_file import archive_has, archive_text, check_output, write_program
from recsys.serve.retrieval_export import (
    RETRIEVAL_FILE,
    check_retrieval_options,
    export_retrieval,
    predict_top_k,
)
from recsys.serve.tiered_export import TIERED_FILE, keep_tiered_rows, rows_beside, tiered_export

__all__ = [
    "InferenceModule",
    "PredictReport",
    "export_model",
    "load_exported",
    "load_program",
    "predict",
]


class InferenceModule(nn.Module):
    """A recsys model behind plain-tensor inputs, returning probabilities: what is exported.

    Args:
        model: ``forward(dense, KeyedJaggedTensor) -> logits [B, T]``, in eval mode.
        spec: the dataset spec the model was trained on (its sparse names are the KJT keys).
    """

    def __init__(self, model: nn.Module, spec: DatasetSpec) -> None:
        super().__init__()
        self.model = model
        self.keys = list(spec.sparse_names)

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        # Offsets computed here keep the graph ATen-only (the KJT would call an FBGEMM op);
        # stride = B ties the bags to the dense rows (lengths holds F*B entries).
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])  # [F*B + 1]
        sparse = KeyedJaggedTensor(
            keys=self.keys, values=values, lengths=lengths, offsets=offsets, stride=dense.shape[0]
        )
        return torch.sigmoid(self.model(dense, sparse))  # [B, T]


def export_model(
    checkpoint: str | Path,
    output: str | Path,
    *,
    overwrite: bool = False,
    top_k: int | None = None,
) -> Path:
    """Export a checkpoint's model as a ``torch.export`` ExportedProgram file (``.pt2``).

    Args:
        checkpoint: a checkpoint directory, or a run directory / its ``checkpoints/`` (its
            newest checkpoint).
        output: the file to write; it appears only once complete.
        overwrite: replace ``output`` when it exists (else that is an error).
        top_k: a sequence model's K: its program returns each history's top K items (None:
            100, or every item when fewer).

    Returns:
        ``output``. Sequence models (sasrec, hstu) export a top-K program, hstu_ranking a
        candidate-scoring one (:mod:`recsys.serve.retrieval_export`, ``ranking_export``).

    Raises:
        ValueError: ``output`` exists and ``overwrite`` is False, or is a directory; a
            ``top_k`` outside [1, the items the model ranks], or for a CTR model.

    Example::

        export_model("runs/dlrm", "model.pt2")
        scores = torch.export.load("model.pt2").module()(dense, values, lengths)  # [B, T]
    """
    checkpoint = resolve_checkpoint(checkpoint)
    output = Path(output)
    check_output(output, overwrite)
    name = read_config(checkpoint).model.name
    if name in TARGET_RANKING_MODELS:  # each history's candidates scored
        return ranking_export.export_ranking(checkpoint, output, top_k)
    if name in SEQUENCE_MODELS or top_k is not None:  # top-K items of a history
        return export_retrieval(checkpoint, output, top_k)
    spec = read_spec(checkpoint)
    model = load_model(checkpoint, device="cpu").requires_grad_(False)
    batch, ids = torch.export.Dim("batch", min=1), torch.export.Dim("ids", min=0)
    num_sparse = len(spec.sparse_names)
    module = InferenceModule(model, spec)
    inputs = _example_inputs(spec)
    shapes = {"dense": {0: batch}, "values": {0: ids}, "lengths": {0: num_sparse * batch}}
    # Tiered tables are looked up outside the program (tiered.json says how).
    module, inputs, shapes, extra = tiered_export(model, module, inputs, shapes, checkpoint)
    pack_for_export(model, spec.sparse_names)  # the others' features: one lookup per call
    program = torch.export.export(module, inputs, dynamic_shapes=shapes)
    dynamic = exported_dynamic_tables(
        program, module, checkpoint_step(checkpoint), read_lineage(checkpoint)
    )
    extra[DYNAMIC_FILE] = json.dumps(dynamic, indent=1) + "\n"
    keep_tiered_rows(extra, checkpoint, output)  # beside the export: no rotation takes them
    return write_program(program, checkpoint, output, extra)


def _example_inputs(spec: DatasetSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs to trace with: 2 samples (export specializes sizes 0 and 1), one id per bag."""
    bags = 2 * len(spec.sparse_names)
    ids, lengths = torch.zeros(bags, dtype=torch.int64), torch.ones(bags, dtype=torch.int64)
    return torch.randn(2, spec.num_dense), ids, lengths


def load_exported(
    path: str | Path, deltas: str | Path | None = None
) -> tuple[nn.Module, DatasetSpec]:
    """Load a file written by :func:`export_model`.

    Args:
        path: the ``.pt2`` file.
        deltas: the deltas directory (``<run dir>/deltas``), or the run directory, of the run
            the export's checkpoint is from: its dynamic tables are brought forward by the
            deltas after that checkpoint
            (:func:`~recsys.serve.exported_deltas.apply_exported_deltas`).

    Returns:
        The program as a module, ``(dense, values, lengths) -> probabilities [B, T]`` (see the
        module docstring), and the dataset spec it was trained with.

    Raises:
        FileNotFoundError: no file at ``path`` (or no ``deltas`` directory).
        ValueError: a file that :func:`export_model` did not write; deltas that do not apply
            (see :func:`~recsys.serve.exported_deltas.apply_exported_deltas`).

    Example::

        model, spec = load_exported("model.pt2")
        with torch.no_grad():
            scores = model(dense, values, lengths)  # [B, len(spec.label_names)]
    """
    module, spec, dynamic = load_program(path)
    if deltas is not None:
        apply_exported_deltas(module, dynamic, deltas, path)
    return module, spec


def load_program(
    path: str | Path, cache_rows: int | None = None
) -> tuple[nn.Module, DatasetSpec, dict | None]:
    """:func:`load_exported` without deltas, and the export's ``dynamic.json`` (None when it
    predates deltas): what ``recsys predict`` and ``recsys serve`` score with. An export with
    tiered tables gets them behind caches of ``cache_rows`` rows each (default: the training
    run's; :mod:`recsys.serve.cached_tables`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"exported model not found: '{path}' (`recsys export` writes one)")
    # Checked first: torch.export.load logs a long traceback before raising on other files.
    if not archive_has(path, f"extra/{SPEC_FILE}"):
        raise ValueError(
            f"'{path}' was not written by recsys export (a torch.export .pt2 archive with "
            f"{SPEC_FILE} inside)"
        )
    for name in (RETRIEVAL_FILE, ranking_export.RANKING_FILE):  # it scores histories
        if archive_has(path, f"extra/{name}"):
            message = f"a sequence model's export ({name} inside): `recsys predict` scores it"
            raise ValueError(f"'{path}' is {message}; this takes a CTR model's export")
    extra_files = {SPEC_FILE: "", CONFIG_FILE: ""}
    for name in (DYNAMIC_FILE, TIERED_FILE):  # exports before deltas (or tiers) have none
        if archive_has(path, f"extra/{name}"):
            extra_files[name] = ""
    program = torch.export.load(path, extra_files=extra_files)
    fields = json.loads(extra_files[SPEC_FILE])
    spec = DatasetSpec.from_json(fields)
    dynamic = json.loads(extra_files[DYNAMIC_FILE]) if DYNAMIC_FILE in extra_files else None
    module = program.module()
    if TIERED_FILE in extra_files:
        tiered = json.loads(extra_files[TIERED_FILE])
        attach_cached_tables(module, rows_beside(tiered, path), list(spec.sparse_names), cache_rows)
    return module, spec, dynamic


@dataclass
class PredictReport:
    """What :func:`predict` did."""

    output: Path
    rows: int
    files: int
    columns: list[str]
    seconds: float
    deltas_step: int | None = None
    """With deltas: the step the dynamic tables were brought to."""


def predict(
    model_path: str | Path,
    input: str | Path,
    output: str | Path,
    batch_size: int = 8192,
    *,
    overwrite: bool = False,
    transform: bool = False,
    data: str | Path | None = None,
    format: str | None = None,
    deltas: str | Path | None = None,
    cache_rows: int | None = None,
    top_k: int | None = None,
) -> PredictReport:
    """Score parquet files with an exported model and write the scores as parquet (a sequence
    model's export: the top-K items of each history of an ``items`` column, see
    :mod:`recsys.serve.retrieval_export`).

    The input is read one row group at a time and scored ``batch_size`` rows at a time, so
    memory stays bounded by a row group. Its columns are named as in training: the spec's
    dense and categorical names (a multi-hot feature as a list column); ids are checked
    against the table sizes.

    A model trained on ``recsys preprocess`` output only scores files that preprocess wrote
    with the same vocabulary (their fingerprint, see :mod:`recsys.data.prepared`): raw ids
    would be read as rows of the tables and scored silently wrong. With ``transform``, raw
    input (in the format the training data was preprocessed from) is first transformed by the
    workflow fitted on the model's training data (``recsys preprocess --apply``).

    Args:
        model_path: a ``.pt2`` file from :func:`export_model`.
        input: a parquet file, a directory of them (``*.parquet``, in name order) or a glob;
            with ``transform``, raw files (a file, a directory or a glob).
        output: the parquet file to write: one float32 column ``score_<label>`` per task, rows
            in input order, plus the label columns when the input has them. Written to a
            temporary file and renamed, so it appears only complete. Never one of the inputs,
            nor a file inside an input directory.
        batch_size: rows per forward call.
        overwrite: replace ``output`` when it exists (else that is an error).
        transform: the input is raw; transform it with the training data's fitted workflow
            (every row must be well formed: a malformed one is an error naming its line).
        data: with ``transform``, the preprocessed directory the model was trained on, when it
            is no longer at the ``data.path`` of the model's config.
        format: with ``transform``, the raw input's format (``criteo``, ``parquet``, ``csv``)
            when it differs from the one the training data was preprocessed from.
        deltas: the deltas directory (or the run directory) of the run the model was exported
            from: score with its dynamic tables at the last delta after the export's
            checkpoint (:func:`~recsys.serve.exported_deltas.apply_exported_deltas`; the dense
            layers stay the export's).
        cache_rows: an export with tiered tables: rows of each one's cache
            (:mod:`recsys.serve.cached_tables`; default: the training run's). The scores do
            not depend on it.
        top_k: a sequence model's export: the items per history (None: the export's K; at
            most that). With ``transform`` a sequence model's ``items`` column holds raw item
            values, encoded as its training data was.

    Raises:
        FileNotFoundError: no model file, or no input file.
        ValueError: input lacking a column the model reads, or holding an id outside its table;
            raw or differently preprocessed input; ``output`` among the inputs, or existing
            without ``overwrite``; ``deltas`` that do not continue the export's checkpoint, or
            a directory that holds none.

    Example::

        predict("model.pt2", "data/test.parquet", "scores.parquet")
        predict("model.pt2", "raw/day_2.txt", "scores.parquet", transform=True)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not transform and (data is not None or format is not None):
        raise ValueError("data and format describe raw input: they need transform")
    start = time.perf_counter()
    retrieval = archive_has(Path(model_path), f"extra/{RETRIEVAL_FILE}")  # a sequence model's
    ranking = archive_has(Path(model_path), f"extra/{ranking_export.RANKING_FILE}")  # hstu_ranking
    ranking_export.check_ranking_options(
        model_path, ranking, transform, data, format, deltas, top_k
    )
    check_retrieval_options(model_path, retrieval, data, format, deltas, top_k)
    deltas_step = None
    if not retrieval and not ranking:
        model, spec, dynamic = load_program(model_path, cache_rows)
        if deltas is not None:
            deltas_step = apply_exported_deltas(model, dynamic, deltas, model_path)
    output = Path(output)
    inputs = _input_files(str(input), parquet=not transform or retrieval or ranking)
    for file in inputs:
        if output.resolve() == file.resolve():
            raise ValueError(
                f"output '{output}' is also an input: scoring it would overwrite it; give "
                "another --output"
            )
    if Path(input).is_dir() and is_inside(output, input):
        raise ValueError(
            f"output '{output}' is inside the input directory '{input}', where a later run "
            "would read it as input; write it elsewhere"
        )
    check_output(output, overwrite)
    if ranking:  # each history's candidates
        rows, columns = ranking_export.predict_candidates(model_path, inputs, output, batch_size)
    elif retrieval:  # the top-K items of each history
        rows, columns = predict_top_k(
            model_path, inputs, output, batch_size, top_k=top_k, raw=transform
        )
    if ranking or retrieval:
        return PredictReport(output, rows, len(inputs), columns, time.perf_counter() - start)
    with contextlib.ExitStack() as stack:
        if transform:
            dataset = training_data(model_path, spec, data)
            files = stack.enter_context(_transformed(dataset, str(input), format, output))
        else:
            _check_vocabulary(inputs, spec)
            files = inputs
        rows, scores = _score(model, spec, files, output, batch_size)
    seconds = time.perf_counter() - start
    return PredictReport(output, rows, len(inputs), scores, seconds, deltas_step)


def _score(
    model: nn.Module, spec: DatasetSpec, files: list[Path], output: Path, batch_size: int
) -> tuple[int, list[str]]:
    """Score ``files`` into ``output`` (atomically); (rows, score column names)."""
    # Labels pass through when the first file has them (then every file must).
    first = _open_input(files[0], spec, []).schema_arrow
    labels = [name for name in spec.label_names if name in first.names]
    scores = [f"score_{name}" for name in spec.label_names]
    schema = pa.schema(
        [pa.field(name, pa.float32()) for name in scores] + [first.field(n) for n in labels]
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".tmp-{os.getpid()}-{output.name}")
    rows = 0
    try:
        with pq.ParquetWriter(tmp, schema) as writer, torch.no_grad():
            for piece, batch in _pieces(files, spec, labels, batch_size):
                values, lengths = batch.sparse.values(), batch.sparse.lengths().long()
                check_keys(values, "ids of the input")  # as training does: one rule for both
                probabilities = model(batch.dense, values, lengths)  # [b, T]
                out = {name: probabilities[:, t].numpy() for t, name in enumerate(scores)}
                out |= {name: piece.column(name) for name in labels}
                writer.write_table(pa.table(out, schema=schema))
                rows += len(batch)
        os.replace(tmp, output)
    except Exception as error:
        failure = write_failure(error, output)
        if failure is error:
            raise
        raise failure from error
    finally:
        remove_quietly(tmp)  # a failure to clean up must not hide the error
    return rows, scores


def _check_vocabulary(files: list[Path], spec: DatasetSpec) -> None:
    """Every file carries the fingerprint of the vocabulary the model was trained with (none
    when the model's data had none: synthetic, hashed raw Criteo)."""
    for file in files:
        found = file_fingerprint(file)
        if found == spec.fingerprint or (found is None and not spec.fingerprint):
            continue
        if found is None:
            raise ValueError(
                f"'{file}' was not written by recsys preprocess: its ids are raw values, not "
                "rows of the model's tables, and would be scored silently wrong. Transform it "
                "with the training data's vocabulary: add --transform (or run `recsys "
                "preprocess --apply DATA_DIR` first)"
            )
        if not spec.fingerprint:
            raise ValueError(
                f"'{file}' was preprocessed with a fitted vocabulary, but the model was trained "
                "on data without one (synthetic or hashed ids): its ids mean other rows"
            )
        raise ValueError(
            f"'{file}' was preprocessed with another vocabulary (fingerprint "
            f"{found[:12] or 'none'}, the model's {spec.fingerprint[:12]}): its ids mean other "
            "rows; transform the raw data with --transform or `recsys preprocess --apply` "
            "on the model's training data"
        )


def training_data(
    model_path: str | Path, spec: DatasetSpec, data: str | Path | None
) -> tuple[Path, dict]:
    """The preprocessed directory whose fitted workflow made the model's ids: ``data``, else
    the ``data.path`` of the model's config (in the export, or the checkpoint when
    ``model_path`` is a checkpoint or run directory); it must hold the model's vocabulary.
    Returns it with its metadata."""
    if not spec.fingerprint:
        raise ValueError(
            "the model was not trained on `recsys preprocess` output (no vocabulary to "
            "transform raw input with); give preprocessed or synthetic-format parquet"
        )
    if data is None:
        model_path = Path(model_path)
        if model_path.is_dir():
            text = (resolve_checkpoint(model_path) / CONFIG_FILE).read_text()
        else:
            text = archive_text(model_path, f"extra/{CONFIG_FILE}")
        data = tomllib.loads(text).get("data", {}).get("path", "")
    directory = Path(data)
    if not (directory / "metadata.json").is_file():
        raise FileNotFoundError(
            f"the model's training data '{directory}' is not a preprocessed directory (moved?); "
            "give it with --data DIR"
        )
    metadata = read_metadata(directory)
    found = metadata["fingerprint"]
    if found != spec.fingerprint:
        raise ValueError(
            f"'{directory}' holds another vocabulary (fingerprint {found[:12] or 'none'}) than "
            f"the model's ({spec.fingerprint[:12]}); give the directory it was trained on"
        )
    return directory, metadata


@contextlib.contextmanager
def _transformed(
    dataset: tuple[Path, dict], input: str, format: str | None, near: Path
) -> Iterator[list[Path]]:
    """Raw ``input`` transformed by the fitted workflow of ``dataset`` (directory, metadata,
    from :func:`training_data`) into a temporary directory beside ``near``, row for row
    (strict: a malformed row is an error naming its line); yields its parquet files in input
    order, and deletes them afterwards."""
    from recsys.config import PreprocessConfig
    from recsys.data.etl import preprocess

    directory, fitted = dataset
    work = new_directory_beside(near, "transform")
    try:
        config = PreprocessConfig(
            apply=str(directory),
            format=format or fitted["preprocess"]["format"],
            input=input,
            output=str(work / "data"),
            valid_fraction=0.0,
            test_fraction=0.0,
            strict=True,
        )
        try:
            report = preprocess(config)
        except ValueError as error:
            if format is not None:
                raise
            # The format was not given: say which one the input was read as, and how to name
            # another (a CSV read as Criteo is otherwise "expected 40 tab-separated fields").
            raise ValueError(
                f"{error} (--transform read '{input}' as {config.format}, the format the "
                "model's training data was preprocessed from; for input in another format "
                "give --format criteo, parquet or csv)"
            ) from None
        yield [
            report.output / "train" / name for name in report.metadata["splits"]["train"]["files"]
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pieces(
    files: list[Path], spec: DatasetSpec, labels: list[str], batch_size: int
) -> Iterator[tuple[pa.Table, Batch]]:
    """Every file's row groups in order, cut into pieces of at most ``batch_size`` rows: each
    piece (with its ``labels`` columns) and its features as a Batch."""
    features = replace(spec, label_names=())  # labels pass through, unread
    columns = [*spec.dense_names, *spec.sparse_names, *labels]
    for path in files:
        file = _open_input(path, spec, labels)
        schema = file.schema_arrow
        multi_hot = {name for name in spec.sparse_names if _is_list(schema.field(name).type)}
        for group in range(file.num_row_groups):
            table = file.read_row_group(group, columns=columns)
            for first_row in range(0, table.num_rows, batch_size):
                piece = table.slice(first_row, batch_size)
                where = f"{path} row group {group} from row {first_row}"
                yield piece, table_to_batch(piece, features, multi_hot, where)


def _input_files(pattern: str, parquet: bool = True) -> list[Path]:
    """A file, a directory's files (its ``*.parquet`` ones with ``parquet``), or a glob's
    matches, sorted."""
    path = Path(pattern)
    if path.is_dir():
        files = sorted(
            p
            for p in path.iterdir()
            if p.is_file()
            and not p.name.startswith(".")
            and (p.suffix == ".parquet" or not parquet)
        )
    elif any(ch in pattern for ch in "*?["):
        files = sorted(Path(p) for p in glob(pattern) if Path(p).is_file())
    else:
        files = [path] if path.is_file() else []
    if not files:
        kind = "parquet input" if parquet else "input"
        raise FileNotFoundError(f"no {kind} found at '{pattern}'")
    return files


def _open_input(path: Path, spec: DatasetSpec, labels: list[str]) -> pq.ParquetFile:
    """``path`` opened, after checking it has every column the model reads and ``labels``."""
    try:
        file = pq.ParquetFile(path)
    except pa.ArrowInvalid as error:
        raise ValueError(f"'{path}' is not a readable parquet file: {error}") from None
    names = file.schema_arrow.names
    read = [*spec.dense_names, *spec.sparse_names]
    missing = [name for name in read if name not in names]
    if missing:
        hints = quoted_with_hints(missing, names, taken=[*read, *spec.label_names])
        raise ValueError(
            f"'{path}' has no column(s) {hints}; the model reads "
            f"dense columns {list(spec.dense_names)} and categorical columns "
            f"{list(spec.sparse_names)}"
        )
    missing = [name for name in labels if name not in names]
    if missing:
        raise ValueError(
            f"'{path}' has no label column(s) {missing}, which the first input file has; "
            "give files that all have the labels, or none"
        )
    return file


def _is_list(kind: pa.DataType) -> bool:
    """A list column is a multi-hot feature: its lists are the bags."""
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)
