"""``recsys serve``: run MLServer with the recsys runtime in this process.

MLServer listens on three ports: HTTP (the Open Inference Protocol under ``/v2`` and the JSON
route ``/predict``), gRPC (the same protocol) and metrics (Prometheus, ``/metrics``). The model
loads after the server starts listening: ``/v2/health/live`` answers at once,
``/v2/health/ready`` and ``/v2/models/<name>/ready`` only once the tables (and the deltas
written since the export) are loaded. SIGTERM (or SIGINT) stops taking connections and lets the
requests in flight finish (uvicorn's graceful shutdown), then stops the delta watcher.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from recsys.checkpoint.deltas import deltas_directory

__all__ = ["ServeOptions", "serve"]


@dataclass
class ServeOptions:
    """What ``recsys serve`` takes (see its ``--help``)."""

    model: str
    deltas: str | None = None
    name: str = "recsys"
    host: str = "0.0.0.0"
    port: int = 8080
    grpc_port: int | None = None
    """Default: ``port + 1``."""
    metrics_port: int | None = None
    """Default: ``port + 2``."""
    max_batch_size: int = 64
    """Most requests merged into one scored batch."""
    max_wait_ms: float = 2.0
    """Longest a request waits for others to merge with."""
    max_ids: int = 256
    """Most ids in one bag of a request."""
    poll_seconds: float = 1.0
    """How often ``deltas`` (and ``model``) is checked for new deltas (and a new base)."""
    transform: bool = False
    """The JSON route takes raw values, transformed by the training data's fitted workflow."""
    data: str | None = None
    """With ``transform``: the preprocessed directory the model was trained on (default: the
    model config's ``data.path``)."""
    cache_rows: int | None = None
    """Rows of each tiered table's cache (default: the training run's cache size)."""

    def check(self) -> None:
        """Raise ValueError naming a bad option, FileNotFoundError for a missing model or
        deltas directory."""
        if not Path(self.model).exists():
            raise FileNotFoundError(
                f"--model '{self.model}' not found: give a .pt2 file from `recsys export` or a "
                "checkpoint (or run) directory"
            )
        for name in ("port", "max_batch_size", "max_ids", "cache_rows"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if not self.max_wait_ms >= 0:
            raise ValueError(f"--max-wait-ms must be >= 0, got {self.max_wait_ms}")
        if not self.poll_seconds > 0:
            raise ValueError(f"--poll-seconds must be > 0, got {self.poll_seconds}")
        if self.deltas is not None:
            deltas_directory(self.deltas)  # before the server starts: a one-line error
        if self.data is not None and not self.transform:
            raise ValueError(
                "--data names the training data to transform raw input with: add " "--transform"
            )


def serve(options: ServeOptions) -> None:
    """Serve until SIGTERM / SIGINT.

    Raises:
        ValueError, FileNotFoundError: a bad option, or a model (or deltas) that failed to
            load: the server stops and the load error is raised.
    """
    options.check()
    from mlserver import MLServer
    from mlserver.settings import Settings

    from recsys.serve.online.runtime import close_served, load_errors, served_model_settings

    settings = Settings(
        host=options.host,
        http_port=options.port,
        grpc_port=options.grpc_port or options.port + 1,
        metrics_port=options.metrics_port or options.port + 2,
        parallel_workers=0,  # one process: the tables are loaded once, deltas applied once
        debug=False,
        load_models_at_startup=False,
    )
    model_settings = served_model_settings(
        options.name,
        str(options.model),
        options.deltas,
        options.max_batch_size,
        options.max_wait_ms,
        options.max_ids,
        options.poll_seconds,
        transform=options.transform,
        data=options.data,
        cache_rows=options.cache_rows,
    )
    logging.getLogger("recsys.serve").setLevel(logging.INFO)

    async def run() -> None:
        server = MLServer(settings)
        await server.start([model_settings])

    try:
        asyncio.run(run())
    finally:
        close_served()
    if options.name in load_errors:
        raise load_errors[options.name]
