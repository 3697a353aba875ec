"""``recsys export`` and ``recsys predict`` of a sequence model (sasrec, hstu): the query tower
and the item table as one ``torch.export`` program that returns each history's top-K items.

The program's forward, with B histories (any B >= 1) and L item ids in all (any L >= 0)::

    values   int64[L]      every history's item ids, oldest first, history after history
                           (ids as the training data encoded them), at most max_len each
    lengths  int64[B]      the histories' lengths (0: an empty history)
    times    f64[L]        only for a model with a time bias (hstu with
                           ``model.sequence.time_bias``): each event's time in seconds, aligned
                           with ``values`` (``retrieval.json`` says ``"times": true``)
    seen_values  int64[S]  only for a run with ``train.next_item.exclude_history``
    seen_lengths int64[B]  (``retrieval.json`` says ``"exclude_history": true``): every item of
                           each user's whole history (not cut to max_len), never returned
    ->       int64[B, K]   the top K item ids, best first (ids from the first real item on:
                           categorify's reserved ids 0-2 are never returned)
             f32[B, K]     their scores, the user vector . the item vector

K is the export's ``top_k`` (default: 100, or every item when the corpus is smaller; an
explicit one must be between 1 and the corpus size). The corpus is every item id of a fixed
table from the first real one on, or, for a dynamic item table (raw item keys), the keys it
held at the checkpoint: its top items are keys, and an item it never trained reads the zero
row. Attention is padded to the model's ``max_len`` inside (one shape for every batch), so
scores equal the trained model's up to float rounding. The archive carries the checkpoint's
``spec.json`` and ``config.toml`` like a CTR export, ``retrieval.json`` (K, the first item,
max_len, the number of items, the corpus size) and ``items.json``, the training data's item
encoding (:class:`recsys.data.item_encoding.ItemEncoding`).

:func:`predict_top_k` reads parquet files with an ``items`` list column (the histories ``recsys
preprocess --format interactions`` writes: e.g. its ``test/`` split), cuts each history to its
last ``max_len`` items (and, for a model with a time bias, its ``times`` list column the same:
the events' times in seconds, as that split holds them), and writes ``top_items`` and
``top_scores`` list columns (its ``top_k``: any K up to the export's), with the input's
``user`` and ``target`` columns passed through when present. An export of a run with
``exclude_history`` is given each whole history as ``seen``, so no item of it is returned, as
the run's ranking excluded them (a ``target`` column is not read: a history is what the user
did before the moment predicted). With ``raw`` the ``items`` column
holds raw item values, as the interaction log names them (strings, integers): they are encoded
as the training data was (an item unknown to a categorified vocabulary is its rare id), and
``top_items`` holds items again (categorify: the items' own values; hash: the bucket ids; raw:
the 64-bit keys).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.build.tiered_tables import tiered_collections
from recsys.checkpoint.io import load_model, read_config
from recsys.config import SEQUENCE_MODELS
from recsys.data import resolve_source
from recsys.data.item_encoding import ItemEncoding
from recsys.data.prepared import read_metadata
from recsys.data.sequence_source import build_sequence_dataset
from recsys.models.next_item import corpus_keys
from recsys.serve.parquet_pieces import ParquetPieces
from recsys.serve.program_file import write_program
from recsys.serve.retrieval_tables import in_memory_item_table

__all__ = [
    "ITEMS_FILE",
    "RETRIEVAL_FILE",
    "TopKModule",
    "check_retrieval_options",
    "check_top_k",
    "export_retrieval",
    "load_item_encoding",
    "predict_top_k",
]

RETRIEVAL_FILE = "retrieval.json"
ITEMS_FILE = "items.json"
PASSED_THROUGH = ("user", "target")
DEFAULT_TOP_K = 100


class TopKModule(nn.Module):
    """A sequence model behind plain-tensor inputs, returning each history's top ``k`` items
    (see the module docstring): of the ids from ``first_item`` on, or of ``keys`` [N]
    (a dynamic item table's corpus)."""

    def __init__(
        self,
        model: nn.Module,
        k: int,
        first_item: int,
        keys: torch.Tensor | None = None,
        exclude_history: bool = False,
    ) -> None:
        super().__init__()
        self.model, self.k, self.first_item = model, k, first_item
        self.exclude_history = exclude_history
        self.register_buffer("keys", keys)

    def forward(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor,
        times: torch.Tensor | None = None,
        seen_values: torch.Tensor | None = None,
        seen_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The inputs of the module docstring (``seen_*`` given by keyword)."""
        # Offsets computed here keep the graph ATen-only (the KJT would call an FBGEMM op).
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])  # [B + 1]
        history = KeyedJaggedTensor(
            keys=["items"], values=values, lengths=lengths, offsets=offsets, stride=lengths.shape[0]
        )
        queries = self.model.user_vectors(history, self.model.max_len, times)  # [B, D]
        if self.keys is not None:
            scores = queries @ self.model.item_vectors(self.keys).t()  # [B, N]
        else:
            scores = queries @ self.model.item_vectors()[self.first_item :].t()  # [B, N']
        if self.exclude_history:
            assert seen_values is not None and seen_lengths is not None
            scores = self._without_seen(scores, seen_values, seen_lengths)
        top = scores.topk(self.k, dim=1)  # [B, K]
        if self.keys is not None:
            return self.keys[top.indices], top.values
        return top.indices + self.first_item, top.values

    def _without_seen(
        self, scores: torch.Tensor, seen: torch.Tensor, seen_lengths: torch.Tensor
    ) -> torch.Tensor:
        """``scores`` [B, N] with each row's seen items at -inf (ids outside the corpus
        ignored: they land in a spare column, so no data-dependent shape)."""
        batch, corpus = scores.shape
        rows = torch.repeat_interleave(
            torch.arange(batch, device=scores.device), seen_lengths, output_size=seen.shape[0]
        )
        if self.keys is not None:
            at = torch.searchsorted(self.keys, seen).clamp(max=corpus - 1)
            columns = torch.where(self.keys[at] == seen, at, corpus)
        else:
            columns = seen - self.first_item
            columns = torch.where((columns >= 0) & (columns < corpus), columns, corpus)
        spare = torch.cat([scores, scores.new_zeros(batch, 1)], dim=1)  # [B, N + 1]
        spare = spare.index_put((rows, columns), spare.new_tensor(float("-inf")))
        return spare[:, :corpus]


def export_retrieval(checkpoint: Path, output: Path, top_k: int | None = None) -> Path:
    """Write the top-``top_k`` program of a sequence model's ``checkpoint`` to ``output`` (a
    checked, new or replaceable file: :func:`recsys.serve.export.export_model`).

    Raises:
        ValueError: top_k outside [1, the corpus size] (None: 100, or the whole corpus when
            smaller).
    """
    config = read_config(checkpoint)
    if config.model.name not in SEQUENCE_MODELS:
        raise ValueError(
            f"top_k = {top_k}: a {config.model.name} model scores rows, top_k is for sequence "
            f"models' exports ({', '.join(SEQUENCE_MODELS)})"
        )
    model = load_model(checkpoint, device="cpu").requires_grad_(False).eval()
    tiered = tiered_collections(model)
    in_memory_item_table(model)  # a tiered item table: its rows read into the program
    for collection in tiered:
        collection.close()
    data = _training_data(config)
    first_item = data.first_item
    keys = model.item_keys()
    if keys is not None:
        keys = corpus_keys(keys, first_item)
    corpus = model.num_items - first_item if keys is None else len(keys)
    if corpus < 1:
        raise ValueError(f"'{checkpoint}': its item table holds no item to rank")
    k = check_top_k(top_k, corpus, "the items the model ranks") if top_k is not None else None
    k = k or min(DEFAULT_TOP_K, corpus)
    exclude = config.train.next_item.exclude_history
    module = TopKModule(model, k, first_item, keys, exclude_history=exclude)
    example = (torch.arange(first_item, first_item + 3), torch.tensor([2, 1]))
    batch, ids = torch.export.Dim("batch", min=1), torch.export.Dim("ids", min=0)
    shapes = {"values": {0: ids}, "lengths": {0: batch}}
    if model.uses_times:  # the events' times, aligned with values
        example += (torch.tensor([0.0, 60.0, 30.0], dtype=torch.float64),)
        shapes["times"] = {0: ids}
    seen = {}
    if exclude:  # every item of each whole history, by keyword
        seen = {"seen_values": torch.arange(first_item, first_item + 4)}
        seen["seen_lengths"] = torch.tensor([3, 1])
        shapes.update(seen_values={0: torch.export.Dim("seen", min=0)}, seen_lengths={0: batch})
    with torch.no_grad():
        program = torch.export.export(module, example, seen, dynamic_shapes=shapes)
    info = {
        "top_k": k,
        "first_item": first_item,
        "max_len": model.max_len,
        "num_items": model.num_items,
        "corpus": corpus,
        "dynamic": keys is not None,
        "times": model.uses_times,
        "exclude_history": exclude,
    }
    extra = {
        RETRIEVAL_FILE: json.dumps(info, indent=1) + "\n",
        ITEMS_FILE: data.item_encoding.to_json(),
    }
    return write_program(program, checkpoint, output, extra)


def check_retrieval_options(
    model_path: str | Path,
    retrieval: bool,
    data: object,
    format: object,
    deltas: object,
    top_k: int | None,
) -> None:
    """Refuse predict options that do not apply to ``model_path`` (``retrieval``: a sequence
    model's export).

    Raises:
        ValueError: data, format or deltas for a sequence model; top_k for a CTR model."""
    if retrieval and (data is not None or format is not None or deltas is not None):
        raise ValueError(
            f"'{model_path}' is a sequence model's export: it reads histories (an 'items' "
            "column: item ids as `recsys preprocess --format interactions` writes them, or raw "
            "item values with transform, encoded by what the export carries), without data, "
            "format or deltas"
        )
    if not retrieval and top_k is not None:
        raise ValueError(
            f"top_k = {top_k}: '{model_path}' is a CTR model's export, which scores rows; "
            "top_k is for sequence models' exports"
        )


def check_top_k(top_k: int, most: int, what: str) -> int:
    """``top_k`` when in [1, ``most``].

    Raises:
        ValueError: naming ``top_k`` and the bound (``what`` the ``most`` count)."""
    if not 1 <= top_k <= most:
        raise ValueError(f"top_k = {top_k}; expected 1 <= top_k <= {most}, {what}")
    return top_k


def _training_data(config) -> TrainingItems:
    """The first real item id and the item encoding of the run's data (the synthetic log is
    generated again, as the run did)."""
    source = resolve_source(config.data, sequences=True)
    if source == "synthetic_sequences":
        data = build_sequence_dataset(config.data, source, config.run.seed)
        return TrainingItems(data.first_item, data.item_encoding)
    reserved = read_metadata(config.data.path)["sequence"].get("reserved_ids") or {}
    first_item = max(reserved.values()) + 1 if reserved else 0
    return TrainingItems(first_item, ItemEncoding.read(config.data.path))


@dataclass
class TrainingItems:
    """What an export records of the items of a run's data."""

    first_item: int
    item_encoding: ItemEncoding


