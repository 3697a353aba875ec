"""Tiered tables never lose work to a cache, a disk or a second run: an evaluation batch larger
than the cache is pooled in pieces, a training batch larger than the cache grows it, a cache
holding one batch but not two defers the prefetch instead of failing, a full disk is an error
naming the device (never SIGBUS), and a store's files are locked for the life of the run using
them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from itertools import pairwise

import pytest
import torch

from recsys._files import NoSpaceError, describe_os_error
from recsys.embedding.optim import RowWiseAdagrad
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.embedding.tiered.options import StorageOptions
from recsys.embedding.tiered.row_cache import CacheTooSmallError
from recsys.embedding.tiered.row_store import DiskRecords, FixedStore, KeyedStore, store_directory
from recsys.embedding.tiered.store_lock import StoreInUseError
from tests.embedding.tiered.test_tiered import SEED, batches, configs, train
from tests.small_disk import small_disk


def tiered(cache_rows: int, tier: str = "host", path: str = "") -> TieredEmbeddingBagCollection:
    options = StorageOptions(tier=tier, cache_rows=cache_rows, path=path)
    return TieredEmbeddingBagCollection(configs(), options, RowWiseAdagrad(lr=0.1), seed=SEED)


def distinct(kjt, key: str) -> int:
    return len(torch.unique(kjt[key].values()))


def test_an_eval_batch_larger_than_the_cache_is_pooled_in_pieces():
    steps, big = batches(6, batch=16), batches(1, batch=256, seed=5)[0]
    small, whole = tiered(60), tiered(400)
    assert distinct(big, "f_a") > 60  # the batch does not fit the small cache
    for ebc in (small, whole):
        train(ebc, steps, prefetch=True)
        ebc.prefetch(steps[0])  # a train batch is queued when the evaluation comes
        ebc.eval()
    with torch.no_grad():
        got, want = small(big).values(), whole(big).values()
    assert torch.equal(got, want)
    # Training goes on after it, bitwise like the large cache, the queued batch included.
    for ebc in (small, whole):
        ebc.train()
    assert all(
        torch.equal(a, b)
        for a, b in zip(train(small, steps[:3]), train(whole, steps[:3]), strict=True)
    )


def test_a_cache_for_one_batch_defers_the_prefetch_and_trains_the_same():
    steps = batches(8, batch=24)
    need = max(max(distinct(kjt, "f_a"), distinct(kjt, "f_b")) for kjt in steps)
    pairs = max(
        len(torch.unique(torch.cat([x["f_a"].values(), y["f_a"].values()])))
        for x, y in pairwise(steps)
    )
    assert need < pairs  # a cache of `need` rows holds one batch, not two
    tight, whole = tiered(need), tiered(400)
    got, want = train(tight, steps, prefetch=True), train(whole, steps, prefetch=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert tight.prefetch_deferred > 0
    assert whole.prefetch_deferred == 0


def test_a_batch_larger_than_the_cache_grows_it_and_trains_the_same():
    steps = batches(6, batch=64)
    need = max(distinct(kjt, "f_a") for kjt in steps)
    tight, whole = tiered(4), tiered(400)
    # prefetched batches keep their rows while the cache grows under them
    got, want = train(tight, steps, prefetch=True), train(whole, steps, prefetch=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    stats = tight.tiered_stats()
    assert {n: s["grown"] for n, s in stats.items()} == {
        n: s["cache_rows"] - 4 for n, s in stats.items()
    }
    assert need <= stats["a"]["cache_rows"] < 400 and whole.tiered_stats()["a"]["grown"] == 0
    # Without a forward to grow it (a prefetch thread), a batch that does not fit is an error
    # naming the size it needs, and the prefetch defers the batch to its forward.
    keys = torch.arange(5)
    with pytest.raises(CacheTooSmallError, match="'a' has 4 rows, this batch needs 5"):
        tiered(4).caches["a"].prepare(keys, torch.ones_like(keys), train=False)


# ------------------------------------------------------------------------------------------
# The disk tier's files


HOLDER = """
import sys, time
from recsys.embedding.tiered.row_store import DiskRecords
records = DiskRecords(sys.argv[1], 100, 64)
print("locked", flush=True)
time.sleep(120)
"""


def hold(path) -> subprocess.Popen:
    """A process (another run) holding a disk store of ``path``."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_store_of_a_file_is_refused_naming_the_holder(tmp_path):
    path = tmp_path / "t.rows"
    holder = hold(path)
    try:
        with pytest.raises(StoreInUseError, match=rf"in use by another run \(pid {holder.pid} "):
            DiskRecords(path, 100, 64)
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the kernel drops the lock
        holder.wait()
    records = DiskRecords(path, 100, 64)  # the lock died with its process
    records.close()
    DiskRecords(path, 100, 64).close()  # and close() lets it go at once


