"""benchmarks/mlperf_published.py reads MLPerf result logs as the submitters wrote them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import mlperf_published as published


def _log(
    path: Path,
    batch: int,
    throughput: float | None,
    start: int,
    stop: int,
    status: str = "success",
) -> None:
    events = [
        ("global_batch_size", batch, {}),
        ("run_start", None, {}),
        ("run_stop", None, {"status": status}),
    ]
    times = [start, start, stop]
    if throughput is not None:
        events.append(("tracked_stats", {"throughput": throughput}, {}))
        times.append(stop)
    lines = ["unrelated output"]
    for (key, value, metadata), time_ms in zip(events, times, strict=True):
        event = {"time_ms": time_ms, "key": key, "value": value, "metadata": metadata}
        lines.append(":::MLLOG " + json.dumps(event))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _system(root: Path, submitter: str, name: str, nodes: int, chip: str) -> None:
    path = root / submitter / "systems" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    system = {
        "number_of_nodes": str(nodes),
        "accelerators_per_node": "8",
        "accelerator_model_name": chip,
    }
    path.write_text(json.dumps(system))


def test_reads_each_systems_runs_and_skips_what_it_cannot_compare(tmp_path, capsys):
    folder = tmp_path / "Acme" / "results" / "box_n2" / "dlrm_dcnv2"
    _log(folder / "result_0.txt", 16384, 3e6, 0, 240_000)
    _log(folder / "result_1.txt", 16384, 5e6, 0, 120_000)
    _log(folder / "result_2.txt", 16384, None, 0, 60_000)  # no throughput: left out
    _log(folder / "result_3.txt", 16384, 9e9, 0, 60_000, status="aborted")  # left out
    _system(tmp_path, "Acme", "box_n2", 2, "NVIDIA H100-SXM5-80GB")
    _log(tmp_path / "Acme" / "results" / "orphan" / "dlrm_dcnv2" / "result_0.txt", 8, 1.0, 0, 1)

    (entry,) = published.read_results(tmp_path)
    assert (entry.system, entry.submitter, entry.gpus, entry.global_batch) == (
        "box_n2",
        "Acme",
        16,
        16384,
    )
    assert entry.samples_per_s == [3e6, 5e6] and entry.minutes == [4.0, 2.0]
    assert "orphan" in capsys.readouterr().out
    assert published.preset_of(entry.accelerator) == "h100_8x_ib400"
    assert published.preset_of("NVIDIA A100-SXM4-40GB") == "a100_8x_ib200"
    assert published.preset_of("NVIDIA A40") is None
    assert published.preset_of("NVIDIA H100-PCIe-80GB") is None  # no NVLink: not the preset


def test_rows_set_the_median_beside_the_prediction(tmp_path, monkeypatch):
    folder = tmp_path / "Acme" / "results" / "box_n2" / "dlrm_dcnv2"
    for i, rate in enumerate((3e6, 4e6, 9e6)):
        _log(folder / f"result_{i}.txt", 16384, rate, 0, 60_000)
    _system(tmp_path, "Acme", "box_n2", 2, "NVIDIA H100-SXM5-80GB")
    asked = []

    class Prediction:
        def __init__(self, rate):
            self.samples_per_s = rate

    def projection(recipe, batch, cluster, worlds, sync_every, precision):
        asked.append((recipe, batch, cluster.ranks_per_node, worlds, sync_every, precision))
        yield worlds[0], 1, Prediction(2e6)
        yield worlds[0], 2, Prediction(8e6)

    monkeypatch.setattr(published, "projection", projection)
    env = {"versions": "v", "commit": "c", "timestamp": "t"}
    (row,) = published.rows(published.read_results(tmp_path), "src@1", 100, env)
    line = dict(zip(published.COLUMNS, row, strict=True))
    assert asked == [(published.RECIPE, 1024, 8, [16], 100, "bf16")]  # as MLPerf trains
    assert line["published_samples_per_s"] == 4e6 and line["published_minutes"] == 1.0
    assert line["predicted_samples_per_s"] == 2e6 and line["predicted_ratio"] == 0.5
    assert line["predicted_2d_samples_per_s"] == 8e6
    assert line["source"] == "src@1 Acme/results/box_n2/dlrm_dcnv2"


def test_without_a_checkout_it_says_how_to_get_one(capsys, monkeypatch):
    monkeypatch.delenv("MLPERF_RESULTS", raising=False)
    published.main([])
    assert "git clone https://github.com/mlcommons/training_results_v3.0" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a directory"):
        published.main(["--results", "/nonexistent/results"])
