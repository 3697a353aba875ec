"""The one benchmark harness every ``benchmarks/<topic>.py`` uses.

A bench script times its providers with :func:`time_fns` (one callable: :func:`time_fn`), turns
each timing into a :class:`Row` and hands the rows to :func:`write_rows`, which appends them to
``<results dir>/<topic>.csv`` together with the facts that make a number a result: device,
library versions, git commit and UTC time (see :func:`environment`). The results directory is
``benchmarks/results/`` unless ``--out-dir`` or the environment variable ``RECSYS_BENCH_DIR``
names another one (``scripts/gpu_check.sh`` sets the variable).

Timing: ``warmup`` untimed calls, then at least ``repeats`` timed calls (more for fast calls, up
to a minimum total time), each bracketed by CUDA events on a CUDA device (after a synchronize)
or by ``time.perf_counter`` on CPU. :func:`time_fns` interleaves the providers of one case
round by round, so that load from elsewhere on the machine does not favour one of them. We
report the 20th / 50th / 80th percentiles in milliseconds; the p50 is the headline number.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# Distribution names to try for each library, first found wins (CPU and CUDA builds differ).
_DISTRIBUTIONS = {
    "triton": ("triton", "pytorch-triton"),
    "torchrec": ("torchrec", "torchrec-nightly"),
    "fbgemm_gpu": ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-genai"),
}


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall time of one call in milliseconds, percentiles over ``repeats`` timed calls."""

    p20_ms: float
    p50_ms: float
    p80_ms: float
    repeats: int


@dataclasses.dataclass
class Row:
    """One CSV row: one op, pass, provider and configuration, timed once.

    ``throughput`` is in ``throughput_unit`` (``"GB/s"`` or ``"TFLOP/s"``) at the p50 time, from
    the nominal bytes or flops the bench script counts for the op (the same for every provider).
    """

    op: str
    pass_: str  # "fwd", "bwd" or "fwd_bwd"
    provider: str
    config: str
    dtype: str
    timing: Timing
    throughput: float | None = None
    throughput_unit: str = ""
    notes: str = ""


COLUMNS = (
    "op",
    "pass",
    "provider",
    "config",
    "dtype",
    "time_p50_ms",
    "time_p20_ms",
    "time_p80_ms",
    "repeats",
    "throughput",
    "throughput_unit",
    "device",
    "versions",
    "commit",
    "timestamp",
    "notes",
)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The flags every bench script takes: --device, --quick/--full, --warmup, --repeats,
    --out-dir."""
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="small sweep (default on cpu): minutes on 2 cores"
    )
    size.add_argument("--full", action="store_true", help="the whole sweep (default on cuda)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per case")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="results directory (default: $RECSYS_BENCH_DIR or benchmarks/results)",
    )


def is_quick(args: argparse.Namespace) -> bool:
    """--quick or --full when given, else quick on CPU and full on CUDA."""
    if args.quick or args.full:
        return args.quick
    return torch.device(args.device).type != "cuda"


def resolve_device(name: str) -> torch.device:
    """``torch.device(name)``, with a clear error when CUDA is asked for but absent."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch {torch.__version__} sees no CUDA device")
    return device


