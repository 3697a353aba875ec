"""Benchmark ``recsys serve`` against offline ``recsys predict`` on the default recipe's model.

Trains ``configs/dlrm_synthetic.toml`` for a few steps (the model's shape is what costs time,
not its quality), exports it, and measures on the same test rows:

- ``predict``: ``recsys.serve.export.predict`` over a parquet file of the rows (one call, batch
  8192): rows/s, the offline rate a served model is compared with;
- ``serve_v2`` at concurrency 1, 8 and 64: closed-loop clients (threads, one keep-alive HTTP
  connection each) sending one-row Open Inference Protocol requests in JSON to ``recsys serve``
  (a subprocess, its default batching) for ``--seconds``: p50 / p99 latency,
  requests/s, and the mean rows per scored batch from the server's metrics;
- ``serve_v2_binary`` (the same requests in the binary tensor data extension, binary outputs,
  as tritonclient sends them) and ``serve_grpc`` (the protocol's gRPC service) at 1, 8 and 64;
- ``serve_v2_64rows`` / ``serve_v2_binary_64rows``: 64-row requests in JSON / the binary
  extension at concurrency 8 and 32 (rows/s against ``predict_forward``'s, and against the
  program's rate measured again right after each load, in ``notes``);
- ``--compile aoti`` rows (provider ``... (aoti)``): the binary cases again against ``recsys serve
  --compile aoti`` (the export compiled by AOTInductor, :mod:`recsys.serve.compiled_program`,
  in a cache of the run's own, so the compile is timed), the 64-row ones against the compiled
  program's own rate; and ``program_forward`` / ``program_forward (aoti)``: the exported and the
  compiled program on batches of 64, 1,024 and all rows, in this process;
- with ``--baseline DIR`` (a checkout of an earlier recsys, e.g. a ``git worktree`` of the
  commit before a change), the same JSON cases against that checkout's ``recsys serve`` of
  that checkout's own export of the checkpoint, in the same run with the same load generator
  (provider ``... (baseline <commit>)``).

Each served row's notes carry the server's mean time per request phase (decode, validate,
queue, score, encode; ``recsys_serve_request_phase_seconds``) where the server reports it.

The clients run on the same machine as the server and take CPU from it: on a 2-core machine the
numbers are a floor. Appends to ``benchmarks/results/serving.csv``.

Run: ``python -m benchmarks.serving [--seconds 10] [--steps 20] [--quick] [--export PT2]
[--baseline DIR] [--no-compile]`` (``--export``: an export of the recipe's model, instead of
training one).
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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from benchmarks._harness import append_csv, environment, load_note
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.batch import Batch
from recsys.data.loader import BatchLoader
from recsys.serve.compiled_program import compiled_program
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
    parser.add_argument(
        "--baseline", type=Path, default=None, help="a checkout whose recsys serve runs beside"
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="no rows of recsys serve --compile aoti"
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
        checkpoint = None
        if args.export is None:
            checkpoint = train(config).checkpoint
            model = export_model(checkpoint, work / "model.pt2")
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
        module = load_program(model)[0]

        def program_rate() -> float:
            return len(batch) / _forward_seconds(module, batch, repeats=10)

        lines += _online(model, samples, seconds, case, env, program_rate)
        if not args.no_compile:
            # A cache of this run's own (the server inherits it): the compile is timed.
            os.environ["RECSYS_CACHE_DIR"] = str(work / "cache")
            start = time.perf_counter()
            compiled = compiled_program(model)  # compiled here, so the server finds it cached
            compile_s = time.perf_counter() - start
            sizes = [
                next(iter(BatchLoader(dataset, "test", n))) for n in sorted({64, 1024, len(batch)})
            ]
            lines += _program_lines(case, env, sizes, module, compiled, compile_s)

            def compiled_rate() -> float:
                return len(batch) / _forward_seconds(compiled, batch, repeats=10)

            lines += _online(model, samples, seconds, case, env, compiled_rate, compile="aoti")
        if args.baseline is not None:
            # The baseline serves its own export of the checkpoint (as its users had it).
            served = model if checkpoint is None else _export_with(args.baseline, checkpoint, work)
            lines += _online(served, samples, seconds, case, env, program_rate, args.baseline)
    path = append_csv(TOPIC, COLUMNS, lines, args.out_dir)
    for line in lines:
        print(dict(zip(COLUMNS[:8], line[:8], strict=True)))
    print(f"appended {len(lines)} rows to {path}")


def _export_with(tree: Path, checkpoint: Path, work: Path) -> Path:
    """``recsys export`` of ``checkpoint`` by the recsys checked out at ``tree``."""
    output = work / "baseline.pt2"
    command = [sys.executable, "-m", "recsys", "export", "--checkpoint", str(checkpoint)]
    command += ["--output", str(output)]
    environ = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(command, env=environ, cwd=tree, check=True, capture_output=True)
    return output


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
    forward = _forward_seconds(load_program(model)[0], batch)
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


def _program_lines(case, env, batches, exported, compiled, compile_s: float) -> list:
    """The exported program and its AOTInductor compilation on batches of each size, in this
    process (the torch threads of ``OMP_NUM_THREADS``), the two measured in turn per size:
    p50 of 20 calls after a warm-up."""
    lines, note = [], load_note()
    programs = (("program_forward", exported), ("program_forward (aoti)", compiled))
    for batch in batches:
        for provider, module in programs:
            seconds = _forward_seconds(module, batch, repeats=20)
            compiled_note = f"compiled in {compile_s:.0f} s (AOTInductor, this run's cache); "
            extra = compiled_note if module is compiled else ""
            lines.append([
                case, provider, 0, f"{1000 * seconds:.3f}", "", "",
                f"{len(batch) / seconds:.0f}", len(batch), *_env(env),
                f"{extra}one batch of {len(batch)} rows, p50 of 20 calls; threads="
                f"{torch.get_num_threads()}; {note}",
            ])  # fmt: skip
    return lines


def _online(
    model: Path,
    samples: list[dict],
    seconds: float,
    case: str,
    env: dict,
    program_rate: Callable[[], float],
    tree: Path | None = None,
    compile: str = "off",
) -> list:
    """The served cases (see the module docstring) against ``recsys serve`` of this checkout,
    or of ``tree`` (JSON cases only). After each multi-row load, ``program_rate()`` (the
    loaded program's rows/s on the whole test batch, in this process, the server idle) goes to
    the row's notes with the served rate's ratio to it: measured a second after the load, so
    what a shared machine's other jobs do over the minutes of the run does not sit between
    the served rate and the rate it is compared with. ``compile="aoti"``: the binary cases
    only, against ``recsys serve --compile aoti`` (``program_rate`` then the compiled
    program's)."""
    ports = _free_ports(3)
    command = [sys.executable, "-m", "recsys", "serve", "--model", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(ports[0]), "--grpc-port", str(ports[1])]
    command += ["--metrics-port", str(ports[2])]
    environ, suffix = dict(os.environ), ""
    if tree is not None:
        environ["PYTHONPATH"] = str(tree)
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
        suffix = f" (baseline {head})"
    if compile != "off":
        command += ["--compile", compile]
        suffix = f" ({compile})"
    server = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=environ, cwd=tree
    )
    json_bodies = [_json(s) for s in samples]
    everything = tree is None and compile == "off"
    cases = [("serve_v2", json_bodies, (1, 8, 64), 1)] if compile == "off" else []
    if tree is None:
        cases.append(("serve_v2_binary", [_binary(s) for s in samples], (1, 8, 64), 1))
    if everything:
        cases.append(("serve_grpc", [_grpc_request(s) for s in samples], (1, 8, 64), 1))
    if compile == "off":
        cases.append(("serve_v2_64rows", [_json(r) for r in _merged(samples, 64)], (8, 32), 64))
    if tree is None:
        cases.append(
            ("serve_v2_binary_64rows", [_binary(r) for r in _merged(samples, 64)], (8, 32), 64)
        )
    lines = []
    try:
        _wait_ready(ports[0], server)
        _load(ports[0], json_bodies, 1, 1.0)  # warm up
        for provider, bodies, levels, rows in cases:
            for concurrency in levels:
                before = _metrics(ports[2])
                if provider == "serve_grpc":
                    latencies, wall = _grpc_load(ports[1], bodies, concurrency, seconds)
                else:
                    latencies, wall = _load(ports[0], bodies, concurrency, seconds)
                after = _metrics(ports[2])
                line = _served_line(case, provider + suffix, concurrency, latencies, wall, rows,
                                    before, after, env)  # fmt: skip
                if rows > 1:
                    time.sleep(1.0)  # the server's worker threads back to sleep
                    rate = program_rate()
                    served = rows * len(latencies) / wall
                    ratio = f"{rate / served:.2f}x the served rate" if served else "none served"
                    program = "compiled program" if compile != "off" else "program"
                    line[-1] += (
                        f"; this checkout's {program} right after, server idle: {rate:.0f} rows/s "
                        f"on {len(samples)} rows, {ratio}"
                    )
                lines.append(line)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    return lines


def _forward_seconds(module: torch.nn.Module, batch: Batch, repeats: int = 5) -> float:
    """The median seconds of the loaded program's forward over the whole batch (after one
    warm-up call)."""
    values, lengths = batch.sparse.values(), batch.sparse.lengths().long()
    timings = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            module(batch.dense, values, lengths)
            timings.append(time.perf_counter() - start)
    return sorted(timings[1:])[len(timings[1:]) // 2]


def _served_line(case, provider, concurrency, latencies, wall, rows, before, after, env) -> list:
    num = len(latencies)
    per_batch = (after["rows"] - before["rows"]) / max(after["batches"] - before["batches"], 1)
    latencies = sorted(latencies)
    phases = [
        f"{phase} {1e6 * (after[f'{phase}_s'] - before[f'{phase}_s']) / count:.0f}"
        for phase in PHASES
        if (count := after[f"{phase}_n"] - before[f"{phase}_n"]) > 0
    ]
    split = f"server us/request: {', '.join(phases)}; " if phases else ""
    return [
        case,
        provider,
        concurrency,
        f"{1000 * latencies[num // 2]:.2f}",
        f"{1000 * latencies[int(num * 0.99)]:.2f}",
        f"{num / wall:.1f}",
        f"{rows * num / wall:.1f}",
        f"{per_batch:.2f}",
        *_env(env),
        f"{rows}-row requests, the server's default batching, clients on the same CPU; {split}"
        + load_note(),
    ]


PHASES = ("decode", "validate", "queue", "score", "encode")


def _binary(request: dict) -> tuple[bytes, dict]:
    """A JSON v2 request as the binary tensor data extension (binary outputs asked for)."""
    kinds = {"FP32": "<f4", "INT64": "<i8"}
    described, raw = [], []
    for given in request["inputs"]:
        data = np.asarray(given["data"], kinds[given["datatype"]]).tobytes()
        raw.append(data)
        fields = {k: given[k] for k in ("name", "datatype", "shape")}
        described.append(fields | {"parameters": {"binary_data_size": len(data)}})
    head = json.dumps({"inputs": described, "parameters": {"binary_data_output": True}}).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }
    return head + b"".join(raw), headers


def _merged(samples: list[dict], size: int) -> list[dict]:
    """Requests of ``size`` rows each, from the one-row requests."""
    requests = []
    for start in range(0, len(samples) - size + 1, size):
        group = [s["inputs"] for s in samples[start : start + size]]
        merged = []
        for i, name in enumerate(("dense", "lengths", "values")):
            data = [x for inputs in group for x in inputs[i]["data"]]
            shape = [len(data)] if name == "values" else [size, group[0][i]["shape"][1]]
            merged.append(_tensor(name, group[0][i]["datatype"], shape, data))
        requests.append({"inputs": merged})
    return requests


def _json(request: dict) -> tuple[bytes, dict]:
    return json.dumps(request).encode(), {"Content-Type": "application/json"}


def _grpc_request(request: dict):
    from mlserver.grpc import dataplane_pb2 as pb

    tensors = []
    for given in request["inputs"]:
        contents = (
            pb.InferTensorContents(fp32_contents=given["data"])
            if given["datatype"] == "FP32"
            else pb.InferTensorContents(int64_contents=given["data"])
        )
        tensors.append(
            pb.ModelInferRequest.InferInputTensor(
                name=given["name"], datatype=given["datatype"], shape=given["shape"],
                contents=contents,
            )
        )  # fmt: skip
    return pb.ModelInferRequest(model_name="recsys", inputs=tensors)


def _grpc_load(port: int, requests: list, concurrency: int, seconds: float):
    """``_load`` over the protocol's gRPC service: one channel per client."""
    import grpc
    from mlserver.grpc import dataplane_pb2_grpc

    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(offset: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = dataplane_pb2_grpc.GRPCInferenceServiceStub(channel)
            mine, i = [], offset
            while time.monotonic() < stop:
                start = time.perf_counter()
                stub.ModelInfer(requests[i % len(requests)], timeout=60)
                mine.append(time.perf_counter() - start)
                i += concurrency
        with lock:
            latencies.extend(mine)

    return _run_clients(client, concurrency, latencies)


def _run_clients(client, concurrency: int, latencies: list[float]):
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, time.perf_counter() - start


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


def _load(port: int, bodies: list[tuple[bytes, dict]], concurrency: int, seconds: float):
    """Closed-loop load: ``concurrency`` clients until ``seconds`` pass; (latencies, wall)."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(offset: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine, i = [], offset
        while time.monotonic() < stop:
            body, headers = bodies[i % len(bodies)]
            start = time.perf_counter()
            connection.request("POST", "/v2/models/recsys/infer", body, headers)
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"status {response.status}")
            mine.append(time.perf_counter() - start)
            i += concurrency
        with lock:
            latencies.extend(mine)

    return _run_clients(client, concurrency, latencies)


def _metrics(port: int) -> dict[str, float]:
    """Scored batches and rows so far, and per request phase its seconds and count, from the
    server's metrics (phases absent from a server that does not report them)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        values[name] = value
    out = {
        "batches": float(values["recsys_serve_batch_rows_count"]),
        "rows": float(values["recsys_serve_batch_rows_sum"]),
    }
    for phase in PHASES:
        key = f'recsys_serve_request_phase_seconds_{{}}{{{{phase="{phase}"}}}}'
        out[f"{phase}_s"] = float(values.get(key.format("sum"), 0))
        out[f"{phase}_n"] = float(values.get(key.format("count"), 0))
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
