"""The data of ``benchmarks.sasrec_movielens``: a real public interaction log that a pip package
ships, read as it ships (the peer's input) and written as a CSV (recsys preprocess' input).

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

__all__ = ["ML_100K", "LogSource", "find_log", "write_interactions_csv"]

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
