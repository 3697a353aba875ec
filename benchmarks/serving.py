"""Benchmark ``recsys serve`` against offline ``recsys predict`` on the default recipe's model.

Trains ``configs/dlrm_synthetic.toml`` for a few steps (the model's shape is what costs time,
not its quality), exports it, and measures on the same test rows:

- ``predict``: ``recsys.serve.export.predict`` over a parquet file of the rows (one call, batch
  8192): rows/s, the offline rate a served model is compared with;
- ``serve_v2`` at concurrency 1, 8 and 64: closed-loop clients (threads, one keep-alive HTTP
  connection each) sending one-row Open Inference Protocol requests to ``recsys serve`` (a
  subprocess, default batching: 64 requests, 2 ms) for ``--seconds``: p50 / p99 latency,
  requests/s, and the mean rows per scored batch from the server's metrics.

The clients run on the same machine as the server and take CPU from it: on a 2-core machine the
numbers are a floor. Appends to ``benchmarks/results/serving.csv``.

Run: ``python -m benchmarks.serving [--seconds 10] [--steps 20] [--quick] [--export PT2]``
(``--export``: an export of the recipe's model, instead of training one).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from benchmarks._harness import append_csv, environment, load_note
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.loader import BatchLoader
from recsys.serve.export import export_model, load_program, predict
from recsys.train.trainer import train

TOPIC = "serving"
RECIPE = "configs/dlrm_synthetic.toml"
COLUMNS = (
    "case",
    "provider",
    "concurrency",
    "p50_ms",
    "p99_ms",
    "requests_per_s",
    "rows_per_s",
    "rows_per_batch",
    "device",
    "versions",
    "commit",
    "timestamp",
    "notes",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="load per concurrency")
    parser.add_argument("--steps", type=int, default=20, help="training steps before export")
    parser.add_argument("--rows", type=int, default=8192, help="test rows scored")
    parser.add_argument("--quick", action="store_true", help="2 s per level, 2048 rows")
    parser.add_argument(
        "--export", type=Path, default=None, help="an export of the recipe (skips training)"
    )
    parser.add_argument("--out-dir", type=Path, default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    seconds, num_rows = (2.0, 2048) if args.quick else (args.seconds, args.rows)
    with tempfile.TemporaryDirectory(prefix="recsys-bench-serving-") as work:
        work = Path(work)
        overrides = [
            f"--run.dir={work / 'run'}",
            f"--train.max_steps={args.steps}",
            "--train.progress_bar=false",
            "--run.device=cpu",
        ]
        config = load_config(RECIPE, overrides)
        if args.export is None:
            model = export_model(train(config).checkpoint, work / "model.pt2")
            trained = f"{args.steps} steps"
        else:
            model, trained = args.export, f"export {args.export.name}"
        dataset = build_dataset(config.data, config.run.seed)
        batch = next(iter(BatchLoader(dataset, "test", num_rows)))
        rows = work / "rows.parquet"
        samples = _write_rows(batch, dataset.spec, rows)
        env = environment(torch.device("cpu"))
        case = f"dlrm_synthetic ({trained}), {len(samples)} test rows"
        lines = _offline(model, rows, batch, work, case, env)
        lines += _online(model, samples, seconds, case, env)
    path = append_csv(TOPIC, COLUMNS, lines, args.out_dir)
    for line in lines:
        print(dict(zip(COLUMNS[:8], line[:8], strict=True)))
    print(f"appended {len(lines)} rows to {path}")


def _write_rows(batch, spec, path: Path) -> list[dict]:
    """The batch as predict's parquet (multi-hot features as list columns) and as one-row v2
    requests (lengths [1, F], values sample-major)."""
    per_key = batch.sparse.to_dict()
    dense = batch.dense.numpy()
    columns = {name: dense[:, i] for i, name in enumerate(spec.dense_names)}
    lengths, ids = {}, {}
    for key in spec.sparse_names:
        lengths[key] = per_key[key].lengths().long().numpy()
        values = per_key[key].values().numpy()
        offsets = np.concatenate([[0], np.cumsum(lengths[key])])
        ids[key] = [values[offsets[b] : offsets[b + 1]] for b in range(len(dense))]
        if (lengths[key] == 1).all():
            columns[key] = values
        else:
            columns[key] = pa.ListArray.from_arrays(offsets.astype(np.int32), values)
    pq.write_table(pa.table(columns), path)
    num_sparse = len(spec.sparse_names)
    requests = []
    for b in range(len(dense)):
        bag_lengths = [int(lengths[key][b]) for key in spec.sparse_names]
        values = [int(v) for key in spec.sparse_names for v in ids[key][b]]
        requests.append(
            {
                "inputs": [
                    _tensor("dense", "FP32", [1, dense.shape[1]], dense[b].tolist()),
                    _tensor("lengths", "INT64", [1, num_sparse], bag_lengths),
                    _tensor("values", "INT64", [len(values)], values),
                ]
            }
        )
    return requests


def _tensor(name: str, datatype: str, shape: list[int], data: list) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def _offline(model: Path, rows: Path, batch, work: Path, case: str, env: dict) -> list:
    """``predict`` end to end (load, read, score, write: what a user's call costs), and the
    loaded program's forward over all the rows in one batch (the offline scoring rate)."""
    predict(model, rows, work / "warm.parquet")  # warm the file cache
    start = time.perf_counter()
    report = predict(model, rows, work / "scores.parquet", overwrite=True)
    seconds = time.perf_counter() - start
    module, _, _ = load_program(model)
    values, lengths = batch.sparse.values(), batch.sparse.lengths().long()
    timings = []
    with torch.no_grad():
        for _ in range(6):
            start = time.perf_counter()
            module(batch.dense, values, lengths)
            timings.append(time.perf_counter() - start)
    forward = sorted(timings[1:])[len(timings[1:]) // 2]
    note = load_note()
    return [
        [
            case,
            "predict",
            0,
            "",
            "",
            "",
            f"{report.rows / seconds:.0f}",
            report.rows,
            *_env(env),
            f"recsys.serve.export.predict, one call incl. loading the program; {note}",
        ],
        [
            case,
            "predict_forward",
            0,
            f"{1000 * forward:.2f}",
            "",
            "",
            f"{len(batch) / forward:.0f}",
            len(batch),
            *_env(env),
            f"the loaded program on all rows in one batch, p50 of 5; {note}",
        ],
    ]


def _online(model: Path, samples: list[dict], seconds: float, case: str, env: dict) -> list:
    ports = _free_ports(3)
    command = [
        sys.executable,
        "-m",
        "recsys",
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(ports[0]),
        "--grpc-port",
        str(ports[1]),
        "--metrics-port",
        str(ports[2]),
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    lines = []
    try:
        _wait_ready(ports[0], server)
        bodies = [json.dumps(s) for s in samples]
        _load(ports[0], bodies, 1, 1.0)  # warm up
        for concurrency in (1, 8, 64):
            batches_before = _metrics(ports[2])
            latencies, wall = _load(ports[0], bodies, concurrency, seconds)
            batches_after = _metrics(ports[2])
            num = len(latencies)
            scored = batches_after[1] - batches_before[1]
            per_batch = scored / max(batches_after[0] - batches_before[0], 1)
            latencies.sort()
            lines.append(
                [
                    case,
                    "serve_v2",
                    concurrency,
                    f"{1000 * latencies[num // 2]:.2f}",
                    f"{1000 * latencies[int(num * 0.99)]:.2f}",
                    f"{num / wall:.1f}",
                    f"{num / wall:.1f}",
                    f"{per_batch:.2f}",
                    *_env(env),
                    "one-row requests, max batch 64 / 2 ms, clients on the same CPU; "
                    + load_note(),
                ]
            )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    return lines


def _env(env: dict) -> list:
    return [env["device"], env["versions"], env["commit"], env["timestamp"]]


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _wait_ready(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"recsys serve exited with status {server.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/v2/health/ready")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("recsys serve did not turn ready in 300 s")


def _load(port: int, bodies: list[str], concurrency: int, seconds: float):
    """Closed-loop load: ``concurrency`` clients until ``seconds`` pass; (latencies, wall)."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(offset: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine, i = [], offset
        headers = {"Content-Type": "application/json"}
        while time.monotonic() < stop:
            start = time.perf_counter()
            connection.request("POST", "/v2/models/recsys/infer", bodies[i % len(bodies)], headers)
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"status {response.status}")
            mine.append(time.perf_counter() - start)
            i += concurrency
        with lock:
            latencies.extend(mine)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, time.perf_counter() - start


def _metrics(port: int) -> tuple[float, float]:
    """(scored batches, rows scored) so far, from the server's metrics."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return float(values["recsys_serve_batch_rows_count"]), float(
        values["recsys_serve_batch_rows_sum"]
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
