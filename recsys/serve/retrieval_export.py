"""``recsys export`` and ``recsys predict`` of a sequence model (sasrec, hstu): the query tower
and the item table as one ``torch.export`` program that returns each history's top-K items.

The program's forward, with B histories (any B >= 1) and L item ids in all (any L >= 0)::

    values   int64[L]      every history's item ids, oldest first, history after history
                           (ids as the training data encoded them), at most max_len each
    lengths  int64[B]      the histories' lengths (0: an empty history)
    ->       int64[B, K]   the top K item ids, best first (ids from the first real item on:
                           categorify's reserved ids 0-2 are never returned)
             f32[B, K]     their scores, the user vector . the item vector

Attention is padded to the model's ``max_len`` inside (one shape for every batch), so scores
equal the trained model's up to float rounding. The archive carries the checkpoint's
``spec.json`` and ``config.toml`` like a CTR export, and ``retrieval.json`` (K, the first item,
max_len, the number of items).

:func:`predict_top_k` reads parquet files with an ``items`` list column (the histories
``recsys preprocess --format interactions`` writes: e.g. its ``test/`` split), cuts each
history to its last ``max_len`` items, and writes ``top_items`` and ``top_scores`` list
columns, with the input's ``user`` and ``target`` columns passed through when present.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys._files import remove_quietly
from recsys.checkpoint.io import load_model, read_config
from recsys.serve.program_file import write_program

__all__ = ["RETRIEVAL_FILE", "TopKModule", "export_retrieval", "predict_top_k"]

RETRIEVAL_FILE = "retrieval.json"
PASSED_THROUGH = ("user", "target")


class TopKModule(nn.Module):
    """A sequence model behind plain-tensor inputs, returning each history's top ``k`` items
    (see the module docstring)."""

    def __init__(self, model: nn.Module, k: int, first_item: int) -> None:
        super().__init__()
        self.model, self.k, self.first_item = model, k, first_item

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Offsets computed here keep the graph ATen-only (the KJT would call an FBGEMM op).
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])  # [B + 1]
        history = KeyedJaggedTensor(
            keys=["items"], values=values, lengths=lengths, offsets=offsets, stride=lengths.shape[0]
        )
        queries = self.model.user_vectors(history, self.model.max_len)  # [B, D]
        items = self.model.item_vectors()[self.first_item :]  # [N', D]
        top = (queries @ items.t()).topk(self.k, dim=1)  # [B, K]
        return top.indices + self.first_item, top.values


def export_retrieval(checkpoint: Path, output: Path, top_k: int = 100) -> Path:
    """Write the top-``top_k`` program of a sequence model's ``checkpoint`` to ``output`` (a
    checked, new or replaceable file: :func:`recsys.serve.export.export_model`).

    Raises:
        ValueError: top_k < 1.
    """
    if top_k < 1:
        raise ValueError(f"top_k = {top_k}; expected >= 1")
    config = read_config(checkpoint)
    model = load_model(checkpoint, device="cpu").requires_grad_(False).eval()
    first_item = _first_item(config)
    k = min(top_k, model.num_items - first_item)
    module = TopKModule(model, k, first_item)
    example = (torch.arange(first_item, first_item + 3), torch.tensor([2, 1]))
    batch, ids = torch.export.Dim("batch", min=1), torch.export.Dim("ids", min=0)
    with torch.no_grad():
        program = torch.export.export(
            module, example, dynamic_shapes={"values": {0: ids}, "lengths": {0: batch}}
        )
    info = {
        "top_k": k,
        "first_item": first_item,
        "max_len": model.max_len,
        "num_items": model.num_items,
    }
    return write_program(
        program, checkpoint, output, {RETRIEVAL_FILE: json.dumps(info, indent=1) + "\n"}
    )


def _first_item(config) -> int:
    """The first real item id of the run's data: 3 when categorify reserved 0-2."""
    from recsys.data import resolve_source
    from recsys.data.prepared import read_metadata

    source = resolve_source(config.data, sequences=True)
    if source == "synthetic_sequences":
        return 3  # the synthetic log is categorified
    reserved = read_metadata(config.data.path)["sequence"].get("reserved_ids") or {}
    return max(reserved.values()) + 1 if reserved else 0


def load_retrieval(path: str | Path) -> tuple[nn.Module, dict]:
    """The program of :func:`export_retrieval` and its ``retrieval.json``."""
    extra_files = {RETRIEVAL_FILE: ""}
    program = torch.export.load(Path(path), extra_files=extra_files)
    return program.module(), json.loads(extra_files[RETRIEVAL_FILE])


def predict_top_k(
    model_path: str | Path, files: list[Path], output: Path, batch_size: int
) -> tuple[int, list[str]]:
    """Write the top-K items of every history of ``files`` to ``output`` (atomically); (rows,
    columns written). See the module docstring.

    Raises:
        ValueError: an input without an ``items`` list column, or an id outside the item table.
    """
    model, info = load_retrieval(model_path)
    max_len, num_items = info["max_len"], info["num_items"]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".tmp-{os.getpid()}-{output.name}")
    rows, writer, columns = 0, None, []
    try:
        with torch.no_grad():
            for file in files:
                table = pq.read_table(file)
                if "items" not in table.column_names:
                    raise ValueError(
                        f"'{file}' has no 'items' column (each row's history of item ids); "
                        f"its columns: {', '.join(table.column_names)}"
                    )
                for start in range(0, table.num_rows, batch_size):
                    piece = table.slice(start, batch_size)
                    top_ids, top_scores = _top_k(model, piece, max_len, num_items, file)
                    out = {n: piece.column(n) for n in PASSED_THROUGH if n in piece.column_names}
                    out["top_items"] = pa.array(list(top_ids.numpy()), pa.list_(pa.int64()))
                    out["top_scores"] = pa.array(list(top_scores.numpy()), pa.list_(pa.float32()))
                    result = pa.table(out)
                    if writer is None:
                        writer, columns = pq.ParquetWriter(tmp, result.schema), result.column_names
                    writer.write_table(result)
                    rows += piece.num_rows
        if writer is not None:
            writer.close()
            writer = None
            os.replace(tmp, output)
    finally:
        if writer is not None:
            writer.close()
        remove_quietly(tmp)
    return rows, columns


def _top_k(
    model: nn.Module, piece: pa.Table, max_len: int, num_items: int, file: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    items = piece.column("items").combine_chunks()
    offsets = items.offsets.to_numpy().astype(np.int64)
    values = items.values.to_numpy().astype(np.int64)[offsets[0] : offsets[-1]]
    offsets = offsets - offsets[0]
    ends = offsets[1:]
    starts = np.maximum(offsets[:-1], ends - max_len)  # the most recent max_len items
    lengths = ends - starts
    index = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    kept = values[np.arange(lengths.sum()) + index]
    if len(kept) and (kept.min() < 0 or kept.max() >= num_items):
        raise ValueError(
            f"'{file}': item ids span [{kept.min()}, {kept.max()}]; the model's item table has "
            f"{num_items} rows (ids as its training histories encoded them)"
        )
    return model(torch.from_numpy(kept), torch.from_numpy(lengths))
