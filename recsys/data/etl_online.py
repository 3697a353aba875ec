"""Raw rows through a preprocessed directory's fitted transform, in memory: what
``recsys preprocess --apply DIR`` (and ``recsys predict --transform``) does to a file, for the
few rows of an online request.

The steps are the file path's, in its order: dense values as float32 (the readers' type), null
items of a bag dropped, categorical values
cast to the type the workflow was fitted on (``12`` and ``"12"`` are different values), label
columns absent from the input read as nulls, then the fitted NVTabular workflow
(Categorify or HashBucket, FillMissing, the signed log and Normalize of dense values) or, for
``encoding = "raw"``, the raw keys and dense transform of :func:`recsys.data.etl_raw.encode_raw`.
So a row gets exactly the ids and dense values it gets from a file (tested against
``recsys predict --transform``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from recsys.config import PreprocessConfig
from recsys.data.etl import InputStats, clean_piece
from recsys.data.etl_raw import encode_raw
from recsys.data.prepared import read_metadata
from recsys.data.readers import Roles

__all__ = ["RowTransform"]

ONLINE = Path("request")  # where a piece comes from, in clean_piece's messages


class RowTransform:
    """The fitted transform of the preprocessed directory ``directory``, for rows in memory.

    Args:
        directory: a directory written by ``recsys preprocess`` (its ``metadata.json`` and,
            unless its ids are raw keys, its fitted ``workflow/``).

    Raises:
        FileNotFoundError, ValueError: not a preprocessed directory, or no fitted workflow.

    Example::

        transform = RowTransform("data/events")
        table = transform(pa.table({"user": [10**12], "item": ["item-3"],
                                    "genres": [["g1", "g4"]], "price": [2.5]}))
        # user, item int64 ids; genres list<int64>; price float32 (labels left out)
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        metadata = read_metadata(self.directory)
        self.fingerprint: str = metadata["fingerprint"]
        categorical = [c for c in metadata["categorical"] if not c["multi_hot"]]
        multi_hot = [c for c in metadata["categorical"] if c["multi_hot"]]
        self.roles = Roles(
            [c["name"] for c in categorical],
            [c["name"] for c in multi_hot],
            list(metadata["dense"]),
            list(metadata["labels"]),
        )
        options = metadata.get("preprocess", {})
        self.raw_keys = metadata.get("id_encoding") == "raw"
        self.log_dense = bool(options.get("log_dense", True))
        self.workflow = None
        self.types: dict[str, pa.DataType] = {}
        if not self.raw_keys:
            from recsys.data.etl_workflow import fitted_types, load_workflow

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # merlin warns about absent GPU packages
                config = PreprocessConfig(apply=str(self.directory))
                self.workflow = load_workflow(config)
            self.types = fitted_types(self.workflow, self.roles)

    @property
    def inputs(self) -> list[str]:
        """The raw columns a row must have: categorical, multi-hot, dense (not the labels)."""
        return self.roles.categorical + self.roles.multi_hot + self.roles.dense

    def __call__(self, table: pa.Table) -> pa.Table:
        """Raw rows (the columns of :attr:`inputs`; dense values may be null: missing) ->
        categorical int64 ids, multi-hot list<int64> ids and dense float32, in
        :attr:`inputs` order.

        Raises:
            ValueError: a missing column, or a categorical value that does not convert to the
                type the workflow was fitted on (naming the column).
        """
        missing = [name for name in self.inputs if name not in table.column_names]
        if missing:
            raise ValueError(f"raw rows lack the column(s) {missing}; expected {self.inputs}")
        table = table.select(self.inputs)
        for name in self.roles.dense:  # as the readers give them: float32, null when missing
            column = pc.cast(pc.cast(table.column(name), pa.float64()), pa.float32())
            table = table.set_column(table.schema.get_field_index(name), name, column)
        # As a file's piece: null bag items dropped, categories in the fitted type (a value
        # that does not convert is an error naming its column).
        table = clean_piece(
            table, self.roles, InputStats(), self.types, ONLINE, str(self.directory)
        )
        if self.raw_keys:
            return encode_raw(table, self.roles, self.log_dense).select(self.inputs)
        for name in self.roles.labels:  # the workflow reads them; the output drops them
            table = table.append_column(name, pa.nulls(table.num_rows, pa.float32()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            frame = self.workflow.transform(table.to_pandas())
        types = {name: pa.int64() for name in self.roles.categorical}
        types |= {name: pa.list_(pa.int64()) for name in self.roles.multi_hot}
        types |= {name: pa.float32() for name in self.roles.dense}
        schema = pa.schema([(name, types[name]) for name in self.inputs])
        return pa.Table.from_pandas(frame[self.inputs], preserve_index=False).cast(schema)