def time_fn(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 3,
    repeats: int = 10,
    min_time_s: float = 0.5,
    max_repeats: int = 1000,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then timed ones until there are ``repeats`` of
    them and they took ``min_time_s`` in all (so fast calls get enough samples for stable
    percentiles), but never more than ``max_repeats``."""
    timings = time_fns(
        {"fn": fn},
        device,
        warmup=warmup,
        repeats=repeats,
        min_time_s=min_time_s,
        max_repeats=max_repeats,
    )
    return timings["fn"]


def time_fns(
    fns: Mapping[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int = 3,
    repeats: int = 10,
    min_time_s: float = 0.5,
    max_repeats: int = 1000,
    block: int = 1,
) -> dict[str, Timing]:
    """:func:`time_fn` for several callables (the providers of one case), interleaved: each
    round times every callable that still needs samples once, so a slow stretch of a shared
    machine falls on all providers alike instead of on whichever ran then.

    ``block`` > 1: each round runs ``block`` consecutive calls of a provider, the first untimed
    (it finds the caches holding the other provider's data), the rest timed: each call then
    runs warm, as the steps of a training run do, and the interleaving still spreads a slow
    stretch over all providers."""
    if repeats < 1 or block < 1:
        raise ValueError(f"repeats and block must be >= 1, got {repeats} and {block}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times_ms: dict[str, list[float]] = {name: [] for name in fns}

    def needs_more(samples: list[float]) -> bool:
        return len(samples) < repeats or (
            sum(samples) < min_time_s * 1e3 and len(samples) < max_repeats
        )

    while pending := [name for name, samples in times_ms.items() if needs_more(samples)]:
        for name in pending:
            if block > 1:
                fns[name]()
            for _ in range(max(1, block - 1)):
                times_ms[name].append(_time_once(fns[name], device))
    return {name: summarize(samples) for name, samples in times_ms.items()}


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of ``fn``: CUDA events on a GPU, perf_counter on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    fn()
    return (time.perf_counter() - start_s) * 1e3


def summarize(samples: list[float]) -> Timing:
    """p20 / p50 / p80 of ``samples`` (ms)."""
    ordered = sorted(samples)
    return Timing(
        p20_ms=_percentile(ordered, 0.2),
        p50_ms=_percentile(ordered, 0.5),
        p80_ms=_percentile(ordered, 0.8),
        repeats=len(ordered),
    )


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def gb_per_s(num_bytes: float, time_ms: float) -> float:
    return num_bytes / (time_ms * 1e-3) / 1e9


def tflop_per_s(num_flops: float, time_ms: float) -> float:
    return num_flops / (time_ms * 1e-3) / 1e12


def available_memory_bytes(device: torch.device) -> int:
    """Free memory where ``device``'s tensors live: the GPU's free memory, or the host's
    available RAM (psutil when installed, else all physical RAM, an overestimate)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
    except ImportError:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return psutil.virtual_memory().available


def zipf_ids(num_ids: int, num_rows: int, generator: torch.Generator) -> torch.Tensor:
    """``num_ids`` Zipf(1)-skewed int64 ids in [0, num_rows) on CPU: rank r drawn with
    P(r) ~ 1/(r+1), mapped to rows by a random permutation so the hot rows are spread over the
    table."""
    u = torch.rand(num_ids, generator=generator, dtype=torch.float64)
    rank = (torch.pow(num_rows + 1.0, u).floor().long() - 1).clamp_(0, num_rows - 1)
    return torch.randperm(num_rows, generator=generator)[rank]


def load_note() -> str:
    """The 1-minute load average against the core count: other work on a shared machine."""
    return f"load1={os.getloadavg()[0]:.2f}/{os.cpu_count()}cores"


def device_name(device: torch.device) -> str:
    """GPU name, or CPU model with its core count and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def versions() -> str:
    """``torch=... cuda=... triton=... torchrec=... fbgemm_gpu=...``; ``absent`` when not
    installed."""
    found = {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    for name, distributions in _DISTRIBUTIONS.items():
        found[name] = "absent"
        for distribution in distributions:
            try:
                found[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return " ".join(f"{name}={version}" for name, version in found.items())


def git_commit() -> str:
    """Short hash of HEAD, ``-dirty`` when anything outside benchmarks/results differs from it
    (untracked files included: an uncommitted bench script is not reproducible either);
    ``unknown`` without git. ``RECSYS_COMMIT`` overrides it, for a copy of the tree without
    ``.git`` (a GPU machine that receives the working tree, not the repository)."""
    if os.environ.get("RECSYS_COMMIT"):
        return os.environ["RECSYS_COMMIT"]
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        status = _git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if status else "")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def environment(device: torch.device) -> dict[str, str]:
    """The columns every row of one run shares: device, versions, commit, timestamp."""
    return {
        "device": device_name(device),
        "versions": versions(),
        "commit": git_commit(),
        "timestamp": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def results_dir(override: Path | None = None) -> Path:
    """``override``, else ``$RECSYS_BENCH_DIR``, else ``benchmarks/results``."""
    if override is not None:
        return Path(override)
    env = os.environ.get("RECSYS_BENCH_DIR")
    return Path(env) if env else DEFAULT_RESULTS_DIR


def append_csv(
    topic: str,
    columns: Sequence[str],
    lines: Sequence[Sequence[object]],
    out_dir: Path | None = None,
) -> Path:
    """Append ``lines`` (values in ``columns`` order) to ``<results dir>/<topic>.csv``, the
    header written when the file is new.

    Raises:
        ValueError: the file exists with other columns (move it aside; rows never mix schemas).
    """
    path = results_dir(out_dir) / f"{topic}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    new_file = not path.exists() or path.stat().st_size == 0
    if not new_file:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != tuple(columns):
            raise ValueError(
                f"{path} has columns {header}, this script writes {list(columns)}; "
                "move the old file aside"
            )
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new_file:
            writer.writerow(columns)
        writer.writerows(lines)
    return path


def write_rows(
    topic: str, rows: Sequence[Row], env: dict[str, str], out_dir: Path | None = None
) -> Path:
    """Append ``rows`` to ``<results dir>/<topic>.csv`` in the harness's :data:`COLUMNS`
    (see :func:`append_csv`)."""
    lines = [
        [
            row.op,
            row.pass_,
            row.provider,
            row.config,
            row.dtype,
            f"{row.timing.p50_ms:.4f}",
            f"{row.timing.p20_ms:.4f}",
            f"{row.timing.p80_ms:.4f}",
            row.timing.repeats,
            "" if row.throughput is None else f"{row.throughput:.3f}",
            row.throughput_unit,
            env["device"],
            env["versions"],
            env["commit"],
            env["timestamp"],
            row.notes,
        ]
        for row in rows
    ]
    return append_csv(topic, COLUMNS, lines, out_dir)


def format_table(header: Sequence[str], lines: Sequence[Sequence[object]]) -> str:
    """Left-aligned text table, columns as wide as their widest cell."""
    cells = [[str(c) for c in header]] + [[str(c) for c in line] for line in lines]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in text)
