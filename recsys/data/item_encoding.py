"""How a sequence dataset encoded its items, so raw item values (as the interaction log names
them) become the ids a model trained on it reads, and its ids become items again.

``recsys preprocess --format interactions`` turns each item value into its raw 64-bit key
(:func:`recsys.data.keys.value_keys`), then into an id as its ``encoding`` says:

- ``categorify``: ids from 3 by train count (``categories/items.parquet`` lists id, item, key);
  an item it did not keep (unseen in train, or rarer than ``freq_threshold``) is id 2 (rare);
- ``hash``: key mod ``hash_buckets``;
- ``raw``: the key itself (a dynamic item table: an item it never trained reads the zero row).

:class:`ItemEncoding` holds that mapping (a categorified dataset's vocabulary whole), writes it
as JSON into an export, and applies it to raw histories (:meth:`ItemEncoding.encode`) and back
to the model's top items (:meth:`ItemEncoding.decode`: categorify gives the items' own values,
the other encodings their ids / keys).

Example::

    encoding = ItemEncoding.read("data/histories")
    ids = encoding.encode(pa.array(["i17", "i4"]))   # int64 [2]
    encoding.decode(ids)                             # ["i17", "i4"] (categorify)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys.data.keys import value_keys
from recsys.data.prepared import read_metadata

__all__ = ["ItemEncoding"]

RARE_ID, FIRST_ID = 2, 3  # categorify: the id of an item it did not keep; the first item's
ENCODINGS = ("categorify", "hash", "raw")


@dataclass
class ItemEncoding:
    """A sequence dataset's item encoding (see the module docstring).

    Attributes:
        encoding: ``categorify``, ``hash`` or ``raw``.
        hash_buckets: ``hash``: the number of ids.
        keys: ``categorify``: the kept items' raw keys, ascending (int64 [V]).
        ids: ``categorify``: their ids (int64 [V]).
        items: ``categorify``: the items' values by id, from id 3 (arrow array [V]).
    """

    encoding: str
    hash_buckets: int = 0
    keys: np.ndarray | None = None
    ids: np.ndarray | None = None
    items: pa.Array | None = None

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"item encoding {self.encoding!r}; expected one of {ENCODINGS}")
        if self.encoding == "categorify" and (self.keys is None or self.items is None):
            raise ValueError("a categorify item encoding needs its keys, ids and items")

    @classmethod
    def read(cls, path: str | Path) -> ItemEncoding:
        """The encoding of the sequence dataset in ``path`` (its metadata, and for
        categorify ``categories/items.parquet``)."""
        metadata = read_metadata(path)
        encoding = metadata.get("encoding", "categorify")
        options = metadata.get("preprocess", {})
        if encoding != "categorify":
            return cls(encoding, hash_buckets=int(options.get("hash_buckets", 0)))
        table = pq.read_table(Path(path) / "categories" / "items.parquet")
        keys = table.column("key").to_numpy().astype(np.int64)
        order = np.argsort(keys, kind="stable")
        ids = table.column("id").to_numpy().astype(np.int64)
        return cls(
            encoding, keys=keys[order], ids=ids[order], items=table.column("item").combine_chunks()
        )

    def to_json(self) -> str:
        """The encoding as JSON (what an export carries)."""
        out: dict = {"encoding": self.encoding, "hash_buckets": self.hash_buckets}
        if self.encoding == "categorify":
            out["keys"] = self.keys.tolist()
            out["ids"] = self.ids.tolist()
            out["items"] = self.items.to_pylist()
            out["item_type"] = str(self.items.type)
        return json.dumps(out)

    @classmethod
    def from_json(cls, text: str) -> ItemEncoding:
        """The encoding :meth:`to_json` wrote."""
        data = json.loads(text)
        if data["encoding"] != "categorify":
            return cls(data["encoding"], hash_buckets=data["hash_buckets"])
        items = pa.array(data["items"])
        if str(items.type) != data["item_type"]:
            items = items.cast(pa.type_for_alias(data["item_type"]))
        return cls(
            "categorify",
            keys=np.asarray(data["keys"], dtype=np.int64),
            ids=np.asarray(data["ids"], dtype=np.int64),
            items=items,
        )

    def encode(self, values: pa.Array) -> np.ndarray:
        """int64 ids of raw item ``values`` (strings, integers, ...; as in the log).

        Raises:
            ValueError: a null item (an event names its item)."""
        if values.null_count:
            where = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"item {where} of the histories is null; every event names its item")
        keys = value_keys(values)
        if self.encoding == "raw":
            return keys
        if self.encoding == "hash":
            return keys % self.hash_buckets
        if not len(self.keys):
            return np.full_like(keys, RARE_ID)
        at = np.searchsorted(self.keys, keys).clip(max=len(self.keys) - 1)
        return np.where(self.keys[at] == keys, self.ids[at], RARE_ID)

    def decode(self, ids: np.ndarray) -> pa.Array | np.ndarray:
        """The items of model ids ``ids`` (int64, any shape flattened): categorify the items'
        values (an arrow array; null for its reserved ids 0-2: padding, missing, rare); hash
        and raw the ids / keys as they are (no vocabulary)."""
        if self.encoding != "categorify":
            return ids
        index = ids.reshape(-1) - FIRST_ID
        return self.items.take(pa.array(np.maximum(index, 0), mask=index < 0))
