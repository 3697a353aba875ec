"""The README's headline numbers, read from ``benchmarks/results/*.csv``: none is typed by hand.

Each headline pairs recsys' row with the peer's row of the same benchmark run (same commit,
device and config) and links to the recsys row's line of its CSV. ``python scripts/headline.py``
prints the table; ``--write`` puts it between the README's ``<!-- headline:begin -->`` and
``<!-- headline:end -->`` markers (a test fails when the README and the results disagree).
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"


@dataclass(frozen=True)
class Headline:
    what: str
    topic: str
    match: dict[str, str]  # column -> value prefix, both rows
    recsys: str  # provider of recsys' row
    peer: str  # provider of the peer's row
    value: str  # the column compared
    unit: str
    higher_is_better: bool


HEADLINES = (
    Headline(
        "Sharded embedding step, 2 gloo ranks, each side's planner (26 tables, dim 64)",
        "sharding",
        {"config": "sharding=planner", "dtype": "fp32"},
        "recsys_sharded",
        "torchrec_dmp",
        "time_p50_ms",
        "ms",
        False,
    ),
    Headline(
        "Dynamic (raw-id) tables sharded by key, 2 gloo ranks",
        "sharding",
        {"config": "sharding=key_wise", "dtype": "fp32"},
        "recsys_sharded",
        "torchrec_mch_dmp",
        "time_p50_ms",
        "ms",
        False,
    ),
    Headline(
        "DLRM train step, one process (the default recipe, batch 2048)",
        "models",
        {"config": "recipe=dlrm_synthetic.toml"},
        "recsys_dlrm",
        "torchrec_dmp_fused",
        "throughput",
        "samples/s",
        True,
    ),
    Headline(
        "Host syncs per train step (the default recipe, batch 2048)",
        "step_audit",
        {"batch": "2048", "ranks": "1"},
        "recsys",
        "torchrec_dmp",
        "syncs",
        "",
        False,
    ),
)
PEER_NAMES = {
    "torchrec_dmp": "TorchRec DistributedModelParallel",
    "torchrec_mch_dmp": "TorchRec managed-collision tables under DMP",
    "torchrec_dmp_fused": "TorchRec DMP (FBGEMM fused)",
}


def _rows(topic: str) -> list[tuple[int, dict[str, str]]]:
    """``(line in the file, row)`` of every row of a topic's CSV (the header is line 1)."""
    with open(REPO / "benchmarks" / "results" / f"{topic}.csv", newline="") as handle:
        return [(index + 2, row) for index, row in enumerate(csv.DictReader(handle))]


def _matches(row: dict[str, str], match: dict[str, str]) -> bool:
    return all(row.get(column, "").startswith(prefix) for column, prefix in match.items())


def pair(headline: Headline) -> tuple[tuple[int, dict], dict]:
    """The latest run (commit and device) holding both recsys' and the peer's row matching
    ``headline.match``, the peer's row the one written nearest to recsys' (a benchmark run
    appends its providers' rows together): ``((line, recsys row), peer row)``."""
    rows = [(line, row) for line, row in _rows(headline.topic) if _matches(row, headline.match)]
    for line, ours in reversed(rows):
        if ours["provider"] != headline.recsys or ours[headline.value] in ("", "nan"):
            continue
        peers = [
            (abs(peer_line - line), theirs)
            for peer_line, theirs in rows
            if all(theirs[c] == ours[c] for c in ("commit", "device"))
            and theirs["provider"] == headline.peer
            and theirs[headline.value] not in ("", "nan")
        ]
        if peers:  # the peer's row written nearest to ours: the same benchmark run
            return (line, ours), min(peers, key=lambda p: p[0])[1]
    raise LookupError(f"no run of {headline.topic} holds both {headline.recsys} and the peer")


def _number(text: str, unit: str) -> str:
    value = float(text)
    if value.is_integer() or value >= 1000:
        return f"{value:,.0f} {unit}".strip()
    return f"{value:.1f} {unit}".strip()


def table() -> str:
    """The headline table, as the README shows it."""
    out = ["| what | recsys | peer | | machine, commit |", "| --- | --- | --- | --- | --- |"]
    for h in HEADLINES:
        (line, ours), theirs = pair(h)
        mine, peer = float(ours[h.value]), float(theirs[h.value])
        if mine == 0 or peer == 0:
            verdict = f"{mine:.0f} vs {peer:.0f}"
        else:
            verdict = f"{(mine / peer if h.higher_is_better else peer / mine):.2f}x"
        link = f"[{ours['commit']}](benchmarks/results/{h.topic}.csv#L{line})"
        machine = ours["device"].split(" (")[0]
        out.append(
            f"| {h.what} | {_number(ours[h.value], h.unit)} | {_number(theirs[h.value], h.unit)} "
            f"({PEER_NAMES[h.peer]}) | {verdict} | {machine}, {link} |"
        )
    return "\n".join(out) + "\n"


def readme_block(text: str) -> str:
    """What the README holds between the markers."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args()
    if not args.write:
        print(table(), end="")
        return
    text = README.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + table() + text[end:])


if __name__ == "__main__":
    main()
