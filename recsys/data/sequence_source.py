"""The user histories a sequence model's run trains and ranks on (``model.name = "sasrec"`` /
``"hstu"``): a directory written by ``recsys preprocess --format interactions``
(``data.source = "sequences"``), or the synthetic interaction log of
:mod:`recsys.data.synthetic_sequences` (``"synthetic_sequences"``), generated with the run's
seed and preprocessed the same way (leave-one-out, items categorified) in a temporary
directory. Every split is read into memory (about 8 bytes per event;
:class:`~recsys.data.sequence_batches.SequenceLoader` cuts the batches).

Example::

    data = build_sequence_dataset(config.data, "synthetic_sequences", seed=0)
    loader = data.loader("train", batch_size=128, max_len=50)
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from recsys.config import DataConfig, PreprocessConfig
from recsys.data.batch import DatasetSpec
from recsys.data.item_encoding import ItemEncoding
from recsys.data.prepared import SPLITS, read_metadata
from recsys.data.sequence_batches import ITEMS, Histories, SequenceLoader, read_histories
from recsys.data.sequences import SEQUENCE_KIND, preprocess_interactions

__all__ = ["SequenceDataset", "build_sequence_dataset", "is_sequence_directory"]


def is_sequence_directory(path: str | Path) -> bool:
    """Whether ``path`` is a directory of user histories (``recsys preprocess --format
    interactions`` output)."""
    try:
        return read_metadata(path).get("kind") == SEQUENCE_KIND
    except (FileNotFoundError, ValueError):
        return False


@dataclass
class SequenceDataset:
    """Every split of a sequence dataset, in memory.

    Attributes:
        splits: each split's histories (valid / test with their targets).
        num_items: rows of the item table (item ids are in [0, num_items)); 0 for raw item
            keys (a dynamic item table).
        first_item: the first real item id (categorified items reserve 0-2: padding, missing,
            rare); ranking and sampled negatives use ids from it on.
        spec: the item table as a :class:`DatasetSpec` (one feature, ``items``; no label),
            which a checkpoint's ``spec.json`` records.
        oracle: the synthetic log's expected test metrics of its oracle (``hr@10``,
            ``ndcg@10``, ...); None for other data.
        item_encoding: how its items were encoded (raw item values -> ids and back).
    """

    splits: dict[str, Histories]
    num_items: int
    first_item: int
    spec: DatasetSpec
    oracle: dict[str, float] | None
    item_encoding: ItemEncoding

    def loader(
        self,
        split: str,
        batch_size: int,
        *,
        seed: int = 0,
        max_len: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        train_rows: str = "windows",
        window_stride: int = 0,
    ) -> SequenceLoader:
        """Batches of ``split`` for rank ``rank`` of ``world_size`` (see
        :class:`SequenceLoader`)."""
        return SequenceLoader(
            self.splits[split],
            split,
            batch_size,
            seed=seed,
            max_len=max_len,
            rank=rank,
            world_size=world_size,
            train_rows=train_rows,
            window_stride=window_stride,
        )

    @property
    def raw_ids(self) -> bool:
        """Whether items are raw 64-bit keys (a dynamic item table; ``num_items`` is 0)."""
        return self.spec.id_encoding == "raw"

    def train_item_counts(self) -> np.ndarray:
        """[num_items] how often each item occurs in the train histories (index ids)."""
        return np.bincount(self.splits["train"].values, minlength=self.num_items)

    def train_key_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct items of the train histories, ascending; how often each occurs): the
        counts of raw item keys."""
        return np.unique(self.splits["train"].values, return_counts=True)


def build_sequence_dataset(config: DataConfig, source: str, seed: int) -> SequenceDataset:
    """The histories ``[data]`` names: ``source`` is ``"sequences"`` (``data.path``) or
    ``"synthetic_sequences"`` (``[data.synthetic_sequences]``, generated with ``seed`` and
    preprocessed with every event kept).

    Raises:
        ValueError: data.path is not a directory of histories, or a synthetic source with a
            data.path.
        FileNotFoundError: data.path does not exist.
    """
    if source == "synthetic_sequences":
        if config.path:
            raise ValueError(
                f"data.path = '{config.path}' but data.source = 'synthetic_sequences'; use "
                "data.source = 'auto' (or 'sequences') to read it"
            )
        return _synthetic(config, seed)
    if source != "sequences":
        raise ValueError(f"data.source = {source!r}; a sequence model reads 'sequences'")
    if not config.path:
        raise ValueError("data.source = 'sequences' needs data.path")
    path = Path(config.path)
    if not path.exists():
        raise FileNotFoundError(f"data.path not found: '{path}'")
    return _read(path, oracle=None)


def _read(path: Path, oracle: dict[str, float] | None) -> SequenceDataset:
    metadata = read_metadata(path)
    if metadata.get("kind") != SEQUENCE_KIND:
        raise ValueError(
            f"data.path '{path}' holds click-log (CTR) data, not user histories; a sequence "
            "model trains on `recsys preprocess --format interactions` output"
        )
    sequence = metadata["sequence"]
    num_items = int(sequence["num_items"])
    reserved = sequence.get("reserved_ids") or {}
    first_item = max(reserved.values()) + 1 if reserved else 0
    splits = {split: read_histories(path, split) for split in SPLITS}
    if not splits["train"].users:
        raise ValueError(f"data.path '{path}' has no train history (users need 2+ events)")
    spec = DatasetSpec(
        dense_names=(),
        sparse_names=(ITEMS,),
        cardinalities=(num_items,),
        label_names=(),
        fingerprint=metadata.get("fingerprint", ""),
        id_encoding="raw" if metadata["id_encoding"] == "raw" else "index",
    )
    return SequenceDataset(
        splits,
        num_items,
        first_item,
        spec,
        oracle,
        ItemEncoding.read(path),
    )


def _synthetic(config: DataConfig, seed: int) -> SequenceDataset:
    from recsys.data.synthetic_sequences import SyntheticSequences, generate_log, oracle_metrics

    options = asdict(config.synthetic_sequences)
    encoding = "raw" if options.pop("id_encoding") == "raw" else "categorify"
    try:
        params = SyntheticSequences(**options, seed=seed)
    except ValueError as error:  # names the rule broken: num_items >= num_topics, ...
        raise ValueError(f"[data.synthetic_sequences]: {error}") from None
    log, truth = generate_log(params)
    with tempfile.TemporaryDirectory(prefix="recsys-sequences-") as work:
        pq.write_table(log, Path(work) / "log.parquet")
        preprocess_interactions(
            PreprocessConfig(
                format="interactions",
                input=str(Path(work) / "log.parquet"),
                output=str(Path(work) / "histories"),
                user="user",
                item="item",
                time="time",
                encoding=encoding,
            )
        )
        return _read(Path(work) / "histories", oracle=oracle_metrics(params, truth))
