"""recsys serve: a server started on free local ports answers the Open Inference Protocol and
the JSON route with exactly ``recsys predict``'s scores, refuses bad requests with a 400 naming
the field while it stays up, merges concurrent requests, follows a run's deltas one atomic
version at a time (refusing a corrupt delta and one of another lineage), and drains on
SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.cli import main
from recsys.config import load_config
from recsys.serve.export import export_model, load_program, predict
from recsys.serve.exported_deltas import exported_tables
from recsys.serve.online.requests import rows_from_json
from recsys.serve.online.served import ServedModel
from recsys.train.trainer import train

RUN = [
    "--data.synthetic.cardinalities=[50,300,2000]",
    "--data.synthetic.bag_sizes=[1,3,1]",
    "--data.synthetic.num_dense=3",
    "--data.synthetic.num_train_samples=1536",
    "--data.synthetic.num_valid_samples=256",
    "--data.synthetic.num_test_samples=256",
    "--data.synthetic.id_encoding=raw",
    "--train.batch_size=128",
    "--train.progress_bar=false",
    "--model.embedding_dim=8",
    "--model.dense_arch_layer_sizes=[16,8]",
    "--model.over_arch_layer_sizes=[16,1]",
    '--checkpoint.freeze=["dense_arch", "over_arch"]',  # deltas carry the tables only
    "--model.dynamic.initial_capacity=32",
    "--model.dynamic.bucket_size=16",
    "--model.dynamic.max_capacity=256",
    "--checkpoint.every_steps=4",
    "--checkpoint.delta_every_steps=2",
    "--checkpoint.keep=0",
    "--run.device=cpu",
]
NUM_ROWS = 200


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, base export of step 4, the rows to score as a parquet file)."""
    run_dir = tmp_path_factory.mktemp("serve") / "run"
    result = train(load_config(None, [*RUN, f"--run.dir={run_dir}"]))
    assert result.steps == 12
    base = export_model(run_dir / "checkpoints" / "step_00000004", run_dir.parent / "base.pt2")
    rows = run_dir.parent / "rows.parquet"
    _write_rows(base, rows)
    return run_dir, base, rows


def _write_rows(export: Path, path: Path) -> None:
    """NUM_ROWS samples: ids the tables hold and ids they never saw (the zero row), empty bags
    of the multi-hot cat_1."""
    module, spec, info = load_program(export)
    known = {name: keys.numpy() for name, (keys, _) in exported_tables(module, info).items()}
    rng = np.random.default_rng(0)
    columns = {n: rng.standard_normal(NUM_ROWS).astype(np.float32) for n in spec.dense_names}
    for f, name in enumerate(spec.sparse_names):
        keys = known[f"t_{name}"]
        ids = np.where(
            rng.random(NUM_ROWS * 3) < 0.8,
            rng.choice(keys, NUM_ROWS * 3),
            rng.integers(10**12, 10**13, NUM_ROWS * 3),
        )
        if f == 1:
            lengths = rng.integers(0, 4, NUM_ROWS)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            columns[name] = pa.ListArray.from_arrays(offsets, ids[: offsets[-1]])
        else:
            columns[name] = ids[:NUM_ROWS]
    pq.write_table(pa.table(columns), path)


def _samples(rows: Path) -> list[dict]:
    """The rows as the JSON route takes them."""
    table = pq.read_table(rows).to_pylist()
    return [
        {
            "dense": {k: v for k, v in row.items() if k.startswith("int_")},
            "sparse": {k: v for k, v in row.items() if k.startswith("cat_")},
        }
        for row in table
    ]


def _tensors(samples: list[dict]) -> dict:
    """The samples as a v2 infer request (dense [B, N], lengths [B, F], values sample-major)."""
    dense, lengths, values = [], [], []
    for sample in samples:
        dense += list(sample["dense"].values())
        for bag in sample["sparse"].values():
            bag = bag if isinstance(bag, list) else [bag]
            lengths.append(len(bag))
            values += bag
    b = len(samples)
    return {
        "inputs": [
            {"name": "dense", "datatype": "FP32", "shape": [b, 3], "data": dense},
            {"name": "lengths", "datatype": "INT64", "shape": [b, 3], "data": lengths},
            {"name": "values", "datatype": "INT64", "shape": [len(values)], "data": values},
        ]
    }


