"""The MLServer runtime of ``recsys serve``: a :class:`ServedModel` behind the Open Inference
Protocol (``/v2/models/<name>/infer``) and a plain JSON route (``POST /predict``; with the
``transform`` option it takes raw values, transformed by the training data's fitted workflow).

Each request is checked on its own first (:mod:`recsys.serve.online.requests`: a bad one is a
400 naming the field, and never joins a batch), then handed to the runtime's batcher
(:class:`~recsys.serve.online.batcher.RowBatcher`), which merges concurrent requests up to
``max_batch_size`` requests or ``max_wait_ms`` and splits the scores back. A merged batch is
scored by one version of the model (:meth:`ServedModel.score`), in a worker thread so the event
loop keeps taking requests; every response carries the step it was served at
(``parameters.step``; ``"step"`` on the JSON route). The HTTP v2 infer route (JSON and binary
tensors) is taken in front of the engine by :mod:`recsys.serve.online.http_infer`; gRPC comes
through the engine to :meth:`RecsysRuntime.predict`. Where a request's time goes (decode,
validate, queue, score, encode) is on the metrics endpoint
(``recsys_serve_request_phase_seconds``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sys
import time
from typing import Any

import numpy as np
from fastapi import Request, Response
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.handlers import custom_handler
from mlserver.settings import ModelSettings
from mlserver.types import (
    InferenceRequest,
    InferenceResponse,
    MetadataModelResponse,
    MetadataTensor,
    Parameters,
)
from prometheus_client import Counter, Gauge, Histogram

from recsys.data.etl_online import RowTransform
from recsys.serve.export import training_data
from recsys.serve.online.batcher import BatchTiming, RowBatcher
from recsys.serve.online.requests import (
    RequestError,
    Rows,
    raw_rows_from_json,
    rows_from_json,
    rows_from_tensors,
)
from recsys.serve.online.served import ServedModel
from recsys.serve.online.tensors import typed_array

__all__ = [
    "JSON_ROUTE",
    "RUNTIMES",
    "RecsysRuntime",
    "close_served",
    "load_errors",
    "served_model_settings",
]

JSON_ROUTE = "/predict"
"""The plain JSON route (named features)."""

_METRICS: dict[str, Any] = {}
_SERVED: list[ServedModel] = []
RUNTIMES: dict[str, RecsysRuntime] = {}
"""Model name -> its loaded runtime (what the HTTP infer route scores with)."""
logger = logging.getLogger("recsys.serve")
load_errors: dict[str, Exception] = {}
"""Model name -> the error its load failed with (MLServer logs it and stops the server)."""


class ClientError(MLServerError):
    """A request the model cannot score (400 / gRPC ``INVALID_ARGUMENT``): the runtime logs it
    as one WARNING line, and :class:`QuietClientErrors` keeps the engine from logging it again
    with a traceback."""


class QuietClientErrors(logging.Filter):
    """The engine's gRPC handler logs every error with ``logger.exception``: a
    :class:`ClientError` (logged by the runtime already) is dropped, another client error of
    the engine's (4xx: an unknown model) becomes one WARNING line without its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ClientError):
            return False
        if isinstance(error, MLServerError) and error.status_code < 500:
            record.msg, record.args, record.exc_info = "refused a gRPC request: %s", (error,), None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def close_served() -> None:
    """Stop the delta watchers of every model this process loaded (MLServer's shutdown does
    not unload models)."""
    while _SERVED:
        _SERVED.pop().close()


@functools.cache
def _labelled(metric: str, label: str) -> Any:
    """``_metrics()[metric].labels(label)``, looked up once (a request observes several)."""
    return _metrics()[metric].labels(label)


def _metrics() -> dict[str, Any]:
    """The runtime's Prometheus metrics, created once per process (the engine's endpoint
    serves the default registry)."""
    if not _METRICS:
        rows = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
        _METRICS.update(
            requests=Counter("recsys_serve_requests", "Requests scored, by route", ["route"]),
            rejected=Counter(
                "recsys_serve_rejected_requests", "Requests refused with a 400", ["route"]
            ),
            latency=Histogram(
                "recsys_serve_request_seconds",
                "Time from a request's arrival at the runtime to its scores",
                ["route"],
                buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
            ),
            phases=Histogram(
                "recsys_serve_request_phase_seconds",
                "Time of a request in each phase: decode (body to arrays), validate (the rows' "
                "checks), queue (waiting for its batch), score (its batch's scoring), encode",
                ["phase"],
                buckets=(5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 1),
            ),
            batch_rows=Histogram(
                "recsys_serve_batch_rows", "Samples in one scored batch", buckets=rows
            ),
            step=Gauge("recsys_serve_step", "Training step of the tables being served"),
            refused=Gauge(
                "recsys_serve_deltas_refused", "Deltas (or chains) and new bases refused so far"
            ),
            bases=Gauge("recsys_serve_bases_loaded", "Bases loaded so far (1, then new ones)"),
            **{
                f"cache_{name}": Gauge(f"recsys_serve_cache_{name}", text, ["table"])
                for name, text in _CACHE_COUNTERS.items()
            },
            cache_hit_rate=Gauge(
                "recsys_serve_cache_hit_rate",
                "Hits over lookups of a tiered table's cache so far (distinct ids per batch)",
                ["table"],
            ),
        )
    return _METRICS


