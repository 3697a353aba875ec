"""Run a test body on W gloo ranks (CPU processes) and fail the calling test with every rank's
errors. Bodies must be module-level functions (they are pickled by name)."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out: str, backend: str, body, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, body, *args, backend: str = "gloo") -> None:
    """``body(rank, world_size, *args)`` on ``world_size`` ranks (gloo on CPU, or ``nccl`` with
    rank r on cuda:r); raise AssertionError with the failing ranks' tracebacks."""
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.spawn(
                _entry,
                args=(world_size, _free_port(), out, backend, body, args),
                nprocs=world_size,
                join=True,
            )
        except mp.ProcessRaisedException:
            pass
        except mp.ProcessExitedException as err:
            raise AssertionError(f"a rank died: {err}") from None
        errors = sorted(Path(out).glob("rank*.err"))
        if errors:
            raise AssertionError("\n".join(e.read_text() for e in errors))
