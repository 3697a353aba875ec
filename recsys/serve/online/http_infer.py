"""The Open Inference Protocol's HTTP infer route of ``recsys serve``, JSON and binary.

An ASGI middleware in front of MLServer's REST app (the app uvicorn calls) takes
``POST /v2/models/<name>/infer`` (and ``/versions/<v>/infer``) itself: it reads the body
(refused past ``max_body_bytes`` with a 413), decodes it as JSON or, with the
``Inference-Header-Content-Length`` header, as the binary tensor data extension
(:mod:`recsys.serve.online.tensors`), checks the rows, scores them through the runtime's batcher
and answers in the form the request asked for (binary outputs for ``binary_data_output``).
Everything else, gRPC included, is MLServer's. Errors are the runtime's own JSON
``{"error": "..."}`` with 400 (a bad request), 404 (a model not served, or not loaded yet) or
413 (a body too large), each logged as one WARNING line; a failure of the server's own (the
program raised) is a 500 with its traceback in the log.

Why a middleware: MLServer parses every infer body as JSON into pydantic models before a
runtime sees it (binary bodies fail there with a 422), and its per-value conversions are most
of a small request's cost; its routes, health, metadata and gRPC server are kept. It sits in
front of MLServer's FastAPI app rather than inside it, as Starlette's error middleware and
routing add their own cost to every request.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from recsys.serve.online.requests import RequestError, rows_from_tensors
from recsys.serve.online.tensors import (
    HEADER_LENGTH,
    binary_response,
    decode_request,
    json_response,
    wants_binary_output,
)

__all__ = ["V2InferMiddleware"]

_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?/infer$")
logger = logging.getLogger("recsys.serve")


class V2InferMiddleware:
    """ASGI middleware serving the v2 infer route (see the module docstring).

    Args:
        app: MLServer's REST app (everything else goes to it).
        runtimes: model name -> its loaded runtime (:class:`RecsysRuntime`), filled as
            models load.
        max_body_bytes: the largest request body read.
    """

    def __init__(self, app: Any, runtimes: dict[str, Any], max_body_bytes: int) -> None:
        self.app, self.runtimes, self.max_body_bytes = app, runtimes, max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        match = _INFER.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        name = match.group(1)
        runtime = self.runtimes.get(name)
        try:
            if runtime is None:
                served = ", ".join(repr(n) for n in self.runtimes) or "none yet"
                raise _HTTPError(404, f"model '{name}' is not served here (served: {served})")
            body = await self._body(headers, receive)
            header_length = _header_length(headers)
            header, tensors = decode_request(body, header_length)
            _check_outputs(header)
            decoded = time.perf_counter()
            rows = rows_from_tensors(tensors, runtime.served.spec, runtime.max_ids)
            validated = time.perf_counter()
        except (RequestError, _HTTPError) as error:
            status = error.status if isinstance(error, _HTTPError) else 400
            if runtime is not None:
                runtime.reject("v2")
            logger.warning("refused a v2 request to %s (%d): %s", scope["path"], status, error)
            await _send(send, status, json.dumps({"error": str(error)}).encode(), {})
            return
        try:
            scores, step, timing = await runtime.score(rows)
            scored = time.perf_counter()
            if wants_binary_output(header):
                payload, head = binary_response(header, name, scores, step)
                extra = {"inference-header-content-length": str(head)}
                content = "application/octet-stream"
            else:
                payload, extra, content = json_response(header, name, scores, step), {}, None
        except Exception as error:  # the server's fault: logged whole, answered 500
            logger.exception("the v2 infer route failed on %s", scope["path"])
            message = f"the server failed to score the request ({type(error).__name__}: {error})"
            await _send(send, 500, json.dumps({"error": message}).encode(), {})
            return
        runtime.observe(
            "v2",
            started,
            decode=decoded - started,
            validate=validated - decoded,
            queue=timing.queue_s,
            score=timing.score_s,
            encode=time.perf_counter() - scored,
        )
        await _send(send, 200, payload, extra, content)

    async def _body(self, headers: dict[str, str], receive: Callable[[], Awaitable[dict]]) -> bytes:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _HTTPError(413, _too_large(int(declared), self.max_body_bytes))
        chunks, size = [], 0
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _HTTPError(413, _too_large(size, self.max_body_bytes))
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _too_large(size: int, limit: int) -> str:
    return (
        f"the request body is {size / 2**20:.1f} MiB or more; at most {limit / 2**20:.1f} MiB "
        "(recsys serve --max-body-mb)"
    )


def _header_length(headers: dict[str, str]) -> int | None:
    given = headers.get(HEADER_LENGTH)
    if given is None:
        return None
    if not given.strip().isdigit():
        raise RequestError(f"{HEADER_LENGTH} is {given!r}; expected a byte count")
    return int(given)


def _check_outputs(header: dict) -> None:
    outputs = header.get("outputs")
    if outputs is None:
        return
    if not isinstance(outputs, list):
        raise RequestError("'outputs' must be a list of {'name': ...}")
    for output in outputs:
        name = output.get("name") if isinstance(output, dict) else None
        if name != "scores":
            raise RequestError(f"unknown output {name!r}; this model has one output, 'scores'")


async def _send(
    send: Callable, status: int, body: bytes, extra: dict[str, str], content: str | None = None
) -> None:
    headers = [
        (b"content-type", (content or "application/json").encode()),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in extra.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
