"""``recsys export`` and ``recsys predict`` of a target-aware ranking model (hstu_ranking): the
model behind plain tensors as one ``torch.export`` program that scores each history's
candidates.

The program's forward, with B histories (any B >= 1), L history ids and M candidates in all::

    history_values     int64[L]   every history's item ids, oldest first, history after
                                  history, at most max_len each
    history_lengths    int64[B]   the histories' lengths (0: an empty history)
    candidate_values   int64[M]   every history's candidates, list after list
    candidate_lengths  int64[B]   how many candidates each history has (at most
                                  max_candidates)
    ->                 f32[M, T]  each candidate's click probabilities sigmoid(logits), tasks in
                                  spec.label_names order

A candidate's score does not depend on the other candidates it is scored with (they do not
attend to each other), so a longer list may be scored in pieces. Attention is padded to the
model's ``max_len + max_candidates`` inside, so scores equal the trained model's up to float
rounding. The archive carries the checkpoint's ``spec.json`` and ``config.toml`` like a CTR
export, and ``ranking.json`` (max_len, max_candidates, the number of items, the labels).

:func:`predict_candidates` reads parquet files with an ``items`` list column (each row's
history, item ids as the training data encoded them) and a ``candidates`` list column, cuts
each history to its last ``max_len`` items and writes ``score_<label>`` list columns (one
float32 per candidate, in the candidates' order), passing ``user``, ``candidates`` and
``labels`` through when present.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.checkpoint.io import load_model, read_config, read_spec
from recsys.config import TARGET_RANKING_MODELS
from recsys.serve.parquet_pieces import ParquetPieces
from recsys.serve.program_file import write_program
from recsys.serve.retrieval_export import latest_rows

__all__ = [
    "RANKING_FILE",
    "CandidateScores",
    "check_ranking_options",
    "export_ranking",
    "predict_candidates",
]

RANKING_FILE = "ranking.json"
PASSED_THROUGH = ("user", "candidates", "labels")


class CandidateScores(nn.Module):
    """A target-aware ranking model behind plain-tensor inputs, returning each candidate's
    probabilities (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        history_values: torch.Tensor,
        history_lengths: torch.Tensor,
        candidate_values: torch.Tensor,
        candidate_lengths: torch.Tensor,
    ) -> torch.Tensor:
        # Offsets computed here keep the graph ATen-only (the KJT would call an FBGEMM op).
        batch = history_lengths.shape[0]
        kjts = [
            KeyedJaggedTensor(
                keys=["items"],
                values=values,
                lengths=lengths,
                offsets=torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]),
                stride=batch,
            )
            for values, lengths in (
                (history_values, history_lengths),
                (candidate_values, candidate_lengths),
            )
        ]
        model = self.model
        logits = model(kjts[0], model.max_len, kjts[1], model.max_candidates)
        return torch.sigmoid(logits)  # [M, T]


def export_ranking(checkpoint: Path, output: Path, top_k: int | None = None) -> Path:
    """Write the candidate-scoring program of a target-aware ranking model's ``checkpoint``
    to ``output`` (a checked, new or replaceable file: :func:`recsys.serve.export.
    export_model`).

    Raises:
        ValueError: not a target-aware ranking model's checkpoint, or a ``top_k`` (which
            sequence models' exports take)."""
    config = read_config(checkpoint)
    name = config.model.name
    if name not in TARGET_RANKING_MODELS:
        raise ValueError(f"'{checkpoint}' holds a {name} model, not {TARGET_RANKING_MODELS}")
    if top_k is not None:
        raise ValueError(
            f"top_k = {top_k}: a {name} model scores the candidates it is given; top_k is for "
            "sequence models' exports"
        )
    spec = read_spec(checkpoint)
    model = load_model(checkpoint, device="cpu").requires_grad_(False).eval()
    module = CandidateScores(model)
    example = (torch.tensor([1, 2, 3]), torch.tensor([2, 1]), torch.tensor([4, 5, 6]))
    example += (torch.tensor([1, 2]),)
    batch = torch.export.Dim("batch", min=1)
    history, candidates = torch.export.Dim("history", min=0), torch.export.Dim("candidates", min=0)
    shapes = {
        "history_values": {0: history},
        "history_lengths": {0: batch},
        "candidate_values": {0: candidates},
        "candidate_lengths": {0: batch},
    }
    with torch.no_grad():
        program = torch.export.export(module, example, dynamic_shapes=shapes)
    info = {
        "max_len": model.max_len,
        "max_candidates": model.max_candidates,
        "num_items": spec.cardinalities[0],
        "labels": list(spec.label_names),
    }
    return write_program(program, checkpoint, output, {RANKING_FILE: json.dumps(info) + "\n"})


