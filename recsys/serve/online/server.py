"""``recsys serve``: run MLServer with the recsys runtime in this process.

MLServer listens on three ports: HTTP (the Open Inference Protocol under ``/v2``, its infer
route in JSON or binary tensors taken by :mod:`recsys.serve.online.http_infer`, and the JSON
route ``/predict``), gRPC (the same protocol) and metrics (Prometheus, ``/metrics``). Every
port is checked free, and the model, deltas and options checked, before anything starts: a
clash or a bad file is one ``recsys: error:`` line. The model loads after the server starts
listening: ``/v2/health/live`` answers at once,
``/v2/health/ready`` and ``/v2/models/<name>/ready`` only once the tables (and the deltas
written since the export) are loaded. SIGTERM (or SIGINT) stops taking connections and lets the
requests in flight finish (uvicorn's graceful shutdown), then stops the delta watcher.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

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
    max_wait_ms: float = 0.0
    """How long an idle server waits for more requests to merge (0: none; requests that
    arrive while a batch is scored form the next batch)."""
    max_ids: int = 256
    """Most ids in one bag of a request."""
    max_body_mb: float = 16.0
    """Largest request body of the HTTP infer route, in MiB (a larger one is a 413)."""
    poll_seconds: float = 1.0
    """How often ``deltas`` (and ``model``) is checked for new deltas (and a new base)."""
    transform: bool = False
    """The JSON route takes raw values, transformed by the training data's fitted workflow."""
    data: str | None = None
    """With ``transform``: the preprocessed directory the model was trained on (default: the
    model config's ``data.path``)."""
    cache_rows: int | None = None
    """Rows of each tiered table's cache (default: the training run's cache size)."""
    compile: str = "off"
    """``aoti``: score with the export compiled by AOTInductor
    (:mod:`recsys.serve.compiled_program`)."""

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
        if not self.max_body_mb > 0:
            raise ValueError(f"--max-body-mb must be > 0, got {self.max_body_mb}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"--max-wait-ms must be >= 0, got {self.max_wait_ms}")
        if not self.poll_seconds > 0:
            raise ValueError(f"--poll-seconds must be > 0, got {self.poll_seconds}")
        from recsys.serve.compiled_program import COMPILE_CHOICES, compile_refusal

        if self.compile not in COMPILE_CHOICES:
            raise ValueError(
                f"--compile {self.compile!r}; expected one of {', '.join(COMPILE_CHOICES)}"
            )
        if Path(self.model).is_file():
            from recsys.serve.program_file import check_served_export

            check_served_export(Path(self.model), deltas=self.deltas is not None)
        if self.compile == "aoti":
            model = Path(self.model)  # a directory's tiers are refused when it is exported
            refusal = compile_refusal(model if model.is_file() else None, self.deltas is not None)
            if refusal:
                raise ValueError(refusal)
        if self.deltas is not None:
            deltas_directory(self.deltas)  # before the server starts: a one-line error
        if self.data is not None and not self.transform:
            raise ValueError(
                "--data names the training data to transform raw input with: add --transform"
            )
        check_ports_free(self.host, self.ports())

    def ports(self) -> dict[str, int]:
        """Option name -> the port it makes the server listen on."""
        return {
            "--port": self.port,
            "--grpc-port": self.grpc_port or self.port + 1,
            "--metrics-port": self.metrics_port or self.port + 2,
        }


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Raise ValueError naming the first port of ``ports`` (option -> port) that is taken or
    repeated: bound here without ``SO_REUSEPORT``, so a server already listening there (even
    one that set it, as gRPC does) makes the bind fail."""
    seen: dict[int, str] = {}
    for option, port in ports.items():
        if not 0 < port < 65536:
            raise ValueError(f"{option} {port}: expected a port in [1, 65535]")
        if port in seen:
            raise ValueError(f"{option} {port} is also {seen[port]}: give each its own port")
        seen[port] = option
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise ValueError(
                        f"port {port} ({option}) is in use on {host}: stop what listens there "
                        f"or pick another port"
                    ) from None
                raise ValueError(f"cannot listen on {host}:{port} ({option}): {error}") from None


def _one_line_per_event() -> None:
    """recsys' serving log on stdout in the engine's format, printed once: not also by a
    handler some library put on the root logger (the engine's records likewise, once it has
    configured its own)."""
    ours = logging.getLogger("recsys.serve")
    ours.setLevel(logging.INFO)
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            logging.Formatter("%(asctime)s [%(name)s] %(levelname)s - %(message)s")
        )
        ours.addHandler(handler)
    ours.propagate = False


def serve(options: ServeOptions) -> None:
    """Serve until SIGTERM / SIGINT.

    Raises:
        ValueError, FileNotFoundError: a bad option, or a model (or deltas) that failed to
            load: the server stops and the load error is raised.
    """
    options.check()
    from mlserver import MLServer
    from mlserver.settings import Settings

    from recsys.serve.online.http_infer import V2InferMiddleware
    from recsys.serve.online.runtime import (
        RUNTIMES,
        QuietClientErrors,
        close_served,
        load_errors,
        served_model_settings,
    )

    ports = options.ports()
    settings = Settings(
        host=options.host,
        http_port=ports["--port"],
        grpc_port=ports["--grpc-port"],
        metrics_port=ports["--metrics-port"],
        parallel_workers=0,  # one process: the tables are loaded once, deltas applied once
        debug=False,
        load_models_at_startup=False,
        extensions=["binary_tensor_data"],  # on HTTP (recsys.serve.online.http_infer)
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
        compile=options.compile,
    )
    _one_line_per_event()
    logging.getLogger("mlserver.grpc").addFilter(QuietClientErrors())  # logged once, as WARNING
    logging.getLogger("recsys.serve").info(
        "recsys serve: %s on %s, HTTP %d, gRPC %d, metrics %d",
        options.model,
        options.host,
        *ports.values(),
    )

    async def run() -> None:
        server = MLServer(settings)
        logging.getLogger("mlserver").propagate = False  # its own handler prints each record
        # The HTTP infer route (JSON and the binary extension) as the app uvicorn calls, in
        # front of MLServer's REST app (its parsing, error middleware and routing cost a small
        # request more than recsys' own work): wrapped into the uvicorn config MLServer makes
        # (mlserver pinned in requirements/base.txt; tests/serve cover the route).
        rest = server._rest_server
        uvicorn_config = rest._get_config
        max_body = int(options.max_body_mb * 2**20)

        def infer_first() -> Any:
            config = uvicorn_config()
            config.app = V2InferMiddleware(config.app, runtimes=RUNTIMES, max_body_bytes=max_body)
            return config

        rest._get_config = infer_first
        # Stop once: each uvicorn server (HTTP, metrics) raises the signal it caught again once
        # it has shut down, which MLServer's handler turned into more stops (the gRPC shutdown
        # logged four times).
        stop_servers = server.stop
        stopping: list[asyncio.Future] = []

        async def stop_once(sig: int | None = None) -> None:
            if not stopping:
                stopping.append(asyncio.ensure_future(stop_servers(sig)))
            await asyncio.shield(stopping[0])  # a cancelled caller does not cancel the stop

        server.stop = stop_once  # MLServer's signal handlers look it up when a signal comes
        await server.start([model_settings])

    try:
        # uvloop, as MLServer's own CLI runs (a loop of this call only: no global policy)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(run())
    finally:
        close_served()
    if options.name in load_errors:
        raise load_errors[options.name]