def _offline(base: Path, rows: Path, deltas: Path | None, out: Path) -> np.ndarray:
    """``recsys predict``'s scores of the rows."""
    predict(base, rows, out, deltas=deltas, overwrite=True)
    return pq.read_table(out).column("score_click").to_numpy()


class Server:
    """``recsys serve`` in a subprocess on free local ports."""

    def __init__(self, tmp: Path, *args: str, poll_seconds: float = 0.2) -> None:
        self.port, grpc, metrics = _free_ports(3)
        self.grpc_port, self.metrics_port = grpc, metrics
        self.log = tmp / f"serve-{self.port}.log"
        command = [sys.executable, "-m", "recsys", "serve", *args, "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--grpc-port", str(grpc)]
        command += ["--metrics-port", str(metrics), "--poll-seconds", str(poll_seconds)]
        self.process = subprocess.Popen(
            command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        deadline = time.monotonic() + 120
        while self.get("/v2/health/ready")[0] != 200:
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def request(self, method: str, path: str, body=None, port: int | None = None):
        connection = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=60)
        try:
            data = None if body is None else body if isinstance(body, str) else json.dumps(body)
            headers = {"Content-Type": "application/json"}
            connection.request(method, path, data, headers)
            response = connection.getresponse()
            text = response.read().decode()
            return response.status, text
        except OSError as error:
            return None, str(error)
        finally:
            connection.close()

    def get(self, path: str):
        return self.request("GET", path)

    def post(self, path: str, body) -> tuple[int, dict]:
        status, text = self.request("POST", path, body)
        return status, json.loads(text)

    def metrics(self) -> str:
        return self.request("GET", "/metrics", port=self.metrics_port)[1]

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    """One server for the module (a start costs ~15 s of imports and loading): the base export
    of step 4, watching a deltas directory that holds the run's deltas up to step 4. The tests
    run in file order; the last one stops it."""
    run_dir, base, _ = run
    tmp = tmp_path_factory.mktemp("server")
    watched = tmp / "deltas"
    watched.mkdir()
    for step in (2, 4):  # deltas up to the base's step: nothing to apply
        _copy_delta(run_dir, step, watched)
    server = Server(tmp, "--model", str(base), "--deltas", str(watched), "--max-ids", "4")
    server.watched = watched
    yield server
    if server.process.poll() is None:
        server.process.kill()


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _v2_scores(server: Server, samples: list[dict]) -> tuple[np.ndarray, int]:
    status, body = server.post("/v2/models/recsys/infer", _tensors(samples))
    assert status == 200, body
    (output,) = body["outputs"]
    assert output["shape"] == [len(samples), 1]
    return np.asarray(output["data"], np.float32), body["parameters"]["step"]


def _json_scores(server: Server, samples) -> tuple[np.ndarray, int]:
    status, body = server.post("/predict", samples)
    assert status == 200, body
    return np.asarray(body["scores"]["click"], np.float32), body["step"]


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[1])


def _copy_delta(run_dir: Path, step: int, watched: Path) -> Path:
    """A delta of the run appearing in ``watched`` as the trainer writes one (renamed into
    place)."""
    name = f"step_{step:08d}"
    shutil.copytree(run_dir / "deltas" / name, watched / f".tmp-{name}")
    (watched / f".tmp-{name}").rename(watched / name)
    return watched / name


def _wait_for_step(server: Server, samples, step: int) -> None:
    deadline = time.monotonic() + 30
    while _json_scores(server, samples[:1])[1] != step:
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.1)