def check_ranking_options(
    model_path: str | Path,
    ranking: bool,
    transform: bool,
    data: object,
    format: object,
    deltas: object,
    top_k: int | None,
) -> None:
    """Refuse predict options that ``model_path`` does not take when it is (``ranking``) a
    target-aware ranking model's export.

    Raises:
        ValueError: naming every option given."""
    if not ranking:
        return
    given = dict(transform=transform, data=data, format=format, deltas=deltas, top_k=top_k)
    named = [name for name, value in given.items() if value not in (None, False)]
    if named:
        raise ValueError(
            f"'{model_path}' is a target-aware ranking model's export: it scores the candidates "
            "of histories ('items' and 'candidates' columns, item ids as its training data "
            f"encoded them), without {', '.join(named)}"
        )


def load_ranking(path: str | Path) -> tuple[nn.Module, dict]:
    """The program of :func:`export_ranking` and its ``ranking.json``."""
    extra_files = {RANKING_FILE: ""}
    program = torch.export.load(Path(path), extra_files=extra_files)
    return program.module(), json.loads(extra_files[RANKING_FILE])


def predict_candidates(
    model_path: str | Path, files: list[Path], output: Path, batch_size: int
) -> tuple[int, list[str]]:
    """Write the scores of every row's candidates of ``files`` to ``output`` (atomically);
    (rows, columns written). See the module docstring.

    Raises:
        ValueError: an input without ``items`` and ``candidates`` list columns, an id outside
            the item table, or a row with more candidates than the model scores at once.
    """
    model, info = load_ranking(model_path)
    with ParquetPieces(output) as out, torch.no_grad():
        for file in files:
            table = pq.read_table(file)
            missing = [c for c in ("items", "candidates") if c not in table.column_names]
            if missing:
                raise ValueError(
                    f"'{file}' has no {' or '.join(repr(c) for c in missing)} column (each "
                    "row's history and candidates, item id lists); its columns: "
                    f"{', '.join(table.column_names)}"
                )
            for start in range(0, table.num_rows, batch_size):
                piece = table.slice(start, batch_size)
                probabilities, lengths = _score(model, piece, info, file)  # [M, T], [B]
                splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
                columns = {n: piece.column(n) for n in PASSED_THROUGH if n in piece.column_names}
                for task, label in enumerate(info["labels"]):
                    values = pa.array(probabilities[:, task].numpy(), pa.float32())
                    columns[f"score_{label}"] = pa.ListArray.from_arrays(splits, values)
                out.write(pa.table(columns))
    return out.rows, out.columns


def _ids(piece: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column's values (int64) and per-row offsets from 0."""
    lists = piece.column(column).combine_chunks()
    offsets = lists.offsets.to_numpy().astype(np.int64)
    values = lists.values.slice(offsets[0], offsets[-1] - offsets[0])
    return values.to_numpy(zero_copy_only=False).astype(np.int64), offsets - offsets[0]


def _score(
    model: nn.Module, piece: pa.Table, info: dict, file: Path
) -> tuple[torch.Tensor, np.ndarray]:
    history, history_offsets = _ids(piece, "items")
    candidates, candidate_offsets = _ids(piece, "candidates")
    rows, lengths = latest_rows(history_offsets, info["max_len"])
    kept = history[rows]
    counts = np.diff(candidate_offsets)
    if len(counts) and counts.max() > info["max_candidates"]:
        row = int(counts.argmax())
        raise ValueError(
            f"'{file}': row {row} has {int(counts[row])} candidates; the model scores at most "
            f"{info['max_candidates']} per history at once (a candidate's score does not depend "
            "on the others: split the list over rows)"
        )
    for name, ids in (("items", kept), ("candidates", candidates)):
        if len(ids) and (ids.min() < 0 or ids.max() >= info["num_items"]):
            raise ValueError(
                f"'{file}': {name} ids span [{ids.min()}, {ids.max()}]; the model's item table "
                f"has {info['num_items']} rows"
            )
    inputs = (kept, lengths, candidates, counts)
    return model(*(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs)), counts