def load_retrieval(path: str | Path) -> tuple[nn.Module, dict]:
    """The program of :func:`export_retrieval` and its ``retrieval.json``."""
    extra_files = {RETRIEVAL_FILE: ""}
    program = torch.export.load(Path(path), extra_files=extra_files)
    return program.module(), json.loads(extra_files[RETRIEVAL_FILE])


def load_item_encoding(path: str | Path) -> ItemEncoding:
    """The training data's item encoding an export carries.

    Raises:
        ValueError: an export written before exports carried it."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith(f"extra/{ITEMS_FILE}")]
        if not names:
            raise ValueError(
                f"'{path}' carries no item encoding (exported by an older recsys): export the "
                "checkpoint again to predict from raw item histories"
            )
        return ItemEncoding.from_json(archive.read(names[0]).decode())


def predict_top_k(
    model_path: str | Path,
    files: list[Path],
    output: Path,
    batch_size: int,
    *,
    top_k: int | None = None,
    raw: bool = False,
) -> tuple[int, list[str]]:
    """Write the top-K items of every history of ``files`` to ``output`` (atomically); (rows,
    columns written). See the module docstring.

    Args:
        top_k: K (None: the export's); at most the export's.
        raw: the histories hold raw item values, encoded here as the training data was.

    Raises:
        ValueError: an input without an ``items`` list column, an id outside the item table,
            or a top_k outside [1, the export's].
    """
    model, info = load_retrieval(model_path)
    max_len, num_items, timed = info["max_len"], info["num_items"], info.get("times", False)
    exclude = info.get("exclude_history", False)
    exported = info["top_k"]
    corpus = info.get("corpus", num_items - info["first_item"])
    k = exported if top_k is None else top_k
    if top_k is not None and not 1 <= top_k <= exported:
        more = (
            f"'{model_path}' returns its top {exported} of {corpus} items: export the "
            f"checkpoint again with --top-k {top_k}"
            if 1 <= top_k <= corpus
            else f"the model ranks {corpus} items"
        )
        check_top_k(top_k, exported, more)
    encoding = load_item_encoding(model_path) if raw else None
    check_ids = None if info.get("dynamic") or raw else num_items
    with ParquetPieces(output) as out, torch.no_grad():
        for file in files:
            table = pq.read_table(file)
            if "items" not in table.column_names:
                raise ValueError(
                    f"'{file}' has no 'items' column (each row's history of item ids); "
                    f"its columns: {', '.join(table.column_names)}"
                )
            if timed and "times" not in table.column_names:
                raise ValueError(
                    f"'{file}' has no 'times' column; '{model_path}' (a model with a time "
                    "bias) reads each event's time in seconds beside its item, a list "
                    "column aligned with 'items' (as `recsys preprocess --format "
                    "interactions` writes it)"
                )
            for start in range(0, table.num_rows, batch_size):
                piece = table.slice(start, batch_size)
                top_ids, top_scores = _top_k(
                    model, piece, max_len, check_ids, file, encoding, timed, exclude
                )
                top_ids, top_scores = top_ids[:, :k], top_scores[:, :k]
                columns = {n: piece.column(n) for n in PASSED_THROUGH if n in piece.column_names}
                columns["top_items"] = _items(top_ids.numpy(), encoding)
                columns["top_scores"] = pa.array(list(top_scores.numpy()), pa.list_(pa.float32()))
                out.write(pa.table(columns))
    return out.rows, out.columns


def _items(top_ids: np.ndarray, encoding: ItemEncoding | None) -> pa.Array:
    """The ``top_items`` column of [B, K] ids: the ids, or raw items for raw histories."""
    batch, k = top_ids.shape
    if encoding is None:
        return pa.array(list(top_ids), pa.list_(pa.int64()))
    values = encoding.decode(top_ids.reshape(-1))
    offsets = pa.array(np.arange(0, batch * k + 1, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values))


def _top_k(
    model: nn.Module,
    piece: pa.Table,
    max_len: int,
    num_items: int | None,
    file: Path,
    encoding: ItemEncoding | None,
    timed: bool = False,
    exclude: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    items = piece.column("items").combine_chunks()
    offsets = items.offsets.to_numpy().astype(np.int64)
    raw_values = items.values.slice(offsets[0], offsets[-1] - offsets[0])
    if encoding is not None:
        values = encoding.encode(raw_values)
    elif not (pa.types.is_integer(raw_values.type) or pa.types.is_null(raw_values.type)):
        raise ValueError(
            f"'{file}': its 'items' hold {raw_values.type} values, not the item ids the model was "
            "trained on: raw item values (as in the interaction log) need --transform, which "
            "encodes them as the training histories were"
        )
    else:
        values = raw_values.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = offsets - offsets[0]
    rows, lengths = latest_rows(offsets, max_len)
    kept = values[rows]
    if num_items is not None and len(kept) and (kept.min() < 0 or kept.max() >= num_items):
        raise ValueError(
            f"'{file}': item ids span [{kept.min()}, {kept.max()}]; the model's item table has "
            f"{num_items} rows (ids as its training histories encoded them; raw item values "
            "need --transform)"
        )
    inputs = [torch.from_numpy(kept), torch.from_numpy(lengths)]
    if timed:
        inputs.append(torch.from_numpy(_times(piece, offsets, file)[rows]))
    if not exclude:
        return model(*inputs)
    seen = torch.from_numpy(values), torch.from_numpy(np.diff(offsets))  # the whole history
    return model(*inputs, seen_values=seen[0], seen_lengths=seen[1])


def latest_rows(offsets: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Of histories whose items lie at ``offsets`` [B + 1] (from 0): the rows of each one's
    most recent ``max_len`` items, history by history, and how many each keeps [B]."""
    ends = offsets[1:]
    starts = np.maximum(offsets[:-1], ends - max_len)
    lengths = ends - starts
    index = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(lengths.sum()) + index, lengths


def _times(piece: pa.Table, offsets: np.ndarray, file: Path) -> np.ndarray:
    """float64 [L] the ``times`` list column's values, checked to align with ``items``
    (whose offsets, from 0, are ``offsets``)."""
    times = piece.column("times").combine_chunks()
    starts = times.offsets.to_numpy().astype(np.int64)
    if not np.array_equal(starts - starts[0], offsets):
        row = int(np.flatnonzero(np.diff(starts) != np.diff(offsets))[0])
        raise ValueError(
            f"'{file}': row {row} has {int(np.diff(starts)[row])} times and "
            f"{int(np.diff(offsets)[row])} items; expected one time per item"
        )
    values = times.values.slice(starts[0], starts[-1] - starts[0])
    return values.to_numpy(zero_copy_only=False).astype(np.float64)
