"""The MLServer runtime of ``recsys serve``: a :class:`ServedModel` behind the Open Inference
Protocol (``/v2/models/<name>/infer``) and a plain JSON route (``POST /predict``; with the
``transform`` option it takes raw values, transformed by the training data's fitted workflow).

Each request is checked on its own first (:mod:`recsys.serve.online.requests`: a bad one is a
400 naming the field, and never joins a batch), then handed to MLServer's adaptive batcher,
which merges concurrent requests up to ``max_batch_size`` requests or ``max_batch_time``
seconds and splits the scores back. A merged batch is scored by one version of the model
(:meth:`ServedModel.score`), in a worker thread so the event loop keeps taking requests; every
response carries the step it was served at (``parameters.step``; ``"step"`` on the JSON route).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np
from fastapi import Request, Response
from mlserver import MLModel
from mlserver.batching.adaptive import AdaptiveBatcher
from mlserver.codecs import NumpyCodec
from mlserver.context import model_context
from mlserver.errors import MLServerError
from mlserver.handlers import custom_handler
from mlserver.settings import ModelSettings
from mlserver.types import (
    InferenceRequest,
    InferenceResponse,
    MetadataModelResponse,
    MetadataTensor,
    Parameters,
    RequestInput,
)
from prometheus_client import Counter, Gauge, Histogram

from recsys.data.etl_online import RowTransform
from recsys.serve.export import training_data
from recsys.serve.online.requests import (
    RequestError,
    Rows,
    raw_rows_from_json,
    rows_from_json,
    rows_from_tensors,
)
from recsys.serve.online.served import ServedModel

__all__ = ["JSON_ROUTE", "RecsysRuntime", "close_served", "load_errors", "served_model_settings"]

JSON_ROUTE = "/predict"
"""The plain JSON route (named features)."""

_METRICS: dict[str, Any] = {}
_SERVED: list[ServedModel] = []
load_errors: dict[str, Exception] = {}
"""Model name -> the error its load failed with (MLServer logs it and stops the server)."""


def close_served() -> None:
    """Stop the delta watchers of every model this process loaded (MLServer's shutdown does
    not unload models)."""
    while _SERVED:
        _SERVED.pop().close()


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
            },
        },
    )


class _MergedScorer(MLModel):
    """What the batcher calls with merged requests: ``predict`` scores a batch of checked rows
    (inputs ``values``, ``lengths``, ``dense``, in that order) with one version."""

    def __init__(self, settings: ModelSettings, served: ServedModel) -> None:
        super().__init__(settings)
        self.served = served

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        arrays = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        scores, step = await asyncio.to_thread(
            self.served.score, arrays["dense"], arrays["lengths"], arrays["values"].reshape(-1)
        )
        _metrics()["batch_rows"].observe(len(scores))
        output = NumpyCodec.encode_output("scores", scores.astype(np.float32))
        return InferenceResponse(
            model_name=self.name, outputs=[output], parameters=Parameters(step=step)
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
        batching = self.settings.model_copy(
            update={
                "max_batch_size": int(extra.get("max_batch_size", 64)),
                "max_batch_time": float(extra.get("max_wait_ms", 2.0)) / 1000,
            }
        )
        self._batcher = AdaptiveBatcher(_MergedScorer(batching, served))
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
        if served is not None:
            await asyncio.to_thread(served.close)
            if served in _SERVED:
                _SERVED.remove(served)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        """The v2 route: check the tensors, then score them in a merged batch."""
        start = time.perf_counter()
        try:
            tensors = {i.name: _tensor(i) for i in payload.inputs}
            rows = rows_from_tensors(tensors, self.served.spec, self.max_ids)
        except RequestError as error:
            _metrics()["rejected"].labels("v2").inc()
            raise MLServerError(str(error)) from None
        scores, step = await self._score(rows)
        _observe("v2", start)
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
            _metrics()["rejected"].labels("json").inc()
            return Response(json.dumps({"error": str(error)}), 400, media_type="application/json")
        scores, step = await self._score(rows)
        _observe("json", start)
        labels = self.served.spec.label_names
        out = {"scores": {name: scores[:, t].tolist() for t, name in enumerate(labels)}}
        return Response(json.dumps(out | {"step": step}), media_type="application/json")

    async def _score(self, rows: Rows) -> tuple[np.ndarray, int]:
        """Scores of checked rows, through the batcher: ``values`` first so that the batcher
        splits the merged scores by the rows of ``dense`` (it takes each request's size from
        its last input)."""
        request = InferenceRequest(
            inputs=[
                _input("values", rows.values),
                _input("lengths", rows.lengths),
                _input("dense", rows.dense),
            ],
        )
        with model_context(self.settings):  # the JSON route runs outside the engine's context
            response = await self._batcher.predict(request)
        output = response.outputs[0]
        scores = NumpyCodec.decode_output(output).astype(np.float32)
        return scores.reshape(len(rows), -1), int(response.parameters.step)


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


def _input(name: str, array: np.ndarray) -> RequestInput:
    return NumpyCodec.encode_input(name, array)


def _tensor(payload: RequestInput) -> tuple[str, list[int], np.ndarray]:
    """(datatype, shape, flat data) of a v2 input, its data read as the datatype says."""
    data = getattr(payload.data, "root", payload.data)
    try:
        flat = np.asarray(_flatten(data), dtype=_DTYPES.get(payload.datatype, object))
    except (TypeError, ValueError, OverflowError):
        raise RequestError(
            f"input '{payload.name}' holds values that are not {payload.datatype}"
        ) from None
    if flat.dtype.kind == "f" and payload.datatype.startswith("INT"):
        raise RequestError(f"input '{payload.name}' holds non-integers; datatype INT64")
    return payload.datatype, list(payload.shape), flat


_DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}


def _flatten(data: Any) -> list:
    if isinstance(data, list) and data and isinstance(data[0], list):
        return [x for row in data for x in _flatten(row)]
    return data


def _observe(route: str, start: float) -> None:
    metrics = _metrics()
    metrics["requests"].labels(route).inc()
    metrics["latency"].labels(route).observe(time.perf_counter() - start)
