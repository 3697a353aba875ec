"""Published MLPerf Training DLRM-DCNv2 results beside ``recsys plan``'s prediction of the same
model on the same GPUs at the same batch.

Reads a checkout of an MLCommons training results repository (``--results DIR``, e.g.
``git clone https://github.com/mlcommons/training_results_v3.0``): every
``<submitter>/results/<system>/dlrm_dcnv2/result_*.txt`` with its
``<submitter>/systems/<system>.json``. Per system, from the submitters' own MLPerf logs:
nodes and accelerators per node (the system file), the accelerator, the global batch
(``global_batch_size``), each run's throughput (``tracked_stats``, samples/s, logged by the
submitter's code at the end of the run) and time to train (``run_stop`` - ``run_start``); the
median over the system's runs.

Beside it, :func:`benchmarks.scale.projection`: ``configs/dlrm_dcnv2_mlperf.toml`` (the MLPerf
reference's tables and layers) at the same GPU count and samples per GPU (global batch / GPUs)
on the preset of its accelerator (H100: ``h100_8x_ib400``, A100: ``a100_8x_ib200``; the
system's accelerators per node as ranks per node), flat (as the published runs shard) and,
past one node, 2D with one group per node synced every ``--sync-every`` steps. The published
runs are HugeCTR's (NVIDIA's and its partners' submissions), not recsys: the rows say how far
the model's prediction is from what a tuned framework reached on that hardware, nothing more.

Rows (``benchmarks/results/mlperf_published.csv``): one per system, ``source`` naming the
repository, commit and folder the numbers were read from.

Run: ``python -m benchmarks.mlperf_published --results DIR [--source owner/repo@commit]``
(``--results`` defaults to ``$MLPERF_RESULTS``; with neither, no rows and a line saying how to
get a checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._harness import add_common_args, append_csv, environment, format_table
from benchmarks.scale import projection

TOPIC = "mlperf_published"
COLUMNS = (
    *("system", "submitter", "accelerator", "gpus", "nodes", "global_batch", "runs"),
    *("published_samples_per_s", "published_minutes", "hardware", "predicted_samples_per_s"),
    *("predicted_ratio", "predicted_2d_samples_per_s", "source", "versions", "commit"),
    *("timestamp", "notes"),
)
RECIPE = "configs/dlrm_dcnv2_mlperf.toml"
PRECISION = "bf16"  # the submissions train in mixed precision: the model at the bf16 rate
PRESETS = (("H100-SXM", "h100_8x_ib400"), ("A100-SXM", "a100_8x_ib200"))
LOG_PREFIX = ":::MLLOG "


@dataclass(frozen=True)
class Published:
    """One system's DLRM-DCNv2 submission, from its MLPerf logs and system file."""

    system: str
    submitter: str
    accelerator: str
    nodes: int
    per_node: int
    global_batch: int
    samples_per_s: list[float]
    minutes: list[float]
    folder: Path

    @property
    def gpus(self) -> int:
        return self.nodes * self.per_node


def read_log(path: Path) -> dict:
    """A result file's global batch, throughput and minutes to train (None when absent; the
    minutes only for a run whose ``run_stop`` says ``success``)."""
    out: dict = {"global_batch": None, "samples_per_s": None, "minutes": None}
    start = stop = None
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith(LOG_PREFIX):
            continue
        event = json.loads(line[len(LOG_PREFIX) :])
        key, value = event["key"], event["value"]
        if key == "global_batch_size":
            out["global_batch"] = int(value)
        elif key == "tracked_stats" and isinstance(value, dict) and "throughput" in value:
            out["samples_per_s"] = float(value["throughput"])
        elif key == "run_start":
            start = event["time_ms"]
        elif key == "run_stop" and event.get("metadata", {}).get("status") == "success":
            stop = event["time_ms"]
    if start is not None and stop is not None:
        out["minutes"] = (stop - start) / 60e3
    return out


def read_results(root: Path) -> list[Published]:
    """Every DLRM-DCNv2 system under ``root`` with a system file and at least one run that
    succeeded (``run_stop`` with status ``success``) and logged its throughput; its other runs
    are left out."""
    systems = []
    for folder in sorted(root.glob("*/results/*/dlrm_dcnv2")):
        submitter, name = folder.parts[-4], folder.parts[-2]
        system_file = root / submitter / "systems" / f"{name}.json"
        if not system_file.is_file():
            print(f"skipped {folder.relative_to(root)}: no {system_file.relative_to(root)}")
            continue
        system = json.loads(system_file.read_text())
        logs = [read_log(path) for path in sorted(folder.glob("result_*.txt"))]
        logs = [log for log in logs if log["minutes"] is not None]  # the successful runs
        logs = [log for log in logs if log["samples_per_s"] and log["global_batch"]]
        if not logs:
            print(f"skipped {folder.relative_to(root)}: no successful run logged tracked_stats")
            continue
        if int(system["number_of_nodes"]) < 1 or int(system["accelerators_per_node"]) < 1:
            print(f"skipped {folder.relative_to(root)}: no accelerators in {system_file.name}")
            continue
        systems.append(
            Published(
                name,
                submitter,
                system["accelerator_model_name"],
                int(system["number_of_nodes"]),
                int(system["accelerators_per_node"]),
                logs[0]["global_batch"],
                [log["samples_per_s"] for log in logs],
                [log["minutes"] for log in logs],
                folder.relative_to(root),
            )
        )
    return systems


