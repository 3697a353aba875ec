"""The data of ``benchmarks.sasrec_movielens``: a real public interaction log that a pip package
ships, and the export of a recsys leave-one-out split to the peer's input format.

The log: MovieLens 100K (GroupLens; 100,000 ratings of 1,682 movies by 943 users, 1997-98, with
Unix timestamps) as RecBole 1.2.1's wheel ships it for its quick start:
``recbole/dataset_example/ml-100k/ml-100k.inter`` (1,979,230 bytes, tab-separated, header
``user_id:token item_id:token rating:float timestamp:float``). RecBole is MIT-licensed; the
ratings are GroupLens' (research use, cite Harper & Konstan 2015; see
https://grouplens.org/datasets/movielens/). Nothing is downloaded: the file is read from an
installed ``recbole`` package or straight out of its wheel (a zip).
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

__all__ = ["ML_100K", "LogSource", "export_recbole", "find_log", "write_interactions_csv"]

PEER_PIN = "recbole==1.2.1"


@dataclass(frozen=True)
class LogSource:
    """Where a pip package keeps a MovieLens log: the package, its pin and the file's path
    inside the package (as in the wheel)."""

    name: str
    package: str
    member: str
    size: int


ML_100K = LogSource(
    name="ml-100k",
    package=PEER_PIN,
    member="recbole/dataset_example/ml-100k/ml-100k.inter",
    size=1_979_230,
)


def find_log(source: LogSource, wheel: Path | None, peer_python: Path | None) -> bytes:
    """The bytes of ``source``'s file: from ``wheel`` (a wheel or any zip holding the member)
    when given, else from an installed package in this environment, else from the peer
    environment of ``peer_python`` (``<venv>/bin/python``).

    Raises:
        SystemExit: the file is found nowhere; the message says how to get the wheel.
    """
    if wheel is not None:
        if not zipfile.is_zipfile(wheel):
            raise SystemExit(f"--wheel {wheel}: not a wheel (zip) file")
        with zipfile.ZipFile(wheel) as archive:
            if source.member not in archive.namelist():
                raise SystemExit(f"--wheel {wheel} holds no {source.member}")
            return archive.read(source.member)
    package = source.member.split("/")[0]
    candidates = []
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p).parent / source.member for p in spec.submodule_search_locations]
    if peer_python is not None:
        venv = Path(peer_python).parent.parent  # <venv>/bin/python, not resolved
        sites = glob.glob(str(venv / "lib" / "python*" / "site-packages"))
        candidates += [Path(site) / source.member for site in sites]
    for path in candidates:
        if path.is_file():
            return path.read_bytes()
    looked = ", ".join(map(str, candidates)) or f"no {package} package here, no peer environment"
    raise SystemExit(
        f"{source.name}: {source.member} not found ({looked}).\n"
        f"Get the wheel that ships it with `pip download --no-deps {source.package} -d DIR` "
        "and pass --wheel DIR/recbole-1.2.1-py3-none-any.whl, or install the peer "
        "(requirements/peer-sasrec.txt) and pass --peer-python"
    )


def write_interactions_csv(data: bytes, path: Path) -> int:
    """Write a RecBole atomic ``.inter`` file's user, item and timestamp columns as a CSV with
    the header ``user,item,time`` (what ``recsys preprocess --format interactions --user user
    --item item --time time`` reads); the number of interactions.

    Raises:
        ValueError: the header lacks one of the three columns.
    """
    lines = data.decode("utf-8").splitlines()
    header = [name.split(":")[0] for name in lines[0].split("\t")]
    wanted = ("user_id", "item_id", "timestamp")
    if any(name not in header for name in wanted):
        raise ValueError(f"the log's header {header} lacks one of the columns {list(wanted)}")
    index = [header.index(name) for name in wanted]
    rows = 0
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["user", "item", "time"])
        for line in lines[1:]:
            if line:
                fields = line.split("\t")
                writer.writerow([fields[i] for i in index])
                rows += 1
    return rows


def _read_split(split_dir: Path, split: str):
    return pq.read_table(split_dir / split).to_pydict()


def export_recbole(split_dir: Path, out_dir: Path, name: str, num_items: int) -> dict[str, int]:
    """Write the split that ``recsys preprocess --format interactions`` wrote to ``split_dir``
    as RecBole atomic files, pre-split and pre-augmented (``benchmark_filename`` mode):
    ``<out_dir>/<name>/<name>.{train,valid,test}.inter`` with the columns ``user_id:token``,
    ``item_id_list:token_seq`` (the history, oldest first) and ``item_id:token`` (the target),
    and ``<name>.item`` listing every recsys id from 3 (the candidates: ids 0-2 are reserved) so
    RecBole's corpus holds the same items. Item tokens are recsys' ids.

    Train: each train row e_1 .. e_m gives the m - 1 examples (e_1 .. e_t -> e_(t+1)), exactly
    the (history prefix, next item) pairs recsys' causal model learns from that row. Valid /
    test: one example per row, its history and target as recsys ranks them.

    Returns the examples written per split.
    """
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    header = "user_id:token\titem_id_list:token_seq\titem_id:token\n"
    counts = {}
    train = _read_split(split_dir, "train")
    with open(folder / f"{name}.train.inter", "w") as f:
        f.write(header)
        written = 0
        for user, items in zip(train["user"], train["items"], strict=True):
            for t in range(1, len(items)):
                f.write(f"{user}\t{' '.join(map(str, items[:t]))}\t{items[t]}\n")
                written += 1
        counts["train"] = written
    for split in ("valid", "test"):
        rows = _read_split(split_dir, split)
        with open(folder / f"{name}.{split}.inter", "w") as f:
            f.write(header)
            for user, items, target in zip(
                rows["user"], rows["items"], rows["target"], strict=True
            ):
                f.write(f"{user}\t{' '.join(map(str, items))}\t{target}\n")
        counts[split] = len(rows["user"])
    with open(folder / f"{name}.item", "w") as f:
        f.write("item_id:token\n")
        f.writelines(f"{i}\n" for i in range(3, num_items))
    return counts
