"""Synthetic data over tables larger than memory: hashed teacher parameters, exact id maps."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec import KeyedJaggedTensor

from recsys.config import SyntheticConfig
from recsys.data.batch import Batch
from recsys.data.synthetic import CHUNK_SIZE, MAX_TABLE_IDS, SyntheticDataset
from recsys.data.synthetic_drift import HashedTeacherTables, affine_mod

ROOT = Path(__file__).resolve().parents[2]


def large_config(**overrides) -> SyntheticConfig:
    fields = dict(
        cardinalities=[50, 2**40, 7, 3 * 10**9, 10**8],
        bag_sizes=[1, 1, 2, 3, 1],
        num_train_samples=2 * CHUNK_SIZE,
        num_valid_samples=1000,
        num_test_samples=CHUNK_SIZE,
    )
    fields.update(overrides)
    return SyntheticConfig(**fields)


def held_bytes(root: object) -> int:
    """Bytes of every tensor and numpy array reachable from ``root``'s attributes."""
    seen, stack, total = set(), [root], 0
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += item.untyped_storage().nbytes()
        elif isinstance(item, np.ndarray):
            total += item.nbytes
        elif isinstance(item, dict):
            stack += list(item.values())
        elif isinstance(item, list | tuple | set):
            stack += list(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack += list(vars(item).values())
    return total


MEMORY_SCRIPT = """
import json, resource, sys
import torch
from recsys.config import SyntheticConfig
from recsys.data.synthetic import SyntheticDataset

torch.set_num_threads(1)
def status(field):  # kB
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1])
# Room for what the data should need, far from the 26 x 10^9 x 36 B a table per id would take.
limit = (status("VmSize") + 3 * 2**20) * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
before = status("VmHWM")
data = SyntheticDataset(SyntheticConfig(cardinalities=[10**9] * 26), seed=0)
chunk = data.chunk("train", 0)
ids = chunk.sparse.values()
json.dump({"growth_mb": (status("VmHWM") - before) / 1024,
           "ids_in_range": bool(ids.min() >= 0 and ids.max() < 10**9)}, sys.stdout)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_dataset_memory_does_not_grow_with_the_cardinality():
    """26 features of 10^9 ids each: building the dataset and a chunk raises the peak RSS by
    about what 26 x 1,000 ids do (0.12 GiB: the calibration sample, torch's working memory;
    26 x 10^6 tabled ids add 1.07 GiB, a table per id here would be 940 GB). The address space
    is capped, so a table fails fast instead of swapping."""
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["ids_in_range"]
    assert result["growth_mb"] < 256, result


@pytest.mark.parametrize("num_ids", [MAX_TABLE_IDS, MAX_TABLE_IDS + 1])
def test_features_above_the_limit_hold_no_per_id_arrays(num_ids):
    data = SyntheticDataset(large_config(cardinalities=[num_ids, 3, 2**40], bag_sizes=[]), seed=0)
    held = held_bytes(data)
    tabled = 36 * MAX_TABLE_IDS  # K = 8 float32 latent values and a float32 bias per id
    if num_ids <= MAX_TABLE_IDS:
        assert tabled <= held < tabled + 2**20
    else:
        assert held < 2**20


def test_large_table_chunks_are_deterministic_and_in_range():
    config = large_config(num_tasks=2)
    a, b = SyntheticDataset(config, seed=4), SyntheticDataset(config, seed=4)
    later = b.chunk("train", 1)  # chunks do not depend on the order they are made in
    chunk = a.chunk("train", 1)
    for x, y in ((chunk.dense, later.dense), (chunk.labels, later.labels)):
        assert torch.equal(x, y)
    assert torch.equal(chunk.sparse.values(), later.sparse.values())
    assert torch.equal(a.click_probability(chunk), b.click_probability(later))
    assert not torch.equal(chunk.sparse.values(), a.chunk("train", 0).sparse.values())
    for name, n in zip(a.spec.sparse_names, config.cardinalities, strict=True):
        ids = chunk.sparse[name].values()
        assert ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < n
    assert a.spec.cardinalities == tuple(config.cardinalities)


def test_large_table_teacher_is_calibrated_with_a_meaningful_oracle():
    data = SyntheticDataset(large_config(num_tasks=2, click_rate=0.3), seed=0)
    chunk = data.chunk("test", 0)
    probability = data.click_probability(chunk)
    for t in range(2):
        assert abs(float(probability[:, t].mean()) - 0.3) < 0.03
        assert float(binary_auroc(probability[:, t], chunk.labels[:, t].long())) > 0.75
    # The hashed features carry signal: the oracle falls when their ids are scrambled.
    values = chunk.sparse.values().clone()
    starts = np.cumsum([0, *chunk.sparse.length_per_key()])
    for f in (1, 3, 4):  # the hashed features
        piece = values[starts[f] : starts[f + 1]]
        values[starts[f] : starts[f + 1]] = piece[torch.randperm(len(piece))]
    scrambled = KeyedJaggedTensor(
        keys=chunk.sparse.keys(), values=values, lengths=chunk.sparse.lengths()
    )
    shuffled = data.click_probability(Batch(chunk.dense, scrambled, chunk.labels))
    labels = chunk.labels[:, 0].long()
    assert float(binary_auroc(shuffled[:, 0], labels)) < float(
        binary_auroc(probability[:, 0], labels) - 0.02
    )


def test_large_table_ids_keep_the_zipf_skew():
    """The hottest id takes the Zipf share of rank 0, and the hot ids are spread over the
    table (not 0, 1, 2, ...)."""
    n, alpha = 10**8, 1.1
    data = SyntheticDataset(large_config(cardinalities=[n], bag_sizes=[1], zipf_alpha=alpha))
    ids = torch.cat([data.chunk("train", i).sparse.values() for i in range(2)]).numpy()
    unique, counts = np.unique(ids, return_counts=True)
    order = np.argsort(-counts)
    expected = (1 - 2 ** (1 - alpha)) / (1 - (n + 1.0) ** (1 - alpha))  # P(rank 0): 0.080
    assert abs(counts[order[0]] / ids.size - expected) < 0.15 * expected
    assert counts[order[1]] < counts[order[0]] and len(unique) > 0.3 * ids.size  # a long tail
    hot = unique[order[:8]]
    assert hot.max() - hot.min() > n // 10


def test_hashed_parameters_have_the_tables_distributions():
    importance = np.array([0.2, 0.7])
    tables = HashedTeacherTables(seed=3, importance=importance, dim=8)
    ids = torch.arange(2**40 - 40_000, 2**40)
    for f in (0, 1):
        local, embedding, biases = tables.tables(f, ids, num_tasks=2)
        assert embedding.shape == (40_000, 8) and torch.equal(local, torch.arange(40_000))
        assert abs(float(embedding.mean())) < 0.01
        assert abs(float(embedding.std()) - 8**-0.5) < 0.01  # N(0, 1/K), as the tables
        for bias in biases:
            assert abs(float(bias.std()) - importance[f]) < 0.02 * importance[f]
        assert not torch.equal(biases[0], biases[1])  # tasks draw their own
    # An id's parameters do not depend on the batch it comes in.
    local, embedding, _ = tables.tables(1, ids, num_tasks=1)
    other = HashedTeacherTables(seed=3, importance=importance, dim=8)
    local_flipped, embedding_flipped, _ = other.tables(1, ids.flip(0)[:100], num_tasks=1)
    assert torch.equal(embedding_flipped[local_flipped], embedding[local].flip(0)[:100])


@pytest.mark.parametrize("n", [2**31 + 11, 3 * 10**9 + 7, 2**40 - 87, 2**40])
def test_affine_id_map_is_exact_up_to_2_40(n):
    rng = np.random.default_rng(n)
    rank = np.concatenate([rng.integers(0, n, 5000), [0, 1, n - 2, n - 1]])
    for multiplier, shift in ((n - 1, n - 1), (int(rng.integers(1, n)), int(rng.integers(n)))):
        got = affine_mod(rank, multiplier, shift, n)
        want = [(int(r) * multiplier + shift) % n for r in rank]
        assert got.dtype == np.int64 and got.tolist() == want


def test_more_than_2_40_ids_is_a_clear_error():
    with pytest.raises(ValueError, match=r"2\^40 = 1,099,511,627,776"):
        SyntheticDataset(large_config(cardinalities=[5, 2**40 + 1], bag_sizes=[]))
