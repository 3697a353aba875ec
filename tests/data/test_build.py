import pytest

from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.criteo import CriteoDataset
from recsys.data.parquet import ParquetDataset
from recsys.data.synthetic import SyntheticDataset

from .test_criteo import line, write


def data_config(*overrides):
    return load_config(None, list(overrides)).data


def test_auto_source_follows_the_path(criteo_dataset_dir, tmp_path):
    assert isinstance(build_dataset(data_config(), 0), SyntheticDataset)
    parquet = build_dataset(data_config(f"--data.path={criteo_dataset_dir.output}"), 0)
    assert isinstance(parquet, ParquetDataset)
    raw = write(tmp_path / "day_0.txt", [line() for _ in range(30)])
    criteo = build_dataset(data_config(f"--data.path={raw}", "--data.criteo.hash_buckets=11"), 0)
    assert isinstance(criteo, CriteoDataset) and criteo.spec.cardinalities[0] == 11


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (["--data.source=synthetic", "--data.path=x"], ValueError, "data.source = 'synthetic'"),
        (["--data.source=parquet"], ValueError, "needs data.path"),
        (["--data.path=/no/such/dir"], FileNotFoundError, "data.path not found"),
    ],
)
def test_source_errors(overrides, error, message):
    with pytest.raises(error, match=message):
        build_dataset(data_config(*overrides), 0)
