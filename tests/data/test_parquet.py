"""ParquetDataset + BatchLoader over `recsys preprocess` output: sharding, shuffling, resume,
validation, and training on it."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch

from recsys.config import load_config
from recsys.data.batch import DatasetSpec
from recsys.data.loader import BatchLoader
from recsys.data.parquet import ParquetDataset, table_to_batch
from recsys.train.trainer import train

from .test_loader import rows


@pytest.fixture(scope="module")
def data(criteo_dataset_dir):
    return ParquetDataset(criteo_dataset_dir.output)


def test_chunks_are_row_groups(data, criteo_dataset_dir):
    assert data.num_samples("train") == criteo_dataset_dir.rows["train"]
    assert data.num_chunks("train") >= data.num_samples("train") // 2048
    assert sum(data.chunk_rows("train", i) for i in range(data.num_chunks("train"))) == (
        data.num_samples("train")
    )
    chunk = data.chunk("train", 1)
    assert len(chunk) == data.chunk_rows("train", 1)
    assert chunk.dense.dtype == torch.float32 and chunk.labels.shape == (len(chunk), 1)
    assert chunk.sparse.keys() == list(data.spec.sparse_names)


def test_two_ranks_cover_every_row_exactly_once(data):
    everything = rows(*(data.chunk("valid", i) for i in range(data.num_chunks("valid"))))
    shards = [
        rows(*BatchLoader(data, "valid", 500, shuffle=True, seed=3, rank=r, world_size=2))
        for r in range(2)
    ]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(everything)


def test_shuffle_buffer_mixes_rows_across_chunks(data):
    plain = next(iter(BatchLoader(data, "train", 4096)))
    assert rows(plain)[:2048] == rows(data.chunk("train", 0))  # no shuffle: file order
    loader = BatchLoader(data, "train", 4096, shuffle=True, shuffle_buffer_chunks=4)
    mixed = set(rows(next(iter(loader))))
    buffer = [set(rows(data.chunk("train", c))) for c in loader.chunks[:4]]
    assert mixed <= set().union(*buffer)  # drawn from the first shuffle buffer only
    assert sum(1 for chunk in buffer if mixed & chunk) >= 3  # and from several of its chunks


def test_resume_from_a_data_position_continues_exactly(data):
    def loader(start=0):
        return BatchLoader(
            data,
            "train",
            1000,
            shuffle=True,
            seed=1,
            epoch=2,
            drop_last=True,
            shuffle_buffer_chunks=3,
            start_batch=start,
            prefetch=2,
        )

    full = list(loader())
    for start in (0, 5, len(full) - 1, len(full)):
        resumed = list(loader(start))
        assert [rows(b) for b in resumed] == [rows(b) for b in full[start:]]
    with pytest.raises(ValueError, match="start_batch"):
        loader(len(full) + 1)


def test_ids_beyond_a_table_after_a_schema_change(criteo_dataset_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(criteo_dataset_dir.output, copy)
    metadata = json.loads((copy / "metadata.json").read_text())
    metadata["categorical"][3]["cardinality"] = 4  # as if the vocabulary had shrunk
    (copy / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(ValueError, match="cat_3 id .* outside its table of 4 rows"):
        ParquetDataset(copy).chunk("train", 0)
    ParquetDataset(copy, validate=False).chunk("train", 0)  # the check can be turned off


def test_bad_values_in_a_table():
    spec = DatasetSpec(("x",), ("c",), (10,), ("y",))
    good = {"x": [0.5, 1.0], "c": [1, 2], "y": [0.0, 1.0]}
    table_to_batch(pa.table(good), spec, set())
    with pytest.raises(ValueError, match="label y of row 1 is 2.0"):
        table_to_batch(pa.table({**good, "y": [0.0, 2.0]}), spec, set(), "t.parquet")
    with pytest.raises(ValueError, match="dense x of row 0 is inf"):
        table_to_batch(pa.table({**good, "x": [np.inf, 1.0]}), spec, set())
    with pytest.raises(ValueError, match="column x has 1 missing"):
        table_to_batch(pa.table({**good, "x": [None, 1.0]}), spec, set())


def test_not_a_dataset_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a preprocessed dataset"):
        ParquetDataset(tmp_path)


def test_training_on_preprocessed_criteo(criteo_dataset_dir, tmp_path):
    config = load_config(
        "configs/dlrm_synthetic.toml",
        [
            f"--data.path={criteo_dataset_dir.output}",
            f"--run.dir={tmp_path}",
            "--run.device=cpu",
            "--train.batch_size=512",
            "--train.epochs=3",
            "--train.eval_every_steps=40",
        ],
    )
    result = train(config)
    assert result.steps == 3 * (criteo_dataset_dir.rows["train"] // 512)
    assert result.test["num_samples"] == criteo_dataset_dir.rows["test"]
    assert "oracle_auc" not in result.test
    assert result.test["auc"] > 0.7  # the teacher's signal survived preprocessing