_CACHE_COUNTERS = {
    "lookups": "Distinct ids of a batch looked up in a tiered table's cache, so far",
    "hits": "Of those, ids whose row was cached",
    "misses": "Of those, ids whose row was not cached (read from the store, or absent)",
    "evictions": "Rows evicted from a tiered table's cache so far",
    "rows_resident": "Rows a tiered table's cache holds now",
    "capacity_rows": "Rows a tiered table's cache can hold",
}
"""The cache counters of tiered tables on the metrics endpoint (per table, of the served
base's caches; monotonic within a base), as gauges read at scrape time."""

_CACHE_STATS = {"evictions": "evicted", "capacity_rows": "cache_rows"}


def _watch_cache(metrics: dict[str, Any], served: ServedModel) -> None:
    """Point the cache gauges at ``served``'s tiered tables (read at every scrape)."""

    def reader(table: str, stat: str):
        return lambda: served.cache_stats().get(table, {}).get(stat, 0)

    def hit_rate(table: str):
        def read() -> float:
            stats = served.cache_stats().get(table, {})
            return stats["hits"] / stats["lookups"] if stats.get("lookups") else 0.0

        return read

    for table in served.cache_stats():
        for name in _CACHE_COUNTERS:
            metrics[f"cache_{name}"].labels(table).set_function(
                reader(table, _CACHE_STATS.get(name, name))
            )
        metrics["cache_hit_rate"].labels(table).set_function(hit_rate(table))


def served_model_settings(
    name: str,
    model: str,
    deltas: str | None,
    max_batch_size: int,
    max_wait_ms: float,
    max_ids: int,
    poll_seconds: float,
    *,
    transform: bool = False,
    data: str | None = None,
    cache_rows: int | None = None,
    compile: str = "off",
) -> ModelSettings:
    """MLServer's settings for the runtime (its options ride in ``parameters.extra``)."""
    return ModelSettings(
        name=name,
        implementation=RecsysRuntime,
        # Batching is the runtime's own AdaptiveBatcher (after the per-request checks): the
        # engine's hook would merge requests before they are checked.
        max_batch_size=0,
        max_batch_time=0,
        parameters={
            "uri": model,
            "extra": {
                "deltas": deltas,
                "max_batch_size": max_batch_size,
                "max_wait_ms": max_wait_ms,
                "max_ids": max_ids,
                "poll_seconds": poll_seconds,
                "transform": transform,
                "data": data,
                "cache_rows": cache_rows,
                "compile": compile,
            },
        },
    )


