"""The README's headline numbers, read from ``benchmarks/results/*.csv``: none is typed by hand.

Each headline pairs recsys' row with the peer's row of the same benchmark run (same commit,
device and config) and links to the recsys row's line of its CSV. The scale block is ``recsys
plan``'s projection of the MLPerf DLRM-DCNv2 model (``scale_projection.csv``, the latest run)
and the model beside the published MLPerf submissions (``mlperf_published.csv``).
``python scripts/headline.py`` prints the tables; ``--write`` puts each between its README
markers (``<!-- headline:begin -->`` / ``<!-- headline:end -->``, ``<!-- scale:begin -->`` /
``<!-- scale:end -->``; a test fails when the README and the results disagree).
"""

from __future__ import annotations

import argparse
import csv
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"
SCALE_BEGIN, SCALE_END = "<!-- scale:begin -->", "<!-- scale:end -->"
RECIPE = "configs/dlrm_dcnv2_mlperf.toml"  # the projected model


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


def _latest(topic: str) -> list[tuple[int, dict[str, str]]]:
    """``(line, row)`` of every row of a topic's latest run (the last row's commit)."""
    rows = _rows(topic)
    commit = rows[-1][1]["commit"]
    return [(line, row) for line, row in rows if row["commit"] == commit]


def _millions(text: str) -> str:
    value = float(text) / 1e6
    return f"{value:,.0f} M" if value >= 100 else f"{value:.1f} M"


def _minutes(text: str) -> str:
    return f"{float(text):.1f} min" if text else "–"


def scale_table() -> str:
    """The MLPerf DLRM-DCNv2 projection (flat / 2D per world size) and the model against the
    published submissions of NVIDIA H100 systems, as the README shows them."""
    projected = [(n, r) for n, r in _latest("scale_projection") if r["recipe"].startswith(RECIPE)]
    line, first = projected[0]
    rows = [row for _, row in projected]
    by_world: dict[int, dict[str, dict[str, str]]] = {}
    for row in rows:
        kind = "flat" if row["kind"] == "flat" else "2d"
        by_world.setdefault(int(row["world_size"]), {})[kind] = row
    # The notes: "a model, not a measurement; <the topology's figures>; predicted ms: ...".
    figures = first["notes"].removeprefix("a model, not a measurement; ")
    figures = figures.split("; predicted ms:")[0]
    sync_every = next(row["sync_every"] for row in rows if row["kind"] != "flat")
    gpus = first["hardware"].split("_")[0].upper() + "s"  # h100_8x_ib400 -> H100s
    link = f"[{first['commit']}](benchmarks/results/scale_projection.csv#L{line})"
    # "<recipe> batch <B>/rank <precision>" (rows before the precision was named: fp32)
    per_rank, _, precision = first["recipe"].split(" batch ")[1].partition("/rank")
    precision = precision.strip() or "fp32"
    out = [
        f"`recsys plan`'s projection of the MLPerf DLRM-DCNv2 model "
        f"({int(per_rank):,} samples per GPU, trained in {precision}, 2D: a group "
        f"per node, synced every {sync_every} steps) on "
        f"{figures}; {link}. **A model, not a measurement.**",
        "",
        f"| {gpus} | GiB per GPU, flat / 2D | inter-node MiB per step, flat / 2D "
        "| predicted samples/s, flat / 2D |",
        "| --- | --- | --- | --- |",
    ]

    def pair(kinds: dict[str, dict[str, str]], column: str, fmt) -> str:
        return " / ".join(fmt(kinds[k][column]) for k in ("flat", "2d") if k in kinds)

    for world, kinds in sorted(by_world.items()):
        out.append(
            f"| {world:,} | {pair(kinds, 'memory_gib', lambda v: f'{float(v):.1f}')} "
            f"| {pair(kinds, 'inter_node_mib', lambda v: f'{float(v):,.0f}')} "
            f"| {pair(kinds, 'samples_per_s', _millions)} |"
        )
    nvidia = [
        (n, r)
        for n, r in _latest("mlperf_published")
        if r["submitter"] == "NVIDIA" and "H100" in r["accelerator"]
    ]
    line, first = nvidia[0]
    published = [row for _, row in nvidia]
    source = first["source"].split(" ")[0]
    link = f"[{first['commit']}](benchmarks/results/mlperf_published.csv#L{line})"
    trained = re.search(r" in (fp32|bf16|fp16) at ", first["notes"])
    precision = f" in {trained.group(1)}" if trained else ""
    out += [
        "",
        f"Beside published MLPerf Training results (NVIDIA's DGX H100 DLRM-DCNv2 submissions, "
        f"HugeCTR, mixed precision, from the submitters' logs in {source}; the model{precision} "
        f"at their GPUs and batch; {link}):",
        "",
        "| H100s | samples per GPU | published samples/s | time to train | predicted flat "
        "| predicted / published |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(published, key=lambda r: int(r["gpus"])):
        gpus = int(row["gpus"])
        out.append(
            f"| {gpus:,} | {int(row['global_batch']) // gpus:,} "
            f"| {_millions(row['published_samples_per_s'])} "
            f"| {_minutes(row['published_minutes'])} "
            f"| {_millions(row['predicted_samples_per_s'])} "
            f"| {float(row['predicted_ratio']):.2f} |"
        )
    return "\n".join(out) + "\n"


BLOCKS = ((BEGIN, END, table), (SCALE_BEGIN, SCALE_END, scale_table))


def readme_block(text: str, begin: str = BEGIN, end: str = END) -> str:
    """What the README holds between the markers."""
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[start:stop].strip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args()
    if not args.write:
        for _, _, make in BLOCKS:
            print(make())
        return
    text = README.read_text()
    for begin, end, make in BLOCKS:
        start, stop = text.index(begin) + len(begin), text.index(end)
        text = text[:start] + "\n" + make() + text[stop:]
    README.write_text(text)


if __name__ == "__main__":
    main()