def test_the_file_is_not_touched_before_the_lock(tmp_path):
    path = tmp_path / "t.rows"
    holder = hold(path)
    try:
        size = path.stat().st_size
        with pytest.raises(StoreInUseError):
            DiskRecords(path, 1000, 64)
        assert path.stat().st_size == size  # not truncated, not grown
    finally:
        holder.kill()
        holder.wait()


def test_one_process_cannot_open_a_file_twice(tmp_path):
    first = DiskRecords(tmp_path / "t.rows", 10, 8)
    with pytest.raises(StoreInUseError, match="this process"):
        DiskRecords(tmp_path / "t.rows", 10, 8)
    first.close()


def test_a_store_path_on_a_missing_mount_is_an_error(tmp_path):
    missing = tmp_path / "nvme" / "recsys"
    with pytest.raises(FileNotFoundError, match=f"its parent '{missing.parent}' does not exist"):
        tiered(60, "disk", str(missing))
    assert not missing.parent.exists()
    assert store_directory(tmp_path / "new") == tmp_path / "new"  # one level is created


@pytest.fixture
def one_mib_disk(tmp_path):
    with small_disk(tmp_path / "small", "1m") as mount:
        yield mount


FILL = """
import sys, torch
from recsys._files import NoSpaceError
from recsys.embedding.tiered.row_store import DiskRecords, FixedStore, KeyedStore
kind, path = sys.argv[1], sys.argv[2]
records = DiskRecords(path, 100_000, 260)  # 26 MB of rows on a 1 MiB disk
store = FixedStore(records) if kind == "fixed" else KeyedStore(records, "t")
written = 0
try:
    for start in range(0, 100_000, 500):
        keys = torch.arange(start, start + 500) * (1 if kind == "fixed" else -7)
        store.write(keys, torch.full((500, 260), 3, dtype=torch.uint8))
        written += 500
except NoSpaceError as error:
    print(error.needed_bytes, written, flush=True)
    keys, records = zip(*store.items(1 << 20))
    print(len(torch.cat(keys)), bool((torch.cat(records) == 3).all()), flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize("kind", ["fixed", "keyed"])
def test_a_full_disk_is_an_error_naming_the_device_not_sigbus(one_mib_disk, kind):
    done = subprocess.run(
        [sys.executable, "-c", FILL, kind, str(one_mib_disk / "t.rows")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.getcwd(),
    )
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])  # not -7 (SIGBUS)
    lines = done.stdout.split("\n")
    needed, written = map(int, lines[0].split())
    assert needed > 0 and 0 < written < 100_000
    stored, intact = lines[1].split()
    assert int(stored) == written and intact == "True"  # every row written reads back


def test_no_space_error_reads_in_one_line(tmp_path):
    error = NoSpaceError(tmp_path / "t.rows", 3 * 2**30)
    line = describe_os_error(error)
    assert line.startswith(f"no space left on {error.device} for '{tmp_path / 't.rows'}' ")
    assert "(needs 3.00 GiB more, " in line and "\n" not in line


def test_reserving_keeps_untouched_rows_sparse(tmp_path):
    records = DiskRecords(tmp_path / "t.rows", 1_000_000, 260)
    store = FixedStore(records)
    store.write(torch.tensor([5, 500_000]), torch.ones(2, 260, dtype=torch.uint8))
    allocated = os.stat(tmp_path / "t.rows").st_blocks * 512
    assert allocated <= 4 * 4096  # two rows: at most two pages each, not 260 MB
    keyed = KeyedStore(DiskRecords(tmp_path / "k.rows", 1024, 260), "k")
    keyed.write(torch.tensor([-3, 9]), torch.ones(2, 260, dtype=torch.uint8))
    assert os.stat(tmp_path / "k.rows").st_blocks * 512 <= 2 * 4096
    time.sleep(0)  # the files stay mapped until the stores go