class RecsysRuntime(MLModel):
    """MLServer runtime serving a recsys export (see the module docstring)."""

    async def load(self) -> bool:
        extra = self.settings.parameters.extra or {}
        try:
            served = await asyncio.to_thread(
                ServedModel,
                self.settings.parameters.uri,
                extra.get("deltas"),
                extra.get("cache_rows"),
                extra.get("compile", "off"),
            )
        except Exception as error:
            load_errors[self.name] = error
            raise
        self.transform = None
        try:
            if extra.get("transform"):
                self.transform = await asyncio.to_thread(_row_transform, served, extra.get("data"))
        except Exception as error:
            served.close()
            load_errors[self.name] = error
            raise
        await asyncio.to_thread(served.refresh)  # ready only with the tables caught up
        self.served = served
        _SERVED.append(served)
        self.max_ids = int(extra.get("max_ids", 256))
        self._batcher = RowBatcher(
            served.score,
            max_requests=int(extra.get("max_batch_size", 64)),
            max_wait_s=float(extra.get("max_wait_ms", 0.0)) / 1000,
            on_batch=_metrics()["batch_rows"].observe,
        )
        spec = served.spec
        self.inputs = [
            MetadataTensor(name="dense", datatype="FP32", shape=[-1, spec.num_dense]),
            MetadataTensor(name="lengths", datatype="INT64", shape=[-1, len(spec.sparse_names)]),
            MetadataTensor(name="values", datatype="INT64", shape=[-1]),
        ]
        self.outputs = [
            MetadataTensor(name="scores", datatype="FP32", shape=[-1, len(spec.label_names)])
        ]
        metrics = _metrics()
        metrics["step"].set_function(lambda: served.step)
        metrics["refused"].set_function(lambda: served.num_refused)
        metrics["bases"].set_function(lambda: served.num_bases)
        _watch_cache(metrics, served)
        served.watch(float(extra.get("poll_seconds", 1.0)))
        RUNTIMES[self.name] = self
        return True

    async def metadata(self) -> MetadataModelResponse:
        """The engine's metadata, with the feature names, id encoding and served step."""
        metadata = await super().metadata()
        spec = self.served.spec
        metadata.parameters = Parameters(
            dense_names=list(spec.dense_names),
            sparse_names=list(spec.sparse_names),
            label_names=list(spec.label_names),
            id_encoding=spec.id_encoding,
            max_ids=self.max_ids,
            step=self.served.step,
        )
        return metadata

    async def unload(self) -> bool:
        served = getattr(self, "served", None)  # None: the load failed
        if RUNTIMES.get(self.name) is self:
            del RUNTIMES[self.name]
        if served is not None:
            await asyncio.to_thread(served.close)
            if served in _SERVED:
                _SERVED.remove(served)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        """The v2 route through the engine (gRPC): check the tensors, then score them in a
        merged batch."""
        start = time.perf_counter()
        try:
            tensors = {}
            for given in payload.inputs:
                if given.name in tensors:
                    raise RequestError(f"input '{given.name}' is given twice; give each input once")
                tensors[given.name] = _tensor(given)
            rows = rows_from_tensors(tensors, self.served.spec, self.max_ids)
        except RequestError as error:
            self.reject("v2")
            logger.warning("refused a v2 request (gRPC): %s", error)
            raise ClientError(str(error)) from None
        scores, step, timing = await self.score(rows)
        self.observe("v2", start, queue=timing.queue_s, score=timing.score_s)
        output = NumpyCodec.encode_output("scores", scores)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            id=payload.id,
            outputs=[output],
            parameters=Parameters(step=step),
        )

    @custom_handler(rest_path=JSON_ROUTE)
    async def predict_json(self, request: Request) -> Response:
        """The JSON route: named features in, ``{"scores": {label: [..]}, "step": N}`` out."""
        start = time.perf_counter()
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as error:
                raise RequestError(f"the body is not JSON: {error}") from None
            if self.transform is None:
                rows = rows_from_json(body, self.served.spec, self.max_ids)
            else:  # raw values: the fitted workflow runs in a worker thread
                rows = await asyncio.to_thread(
                    raw_rows_from_json, body, self.served.spec, self.transform, self.max_ids
                )
        except RequestError as error:
            self.reject("json")
            logger.warning("refused a request to %s: %s", JSON_ROUTE, error)
            return Response(json.dumps({"error": str(error)}), 400, media_type="application/json")
        scores, step, timing = await self.score(rows)
        self.observe("json", start, queue=timing.queue_s, score=timing.score_s)
        labels = self.served.spec.label_names
        out = {"scores": {name: scores[:, t].tolist() for t, name in enumerate(labels)}}
        return Response(json.dumps(out | {"step": step}), media_type="application/json")

    async def score(self, rows: Rows) -> tuple[np.ndarray, int, BatchTiming]:
        """Scores of checked rows [len(rows), T] through the batcher, the step, the timing."""
        scores, step, timing = await self._batcher.score(rows)
        return scores.astype(np.float32, copy=False), step, timing

    def reject(self, route: str) -> None:
        """Count a request refused on ``route``."""
        _labelled("rejected", route).inc()

    def observe(self, route: str, start: float, **phases: float) -> None:
        """Count a request scored on ``route`` (arrived at ``start``) and its phases' times."""
        _labelled("requests", route).inc()
        _labelled("latency", route).observe(time.perf_counter() - start)
        for phase, seconds in phases.items():
            _labelled("phases", phase).observe(seconds)


def _row_transform(served: ServedModel, data: str | None) -> RowTransform:
    """The fitted transform of the training data of the served model (``data``, else its
    config's ``data.path``), checked to hold the model's vocabulary."""
    directory, _ = training_data(served.path, served.spec, data)
    # MLServer has registered the Open Inference Protocol's protobuf messages (package
    # "inference"); merlin's optional Triton dtype mapping imports tritonclient's, which declare
    # the same messages and fail to register (a TypeError). Blocking that one import makes
    # merlin skip the mapping, which it does for an ImportError; recsys does not use it.
    sys.modules.setdefault("tritonclient.grpc.model_config_pb2", None)
    return RowTransform(directory)


def _tensor(payload: Any) -> tuple[str, list[int], np.ndarray]:
    """(datatype, shape, flat data) of a v2 input the engine decoded, typed strictly
    (:func:`~recsys.serve.online.tensors.typed_array`)."""
    data = getattr(payload.data, "root", payload.data)
    if isinstance(data, np.ndarray | tuple):
        data = list(data) if isinstance(data, tuple) else data.tolist()
    return payload.datatype, list(payload.shape), typed_array(payload.name, payload.datatype, data)
