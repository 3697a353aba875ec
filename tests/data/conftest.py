"""Preprocessed datasets shared by the data tests (built once per session: NVTabular is slow
to start)."""

import gzip

import pytest

from recsys.config import PreprocessConfig, SyntheticConfig
from recsys.data.etl import preprocess
from recsys.data.synthetic import SyntheticDataset

CARDINALITIES = [
    3,
    40,
    500,
    2000,
    60,
    7,
    900,
    300,
    30,
    1500,
    100,
    1000,
    45,
    20,
    700,
    1200,
    10,
    400,
    80,
    5,
    1800,
    25,
    15,
    600,
    90,
    350,
]
TRAIN_ROWS = 24_000


@pytest.fixture(scope="session")
def synthetic_criteo_log(tmp_path_factory):
    """A gzip Criteo log of synthetic rows (labels from the teacher) plus two broken lines."""
    path = tmp_path_factory.mktemp("raw") / "train.txt.gz"
    data = SyntheticDataset(
        SyntheticConfig(cardinalities=CARDINALITIES, num_train_samples=TRAIN_ROWS), seed=5
    )
    data.write_criteo(path)
    with gzip.open(path, "at") as f:
        f.write("not a criteo line\n1\t2\t3\n")
    return path


@pytest.fixture(scope="session")
def criteo_dataset_dir(synthetic_criteo_log, tmp_path_factory):
    output = tmp_path_factory.mktemp("prep") / "criteo"
    report = preprocess(
        PreprocessConfig(
            format="criteo",
            input=str(synthetic_criteo_log),
            output=str(output),
            freq_threshold=2,
            valid_fraction=0.1,
            test_fraction=0.1,
            row_group_rows=2048,
        )
    )
    return report
