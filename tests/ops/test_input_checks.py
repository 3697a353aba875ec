"""The "async" input checks: the same errors as "sync", raised later and naming the step, with
the bad batch's fused update withheld (tables and optimizer state bitwise unchanged), no host
sync, and bitwise the same results as "sync" on good batches."""

import contextlib

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys import EmbeddingBagCollection
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.ops.embedding_bag.pooled import embedding_bag
from recsys.ops.input_checks import INPUT_ERRORS, check_mode
from recsys.train.step_audit import StepAudit
from tests.ops.embedding_bag.test_embedding_bag import make_inputs, poolings

ROWS = (20, 30, 7)


def collection(optimizer, backend, validate, weighted=False):
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(ROWS)
    ]
    return EmbeddingBagCollection(
        tables, is_weighted=weighted, backend=backend, validate=validate, optimizer=optimizer
    )


def batch(bad_id=None, offsets=None, weights=None):
    lengths = torch.tensor([1, 2, 0, 1, 3, 1, 2, 1, 1])  # 3 keys x batch 3
    values = torch.cat(
        [torch.randint(0, n, (int(lengths[3 * k : 3 * k + 3].sum()),)) for k, n in enumerate(ROWS)]
    )
    if bad_id is not None:
        values[bad_id[0]] = bad_id[1]
    kjt_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return KeyedJaggedTensor(
        keys=["f0", "f1", "f2"],
        values=values,
        offsets=kjt_offsets if offsets is None else offsets,
        weights=weights,
    )


def train_step(ebc, kjt):
    ebc(kjt).values().sum().backward()


def snapshot(ebc):
    return {k: v.clone() for k, v in ebc.state_dict().items() if k != "optimizer_step"}


BACKENDS = ["torch", "fbgemm", "triton"]
OPTIMIZERS = [SGD, Adagrad, RowWiseAdagrad, Adam]


def supported(backend, optimizer):
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
        return optimizer is not Adam
    return True


@pytest.fixture(autouse=True)
def _clear_errors():
    with contextlib.suppress(ValueError):
        INPUT_ERRORS.raise_first()
    yield
    with contextlib.suppress(ValueError):
        INPUT_ERRORS.raise_first()
    INPUT_ERRORS.tag = 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.__name__)
def test_bad_batch_updates_nothing_and_raises_later(backend, optimizer):
    if not supported(backend, optimizer):
        pytest.skip(f"{backend} has no {optimizer.__name__}")
    ebc = collection(optimizer(lr=0.1), backend, "async")
    train_step(ebc, batch())  # state exists, step 1
    before = snapshot(ebc)
    INPUT_ERRORS.tag = 5
    train_step(ebc, batch(bad_id=(4, 30)))  # f1's table has 30 rows: no error yet
    after = snapshot(ebc)
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} moved on the bad batch"
    with pytest.raises(ValueError, match=r"^step 5: f1: id 30 is out of range .* 30 rows"):
        INPUT_ERRORS.raise_first()
    INPUT_ERRORS.raise_first()  # read once: cleared
    train_step(ebc, batch())  # a good batch trains again
    assert any(not torch.equal(before[n], v) for n, v in snapshot(ebc).items())


@pytest.mark.parametrize("backend", ["torch", "fbgemm"])
def test_async_equals_sync_on_good_batches(backend):
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    results = []
    for mode in ("sync", "async"):
        ebc = collection(RowWiseAdagrad(lr=0.1), backend, mode)
        torch.manual_seed(1)
        outs = []
        for _ in range(3):
            kjt = batch()
            out = ebc(kjt).values()
            out.sum().backward()
            outs.append(out.detach())
        results.append((outs, snapshot(ebc)))
    (outs_a, state_a), (outs_b, state_b) = results
    assert all(torch.equal(a, b) for a, b in zip(outs_a, outs_b, strict=True))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    INPUT_ERRORS.raise_first()  # nothing recorded


@pytest.mark.parametrize("backend", ["fbgemm", "triton"])
def test_async_step_has_no_sync(backend):
    """On the default paths of CPU (FBGEMM's kernels) and CUDA (Triton's, padded segments in
    backward): a bad batch included. (The interpreter's own copies are ops, not syncs.)"""
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    ebc = collection(RowWiseAdagrad(lr=0.1), backend, "async")
    train_step(ebc, batch())
    kjt = batch(bad_id=(0, -3))
    kjt.offset_per_key()  # what the loader computes on the host
    with StepAudit() as report:
        train_step(ebc, kjt)
    assert report.num_syncs == 0, report.describe()
    with pytest.raises(ValueError, match="f0: id -3 is out of range"):
        INPUT_ERRORS.raise_first()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: torch.cat([o[:1] + 1, o[1:]]), r"^step 2: offsets must start at 0, got 1"),
        (lambda o: torch.cat([o[:3], o[3:4] - 4, o[4:]]), r"non-decreasing .*offsets\[3\]"),
        (lambda o: torch.cat([o[:-1], o[-1:] + 2]), r"offsets reach 14 at offsets\[9\].*12 ids"),
        (lambda o: torch.cat([o[:-1], o[-1:] - 1]), r"offsets\[9\] = 11 where at least 12"),
    ],
)
def test_bad_offsets_raise_later(mutate, message):
    ebc = collection(SGD(lr=0.1), "torch", "async")
    good = batch()
    INPUT_ERRORS.tag = 2
    before = snapshot(ebc)
    train_step(ebc, batch(offsets=mutate(good.offsets())))
    assert all(torch.equal(before[k], v) for k, v in snapshot(ebc).items())
    with pytest.raises(ValueError, match=message):
        INPUT_ERRORS.raise_first()


def test_nan_weight_raises_later():
    ebc = collection(SGD(lr=0.1), "torch", "async", weighted=True)
    weights = torch.ones(12)
    weights[7] = float("nan")
    INPUT_ERRORS.tag = 9
    train_step(ebc, batch(weights=weights))
    with pytest.raises(ValueError, match=r"^step 9: per-sample weight at position 7 is not finite"):
        INPUT_ERRORS.raise_first()


def test_sync_mode_raises_at_once_and_off_checks_nothing():
    ebc = collection(SGD(lr=0.1), "torch", "sync")
    with pytest.raises(ValueError, match="f1: id 30 is out of range"):
        ebc(batch(bad_id=(4, 30)))
    inputs = make_inputs(num_rows=(37, 37, 37))
    inputs["values"][0] = 40
    with pytest.raises(ValueError, match="id 40"):
        embedding_bag(**inputs, table_pooling=poolings("sum"), validate="sync")
    with pytest.raises(ValueError, match="id checks 'later'; expected one of"):
        check_mode("later")
    with pytest.raises(ValueError, match="id checks 'later'"):
        collection(SGD(lr=0.1), "torch", "later")