def test_scores_equal_predicts_and_requests_merge(run, server, tmp_path):
    _, base, rows = run
    samples = _samples(rows)
    status, text = server.get("/v2/models/recsys")
    metadata = json.loads(text)
    assert status == 200 and metadata["inputs"][0]["shape"] == [-1, 3]
    assert metadata["parameters"]["sparse_names"] == ["cat_0", "cat_1", "cat_2"]
    assert metadata["parameters"]["step"] == 4

    # One request of every row: predict's scores (one batch of the same rows), bitwise.
    expected = _offline(base, rows, None, tmp_path / "base.parquet")
    scores, step = _v2_scores(server, samples)
    assert step == 4 and np.array_equal(scores, expected)
    scores, step = _json_scores(server, samples)
    assert step == 4 and np.array_equal(scores, expected)

    # Concurrent one-row requests merge into batches; each row's score within 1e-6 (another
    # batch size may sum the MLP's products in another order).
    before = _metric(server.metrics(), "recsys_serve_batch_rows_count")
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda s: _json_scores(server, s), samples))
    np.testing.assert_allclose([r[0][0] for r in results], expected, rtol=0, atol=1e-6)
    metrics = server.metrics()
    assert _metric(metrics, "recsys_serve_batch_rows_count") - before < len(samples)
    assert _metric(metrics, "recsys_serve_step") == 4


def test_deltas_apply_atomically_and_bad_ones_are_refused(run, server, tmp_path):
    run_dir, base, rows = run
    samples = _samples(rows)
    watched = server.watched
    # Deltas appear: the served step advances, scores are predict --deltas's at that step.
    for step in (6, 8):
        _copy_delta(run_dir, step, watched)
    _wait_for_step(server, samples, 8)
    expected_8 = _offline(base, rows, watched, tmp_path / "d8.parquet")
    assert not np.array_equal(expected_8, _offline(base, rows, None, tmp_path / "b.parquet"))
    scores, step = _v2_scores(server, samples)
    assert step == 8 and np.array_equal(scores, expected_8)

    # A corrupt delta is refused; serving stays at step 8.
    corrupt = _copy_delta(run_dir, 10, watched)
    part = sorted(corrupt.glob("*.rows.parquet"))[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    _wait_for_log(server, "corrupt")
    scores, step = _v2_scores(server, samples)
    assert step == 8 and np.array_equal(scores, expected_8)
    assert _metric(server.metrics(), "recsys_serve_deltas_refused") == 1

    # Replaced by a delta of another run: refused too, naming it; still step 8.
    shutil.rmtree(corrupt)
    other = _copy_delta(run_dir, 10, watched)
    manifest = json.loads((other / "delta.json").read_text())
    manifest["lineage"]["run_id"] = "another-run"
    (other / "delta.json").write_text(json.dumps(manifest))
    _wait_for_log(server, "run another-run")
    scores, step = _v2_scores(server, samples)
    assert step == 8 and np.array_equal(scores, expected_8)


def _wait_for_log(server: Server, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in server.log.read_text():
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.1)


def test_bad_requests_are_400_naming_the_field(run, server):
    _, _, rows = run
    sample = _samples(rows)[0]

    def json_error(body) -> str:
        status, answer = server.post("/predict", body)
        assert status == 400, answer
        return answer["error"]

    def v2_error(change) -> str:
        request = _tensors([sample, sample])
        change(request["inputs"])
        status, answer = server.post("/v2/models/recsys/infer", request)
        assert status == 400, answer
        return answer["error"]

    missing = {"dense": {"int_0": 1.0, "int_1": 2.0}, "sparse": sample["sparse"]}
    assert "dense feature 'int_2' is missing" in json_error(missing)
    nan = {"dense": {**sample["dense"], "int_1": float("nan")}, "sparse": sample["sparse"]}
    assert "dense feature 'int_1' is nan" in json_error(json.dumps(nan))
    text = {"dense": {**sample["dense"], "int_0": "1.5"}, "sparse": sample["sparse"]}
    assert "dense feature 'int_0' is '1.5'; expected a number" in json_error(text)
    many = {"dense": sample["dense"], "sparse": {**sample["sparse"], "cat_1": [1] * 5}}
    assert "sparse feature 'cat_1' has 5 ids; at most 4" in json_error(many)
    float_id = {"dense": sample["dense"], "sparse": {**sample["sparse"], "cat_0": 2.5}}
    assert "sparse feature 'cat_0': id 2.5 is not an integer" in json_error(float_id)
    typo = {"dense": sample["dense"], "sparse": {**sample["sparse"], "cat_O": 1}}
    assert "unknown sparse feature 'cat_O'" in json_error(typo)
    reserved = {"dense": sample["dense"], "sparse": {**sample["sparse"], "cat_2": -(2**63)}}
    assert "sparse feature 'cat_2': id -9223372036854775808" in json_error(reserved)
    assert "not JSON" in json_error("{")

    def drop(inputs):
        inputs.pop(1)

    assert "input 'lengths' is missing" in v2_error(drop)
    assert "input 'values' has datatype FP32" in v2_error(
        lambda inputs: inputs[2].update(datatype="FP32")
    )
    assert "input 'dense' has shape [2, 2]" in v2_error(
        lambda inputs: inputs[0].update(shape=[2, 2], data=inputs[0]["data"][:4])
    )
    assert "input 'values' holds" in v2_error(
        lambda inputs: inputs[2].update(shape=[1], data=inputs[2]["data"][:1])
    )
    # The server stays up and scores the good request after the bad ones.
    assert _json_scores(server, sample)[0].shape == (1,)
    assert _metric(server.metrics(), 'recsys_serve_rejected_requests_total{route="json"}') == 8


def test_sigterm_lets_requests_in_flight_finish(run, server):
    _, _, rows = run
    samples = _samples(rows) * 20  # 4000 rows a request: long enough to be in flight
    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(_json_scores, server, samples) for _ in range(4)]
        time.sleep(0.3)
        assert server.stop() == 0
        for answer in answers:
            scores, _ = answer.result()
            assert scores.shape == (len(samples),)
    assert server.get("/v2/health/live")[0] is None  # gone
    assert server.log.read_text().count("gRPC server shutdown complete") == 1  # one stop