def preset_of(accelerator: str) -> str | None:
    """The hardware preset of a system file's accelerator name (SXM parts only: the presets'
    NVLink figures), or None."""
    return next((preset for chip, preset in PRESETS if chip in accelerator), None)


def source_of(root: Path, given: str | None) -> str:
    """``--source``, else the checkout's origin and commit."""
    if given:
        return given
    git = ["git", "-C", str(root)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    origin = subprocess.run([*git, "remote", "get-url", "origin"], capture_output=True, text=True)
    if commit.returncode or origin.returncode:
        raise SystemExit(f"--results {root}: not a git checkout; name it with --source")
    return f"{origin.stdout.strip()}@{commit.stdout.strip()[:12]}"


def rows(systems: list[Published], source: str, sync_every: int, env: dict) -> list[list]:
    """One CSV line per system with a preset: its published figures beside the prediction."""
    from recsys.distributed.topology import topology

    lines = []
    for entry in systems:
        preset = preset_of(entry.accelerator)
        if preset is None:
            print(f"skipped {entry.system}: no preset for {entry.accelerator!r}")
            continue
        if entry.global_batch % entry.gpus:
            print(f"skipped {entry.system}: batch {entry.global_batch} over {entry.gpus} GPUs")
            continue
        cluster = topology(preset, ranks_per_node=entry.per_node)
        per_gpu = entry.global_batch // entry.gpus
        predicted = {
            replicas: prediction.samples_per_s
            for _, replicas, prediction in projection(
                RECIPE, per_gpu, cluster, [entry.gpus], sync_every, PRECISION
            )
        }
        published = statistics.median(entry.samples_per_s)
        minutes = statistics.median(entry.minutes)
        two_d = next((v for r, v in predicted.items() if r > 1), "")
        notes = (
            f"published: median of {len(entry.samples_per_s)} runs' tracked_stats throughput "
            f"(min {min(entry.samples_per_s):,.0f}, max {max(entry.samples_per_s):,.0f}), "
            f"{per_gpu} samples per GPU; predicted: {RECIPE} in {PRECISION} at {per_gpu}/GPU on "
            f"{preset} with "
            f"{entry.per_node} ranks per node, flat{'' if two_d == '' else ' and 2D'}"
            f"{f' synced every {sync_every} steps' if two_d != '' else ''}; "
            "a model beside a measurement of another framework (HugeCTR)"
        )
        lines.append([
            entry.system, entry.submitter, entry.accelerator, entry.gpus, entry.nodes,
            entry.global_batch, len(entry.samples_per_s), published, minutes, preset,
            predicted[1], predicted[1] / published, two_d, f"{source} {entry.folder}",
            env["versions"], env["commit"], env["timestamp"], notes,
        ])  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results",
        type=Path,
        default=os.environ.get("MLPERF_RESULTS") or None,
        help="a checkout of mlcommons/training_results_* (default: $MLPERF_RESULTS)",
    )
    parser.add_argument("--source", default=None, help="owner/repo@commit (default: from git)")
    parser.add_argument("--sync-every", type=int, default=100, help="2D's replica sync")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.results is None:
        print(
            "no rows: no results checkout given (git clone "
            "https://github.com/mlcommons/training_results_v3.0 and pass --results DIR)"
        )
        return
    if not args.results.is_dir():
        raise SystemExit(f"--results {args.results}: not a directory")
    systems = read_results(args.results)
    if not systems:
        raise SystemExit(f"--results {args.results}: no */results/*/dlrm_dcnv2 with a system file")
    env = environment(torch.device("cpu"))
    lines = rows(systems, source_of(args.results, args.source), args.sync_every, env)
    path = append_csv(TOPIC, COLUMNS, lines, args.out_dir)
    header = ["system", "GPUs", "batch", "published samples/s", "min", "predicted", "ratio", "2D"]
    table = [
        [r[0], r[3], r[5], f"{r[7]:,.0f}", f"{r[8]:.1f}",
         f"{r[10]:,.0f}", f"{r[11]:.2f}", f"{r[12]:,.0f}" if r[12] != "" else ""]
        for r in lines
    ]  # fmt: skip
    print(format_table(header, table))
    print(f"{len(lines)} rows appended to {path}")


if __name__ == "__main__":
    main()
