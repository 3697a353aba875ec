"""`recsys serve` for any KServe v2 client: the official Triton client with its default settings
(HTTP with the binary tensor data extension, and gRPC), in a process of its own that imports no
recsys, and plain JSON, score as `recsys predict` bitwise; bad inputs are refused over both
transports with a message naming the input while serving goes on; start-up clashes are one
line before anything loads."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys.cli import main
from recsys.serve.export import predict
from tests.serve import test_server
from tests.serve.test_server import (  # noqa: F401
    Server,
    _copy_delta,
    _free_ports,
    _json_scores,
    _offline,
    _samples,
    _wait_for_step,
    _write_rows,
    run,
)

CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

http_port, grpc_port, arrays, out = sys.argv[1:5]
given = dict(np.load(arrays))
datatypes = {"dense": "FP32", "lengths": "INT64", "values": "INT64"}
nan = given["dense"][:1].copy()
nan[0, 1] = np.nan
D, L, V = given["dense"][:1], np.ones((1, 3), np.int64), given["values"][:3]
bad_cases = {  # name -> (model, [(input, array), ...]); the datatype follows the array's
    "datatype": ("recsys", [("dense", D), ("lengths", L), ("values", V.astype(np.float32))]),
    "missing": ("recsys", [("dense", D), ("values", V)]),
    "twice": ("recsys", [("dense", D), ("lengths", L), ("values", V), ("values", V)]),
    "shape": ("recsys", [("dense", D[:, :2]), ("lengths", L), ("values", V)]),
    "nan": ("recsys", [("dense", nan), ("lengths", L), ("values", V)]),
    "sum": ("recsys", [("dense", D), ("lengths", L), ("values", V[:2])]),
    "zero_rows": ("recsys", [("dense", D[:0]), ("lengths", L[:0]), ("values", V[:0])]),
    "max_ids": ("recsys", [("dense", D), ("lengths", np.array([[1, 1, 300]])),
                           ("values", np.ones(302, np.int64))]),
    "model": ("other", [("dense", D), ("lengths", L), ("values", V)]),
}
results, errors = {}, {}
for name, client_module, port in (("http", httpclient, http_port), ("grpc", grpcclient, grpc_port)):
    client = client_module.InferenceServerClient(f"127.0.0.1:{port}")
    assert client.is_server_ready() and client.is_model_ready("recsys")
    inputs = []
    for key, datatype in datatypes.items():
        tensor = client_module.InferInput(key, list(given[key].shape), datatype)
        tensor.set_data_from_numpy(given[key])  # the default: binary data over HTTP
        inputs.append(tensor)
    results[name] = client.infer("recsys", inputs).as_numpy("scores")
    for case, (model, tensors) in bad_cases.items():
        sent = []
        for key, array in tensors:
            datatype = "FP32" if array.dtype.kind == "f" else "INT64"
            tensor = client_module.InferInput(key, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            sent.append(tensor)
        try:
            client.infer(model, sent)
            errors[f"{name} {case}"] = ["no error", ""]
        except InferenceServerException as error:
            errors[f"{name} {case}"] = [str(error.status()), error.message()]
    results[f"{name}_after"] = client.infer("recsys", inputs).as_numpy("scores")
np.savez(out, **results)
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def served(run, tmp_path_factory):  # noqa: F811
    """(server of the run's base export, the 256 rows as arrays, recsys predict's scores)."""
    _, base, _ = run
    tmp = tmp_path_factory.mktemp("clients")
    rows, test_server.NUM_ROWS = tmp / "rows.parquet", 256
    try:
        _write_rows(base, rows)
    finally:
        test_server.NUM_ROWS = 200
    samples = _samples(rows)
    dense = np.asarray([list(s["dense"].values()) for s in samples], np.float32)
    bags = [[b if isinstance(b, list) else [b] for b in s["sparse"].values()] for s in samples]
    lengths = np.asarray([[len(b) for b in row] for row in bags], np.int64)
    values = np.asarray([i for row in bags for b in row for i in b], np.int64)
    assert (lengths == 0).any()  # empty bags among them
    arrays = tmp / "rows.npz"
    np.savez(arrays, dense=dense, lengths=lengths, values=values)
    predict(base, rows, tmp / "scores.parquet", overwrite=True)
    expected = pq.read_table(tmp / "scores.parquet").column("score_click").to_numpy()
    server = Server(tmp, "--model", str(base), "--max-batch-size", "1")
    yield server, (dense, lengths, values), expected, arrays
    if server.process.poll() is None:
        server.process.kill()


def test_tritonclient_defaults_and_json_score_as_predict(served, tmp_path):
    server, (dense, lengths, values), expected, arrays = served
    grpc_port = server.grpc_port
    out = tmp_path / "client.npz"
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, str(server.port), str(grpc_port), str(arrays), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    scores = np.load(out)
    for transport in ("http", "grpc"):
        assert scores[transport].shape == (256, 1)
        assert np.array_equal(scores[transport][:, 0], expected), transport  # bitwise
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    messages = {
        "datatype": "input 'values' has datatype FP32; expected INT64",
        "missing": "input 'lengths' is missing",
        "twice": "input 'values' is given twice",
        "shape": "input 'dense' has shape [1, 2]",
        "nan": "input 'dense' row 0, feature 'int_1' is nan",
        "sum": "input 'values' holds 2 ids; input 'lengths' adds up to 3",
        "zero_rows": "input 'dense' has 0 rows",
        "max_ids": "is 300 (more than 256)",
        "model": "other",
    }
    for case, message in messages.items():  # the same refusal over both transports
        http_status, http_message = errors[f"http {case}"]
        grpc_status, grpc_message = errors[f"grpc {case}"]
        codes = (
            ("404", "StatusCode.NOT_FOUND")
            if case == "model"
            else ("400", "StatusCode.INVALID_ARGUMENT")
        )
        assert (http_status, grpc_status) == codes, (case, errors)
        assert message in http_message and message in grpc_message, (case, errors)
    for transport in ("http", "grpc"):  # serving went on
        assert np.array_equal(scores[f"{transport}_after"][:, 0], expected)

    given = {"dense": ("FP32", dense), "lengths": ("INT64", lengths), "values": ("INT64", values)}
    body = {
        "inputs": [
            {"name": k, "datatype": t, "shape": list(a.shape), "data": a.ravel().tolist()}
            for k, (t, a) in given.items()
        ]
    }
    status, answer = server.post("/v2/models/recsys/infer", body)
    assert status == 200, answer
    assert np.array_equal(np.asarray(answer["outputs"][0]["data"], np.float32), expected)
    status, metadata = server.get("/v2")
    assert status == 200 and "binary_tensor_data" in json.loads(metadata)["extensions"]


def _binary_request(server: Server, inputs, header_extra=None, tail: bytes = b""):
    """POST a binary-extension request: ``inputs`` of (name, datatype, shape, array)."""
    parts, described = [], []
    for name, datatype, shape, array in inputs:
        raw = array.tobytes()
        parts.append(raw)
        described.append(
            {"name": name, "datatype": datatype, "shape": shape,
             "parameters": {"binary_data_size": len(raw)}}
        )  # fmt: skip
    head = json.dumps({"inputs": described, **(header_extra or {})}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request(
            "POST",
            "/v2/models/recsys/infer",
            head + b"".join(parts) + tail,
            {"Inference-Header-Content-Length": str(len(head))},
        )
        response = connection.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, response.read()
    finally:
        connection.close()


def test_binary_outputs_on_request_and_bad_inputs_over_http(served):
    server, (dense, lengths, values), expected, _ = served
    good = [
        ("dense", "FP32", list(dense[:4].shape), dense[:4]),
        ("lengths", "INT64", list(lengths[:4].shape), lengths[:4]),
        ("values", "INT64", [int(lengths[:4].sum())], values[: int(lengths[:4].sum())]),
    ]
    status, headers, body = _binary_request(
        server, good, {"parameters": {"binary_data_output": True}}
    )
    assert status == 200, body
    head = int(headers["inference-header-content-length"])
    answer = json.loads(body[:head])
    assert answer["outputs"][0]["parameters"]["binary_data_size"] == 16
    assert np.array_equal(np.frombuffer(body[head:], "<f4"), expected[:4])

    def refused(body_inputs, status=400):
        got, answer = server.post("/v2/models/recsys/infer", {"inputs": body_inputs})
        assert got == status, answer
        return answer["error"]

    sample = [
        {"name": "dense", "datatype": "FP32", "shape": [1, 3], "data": dense[0].tolist()},
        {"name": "lengths", "datatype": "INT64", "shape": [1, 3], "data": [1, 1, 1]},
        {"name": "values", "datatype": "INT64", "shape": [3], "data": values[:3].tolist()},
    ]

    def changed(index, **fields):
        return [dict(x, **fields) if i == index else x for i, x in enumerate(sample)]

    for bad, shown in ((1.5, "1.5"), (True, "true"), ("7", '"7"'), (7.0, "7.0")):
        message = refused(changed(2, data=[bad, *values[1:3].tolist()]))
        assert f"input 'values' element 0 is {shown}; datatype INT64 holds integers" in message
    assert "outside INT64's range" in refused(changed(2, data=[2**64, 1, 2]))
    nan = dense[:1].copy()  # JSON has no NaN: the binary extension carries one
    nan[0, 1] = np.nan
    status, _, body = _binary_request(server, [("dense", "FP32", [1, 3], nan), *good[1:2]])
    assert status == 400
    assert "input 'values' is missing" in json.loads(body)["error"]
    status, _, body = _binary_request(
        server,
        [("dense", "FP32", [1, 3], nan),
         ("lengths", "INT64", [1, 3], np.ones((1, 3), np.int64)),
         ("values", "INT64", [3], values[:3])],
    )  # fmt: skip
    assert status == 400 and "input 'dense' row 0, feature 'int_1' is nan" in body.decode()
    assert "given twice" in refused([*sample, sample[2]])
    assert "has shape [5]" in refused(changed(2, shape=[5]))
    assert "input 'lengths' adds up to 4" in refused(changed(1, data=[1, 2, 1]))
    assert "has 0 rows" in refused(
        [dict(sample[0], shape=[0, 3], data=[]), dict(sample[1], shape=[0, 3], data=[]),
         dict(sample[2], shape=[0], data=[])]
    )  # fmt: skip
    huge = changed(0, shape=[10**12, 3])
    assert "input 'dense' has shape [1000000000000, 3]" in refused(huge)
    assert "is 300 (more than 256)" in refused(changed(1, data=[1, 1, 300]))
    assert "is not valid JSON" in server.request("POST", "/v2/models/recsys/infer", "{")[1]
    status, text = server.request("POST", "/v2/models/other/infer", {"inputs": sample})
    assert status == 404 and "model 'other' is not served here" in text
    status, _, body = _binary_request(server, good, tail=b"\0" * 8)
    assert status == 400 and "8 bytes after the inputs' binary data" in body.decode()
    big = b'{"inputs": [' + b" " * (17 * 2**20) + b"]}"
    status, text = server.request("POST", "/v2/models/recsys/infer", big.decode())
    assert status == 413 and "at most 16.0 MiB" in text
    # serving goes on; every refusal was one WARNING line, no traceback
    assert server.post("/v2/models/recsys/infer", {"inputs": sample})[0] == 200
    log = server.log.read_text()
    assert "Traceback" not in log and log.count("refused a v2 request") >= 15


def test_a_port_in_use_is_one_line_before_anything_loads(run, served, capsys):  # noqa: F811
    server, _, _, _ = served
    _, base, _ = run
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag in ("--port", "--grpc-port", "--metrics-port"):
            free = _free_ports(3)
            ports = dict(zip(("--port", "--grpc-port", "--metrics-port"), free, strict=True))
            ports[flag] = port
            args = ["serve", "--model", str(base), "--host", "127.0.0.1"]
            for option, value in ports.items():
                args += [option, str(value)]
            assert main(args) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"recsys: error: port {port} ({flag}) is in use on 127.0.0.1: stop "
                           "what listens there or pick another port"]  # fmt: skip
    assert server.get("/v2/health/ready")[0] == 200  # the running server is unaffected


def test_bad_exports_are_one_line_before_the_engine_starts(run, tmp_path, capsys):  # noqa: F811
    run_dir, base, _ = run
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(base.read_bytes()[: base.stat().st_size // 2])
    text = tmp_path / "notes.pt2"
    text.write_text("not a model")

    def archive(name: str, members: list[str]) -> Path:
        path = tmp_path / name
        with zipfile.ZipFile(path, "w") as out:
            for member in members:
                out.writestr(f"model/extra/{member}", "{}")
        return path

    sequence = archive("sequence.pt2", ["spec.json", "retrieval.json"])
    fixed = archive("fixed.pt2", ["spec.json"])
    cases = [
        ([str(cut)], f"'{cut}' is cut short: a zip archive without its end"),
        ([str(text)], f"'{text}' was not written by recsys export (it is not a .pt2 archive)"),
        ([str(sequence)], f"'{sequence}' is a sequence model's export (retrieval.json inside)"),
        ([str(fixed), "--deltas", str(run_dir)], f"'{fixed}' has no dynamic tables for --deltas"),
    ]
    for model, message in cases:
        ports = [str(p) for p in _free_ports(3)]
        args = ["serve", "--model", *model, "--host", "127.0.0.1", "--port", ports[0]]
        assert main([*args, "--grpc-port", ports[1], "--metrics-port", ports[2]]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"recsys: error: {message}"), err


def test_kill_9_restarts_on_the_last_good_version_and_faults_leave_serving_on(run, tmp_path):  # noqa: F811
    """A server killed with kill -9 after applying deltas keeps nothing half-applied: restarted,
    it serves base + the committed deltas, as predict --deltas scores them; a delta being
    written (no manifest yet, or a .tmp- directory) is never read; a deltas directory that
    disappears is logged once while serving goes on."""
    run_dir, base, rows = run
    watched = tmp_path / "deltas"
    watched.mkdir()
    for step in (2, 4, 6):
        _copy_delta(run_dir, step, watched)
    first = Server(tmp_path, "--model", str(base), "--deltas", str(watched))
    samples = _samples(rows)[:8]
    try:
        _wait_for_step(first, samples, 6)
        shutil.copytree(run_dir / "deltas" / "step_00000008", watched / ".tmp-step_00000008")
        partial = shutil.copytree(run_dir / "deltas" / "step_00000010", watched / "step_00000010")
        (partial / "delta.json").unlink()  # the manifest, written last: still being written
    finally:
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=30)
    second = Server(tmp_path, "--model", str(base), "--deltas", str(watched))
    try:
        scores, step = _json_scores(second, samples)
        assert step == 6
        upto6 = tmp_path / "upto6"
        upto6.mkdir()
        for delta in (2, 4, 6):
            _copy_delta(run_dir, delta, upto6)
        expected = _offline(base, rows, upto6, tmp_path / "at6.parquet")
        np.testing.assert_allclose(scores, expected[: len(samples)], rtol=0, atol=1e-6)
        shutil.rmtree(watched)
        deadline = time.monotonic() + 30
        while "deltas directory not found" not in second.log.read_text():
            assert time.monotonic() < deadline, second.log.read_text()
            time.sleep(0.2)
        assert _json_scores(second, samples)[1] == 6  # still serving
        assert second.log.read_text().count("deltas directory not found") == 1
    finally:
        assert second.stop() == 0