def test_every_batch_is_scored_by_one_version(run, tmp_path):
    """Batches scored while deltas are published each equal predict --deltas at the step they
    report: never a mix of two versions' tables."""
    run_dir, base, rows = run
    batch = rows_from_json(_samples(rows), ServedModel(base).spec, 256)
    expected = {}
    for step in (4, 8, 12):
        upto = tmp_path / f"upto_{step}"
        upto.mkdir()
        for delta in (d for d in (2, 4, 6, 8, 10, 12) if d <= step):
            _copy_delta(run_dir, delta, upto)
        expected[step] = _offline(base, rows, upto, tmp_path / f"{step}.parquet")
    watched = tmp_path / "deltas"
    watched.mkdir()
    served = ServedModel(base, deltas=watched)
    seen = []
    done = False

    def score_until_done():
        while not done:
            seen.append(served.score(batch.dense, batch.lengths, batch.values))

    with ThreadPoolExecutor(2) as pool:
        scorers = [pool.submit(score_until_done) for _ in range(2)]
        for steps in ((2, 4), (6, 8), (10, 12)):  # two deltas a version
            for step in steps:
                _copy_delta(run_dir, step, watched)
            served.refresh()
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while not any(step == 12 for _, step in seen) and time.monotonic() < deadline:
            time.sleep(0.01)
        done = True
        for scorer in scorers:
            scorer.result()
    assert served.step == 12 and {step for _, step in seen} >= {4, 12}, {s for _, s in seen}
    for scores, step in seen:
        assert np.array_equal(scores[:, 0], expected[step]), step


def test_a_checkpoint_serves_as_its_export(run):
    run_dir, base, rows = run
    from_export, from_checkpoint = (
        ServedModel(base),
        ServedModel(run_dir / "checkpoints" / "step_00000004"),
    )
    batch = rows_from_json(_samples(rows), from_export.spec, 256)
    got, step = from_checkpoint.score(batch.dense, batch.lengths, batch.values)
    expected, expected_step = from_export.score(batch.dense, batch.lengths, batch.values)
    assert step == expected_step == 4 and np.array_equal(got, expected)


def test_cli_errors_are_one_line(run, tmp_path, capsys):
    _, base, _ = run
    assert main(["serve", "--model", str(tmp_path / "none.pt2")]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["serve", "--model", str(base), "--max-batch-size", "0"]) == 2
    assert "--max-batch-size must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--model", str(base), "--deltas", str(tmp_path / "none")]) == 2
    assert f"deltas directory not found: '{tmp_path / 'none'}'" in capsys.readouterr().err
    assert main(["serve", "--model", str(base), "--deltas", str(tmp_path)]) == 2
    assert "is not a deltas directory" in capsys.readouterr().err
