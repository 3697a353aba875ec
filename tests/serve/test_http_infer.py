"""The v2 infer route's ASGI middleware on its own (no server): what it answers itself and what
it hands to the app behind it. The route against a running server: ``test_server.py``."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import numpy as np

from recsys.data.batch import DatasetSpec
from recsys.serve.online.batcher import BatchTiming
from recsys.serve.online.http_infer import V2InferMiddleware

SPEC = DatasetSpec(("d0", "d1"), ("a", "b"), (10, 100), ("click",))
REQUEST = {
    "inputs": [
        {"name": "dense", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 1.0]},
        {"name": "lengths", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]},
        {"name": "values", "datatype": "INT64", "shape": [2], "data": [3, 42]},
    ]
}


class _Runtime:
    """What the middleware uses of a runtime; ``fail`` makes scoring raise."""

    def __init__(self, fail: bool = False) -> None:
        self.served, self.max_ids, self.fail = SimpleNamespace(spec=SPEC), 64, fail
        self.observed, self.rejected = 0, 0

    async def score(self, rows):
        if self.fail:
            raise RuntimeError("the program broke")
        return np.full((len(rows), 1), 0.25, np.float32), 7, BatchTiming(0.0, 0.0, len(rows))

    def observe(self, route, start, **phases) -> None:
        self.observed += 1

    def reject(self, route) -> None:
        self.rejected += 1


def _call(app, path: str, body: bytes, method: str = "POST") -> tuple[int, dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))
    status = sent[0]["status"]
    return status, json.loads(sent[1]["body"])


async def _behind(scope, receive, send) -> None:
    """The app behind the middleware (MLServer's, in the server): answers 299."""
    await send({"type": "http.response.start", "status": 299, "headers": []})
    await send({"type": "http.response.body", "body": b'{"app": true}'})


def test_scores_refusals_and_failures_are_answered_by_the_route(caplog):
    runtime = _Runtime()
    app = V2InferMiddleware(_behind, {"recsys": runtime}, max_body_bytes=2**20)
    body = json.dumps(REQUEST).encode()
    status, answer = _call(app, "/v2/models/recsys/infer", body)
    assert status == 200 and answer["outputs"][0]["data"] == [0.25], answer
    assert runtime.observed == 1

    status, answer = _call(app, "/v2/models/recsys/infer", b"{not json")
    assert status == 400 and "error" in answer and runtime.rejected == 1
    status, answer = _call(app, "/v2/models/other/infer", body)
    assert status == 404 and "'other' is not served here" in answer["error"]

    # Everything but a POST to an infer route goes to the app behind.
    assert _call(app, "/v2/models/recsys", b"", method="GET") == (299, {"app": True})
    assert _call(app, "/v2/models/recsys/infer", b"", method="GET") == (299, {"app": True})

    # The server's own failure: a 500 naming it, the traceback logged once, nothing observed.
    app = V2InferMiddleware(_behind, {"recsys": _Runtime(fail=True)}, max_body_bytes=2**20)
    with caplog.at_level(logging.ERROR, logger="recsys.serve"):
        status, answer = _call(app, "/v2/models/recsys/infer", body)
    assert status == 500
    assert answer == {
        "error": "the server failed to score the request (RuntimeError: the program broke)"
    }
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is not None and "the v2 infer route failed" in record.getMessage()
