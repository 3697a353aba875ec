"""What the cluster is made of, for the step cost model (:mod:`recsys.distributed.step_cost`)
and ``recsys plan``: ranks per node, the bandwidth and latency of a byte sent inside a node
and across nodes, the device's memory bandwidth and size, and its dense compute rate.

A :class:`Topology` comes from a preset (:data:`PRESETS`, figures from the vendors' data
sheets, each preset naming its sources), from a TOML file (:func:`load_topology`; what
``recsys plan --calibrate`` writes from measurements of the current launch), or from both: a
file may name a preset and override some of its figures.

Bandwidths are per rank and per direction, in GB/s (10^9 bytes): what one rank can send while
it receives as much. Inside a node that is the rank's share of the node's fabric (NVLink), across
nodes its network adapter. A data sheet figure is a peak; a calibrated one is what this
launch's collectives reached, which is the one to trust for a prediction.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from recsys._files import write_text_atomic
from recsys._suggest import did_you_mean

__all__ = ["PRESETS", "Topology", "load_topology", "save_topology", "topology"]


@dataclass(frozen=True)
class Topology:
    """A cluster's figures (see the module docstring for units and meaning).

    Attributes:
        name: a preset's name, or what a calibration measured.
        ranks_per_node: ranks (devices) per node; ranks ``n * ranks_per_node ..`` share node n.
        intra_gbs / intra_latency_us: a byte between two ranks of one node: per rank and
            direction GB/s, and the fixed cost of one collective in microseconds.
        inter_gbs / inter_latency_us: the same between ranks of different nodes.
        memory_gbs: the device's memory bandwidth (lookups and optimizer updates).
        memory_gib: the device's memory, GiB (the default memory limit per rank).
        dense_tflops: dense matrix throughput (TFLOP/s) in bf16 / fp16 (a GPU's tensor cores).
        source: where the figures come from.
        dense_fp32_tflops: the same in IEEE fp32, what ``train.precision = "fp32"`` runs at
            (torch keeps TF32 off by default); 0: ``dense_tflops`` (a calibrated topology
            measured the precision it ran, fp32). A file or override that starts from a preset
            and sets ``dense_tflops`` keeps the preset's fp32 rate unless it sets this too.
        op_us: the least time one op of a step takes, in microseconds, whatever its size: a
            kernel's launch on a GPU, an op's dispatch on a CPU (0: none).
        host_share: how many times longer host work (the data loader's) takes on a rank of
            the launch, all ranks busy at once, than in one process alone: above 1 where ranks
            share CPU cores (1: each rank has its own; presets).
        sync_wait_us: how long a rank waits at each collective of a step for the others, on
            top of its latency, in microseconds: ranks that share CPU cores finish their work
            between two collectives at different times (0: none; presets).
        device: the device type a calibration measured (``"cpu"`` / ``"cuda"``); empty for a
            preset and its overrides (figures of no host at hand).
    """

    name: str
    ranks_per_node: int
    intra_gbs: float
    intra_latency_us: float
    inter_gbs: float
    inter_latency_us: float
    memory_gbs: float
    memory_gib: float
    dense_tflops: float
    source: str = ""
    dense_fp32_tflops: float = 0.0
    op_us: float = 0.0
    host_share: float = 1.0
    sync_wait_us: float = 0.0
    device: str = ""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"topology {self.name!r}: ranks_per_node {self.ranks_per_node}")
        for name in ("intra_gbs", "inter_gbs", "memory_gbs", "memory_gib", "dense_tflops"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"topology {self.name!r}: {name} = {value!r}; expected > 0")
        for name in ("intra_latency_us", "inter_latency_us", "dense_fp32_tflops", "op_us",
                     "sync_wait_us"):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"topology {self.name!r}: {name} = {value!r}; expected >= 0")
        share = self.host_share
        if not (isinstance(share, int | float) and share >= 1 and math.isfinite(share)):
            raise ValueError(f"topology {self.name!r}: host_share = {share!r}; expected >= 1")

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def dense_rate(self, precision: str) -> float:
        """Dense matrix throughput (TFLOP/s) of a model trained in ``precision``
        (``train.precision``: fp32, bf16 or fp16)."""
        if precision == "fp32" and self.dense_fp32_tflops > 0:
            return self.dense_fp32_tflops
        return self.dense_tflops

    def describe(self) -> str:
        """One line of the figures a prediction used."""
        return (
            f"{self.name}: {self.ranks_per_node} ranks per node, intra-node "
            f"{self.intra_gbs:g} GB/s + {self.intra_latency_us:g} us, inter-node "
            f"{self.inter_gbs:g} GB/s + {self.inter_latency_us:g} us per rank and direction, "
            f"memory {self.memory_gbs:g} GB/s, {self.memory_gib:g} GiB, dense "
            f"{self.dense_tflops:g} TFLOP/s"
            + (f" (fp32 {self.dense_fp32_tflops:g})" if self.dense_fp32_tflops else "")
            + (f", {self.op_us:g} us per op" if self.op_us else "")
            + (f", host work {self.host_share:.3g}x slower" if self.host_share != 1 else "")
            + (f", {self.sync_wait_us:.4g} us waiting per collective" if self.sync_wait_us else "")
        )


_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU data sheet (SXM5: 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s "
    "bidirectional = 450 GB/s per direction, 989 dense BF16 TFLOP/s, 67 FP32); NVIDIA DGX H100 "
    "user guide (8 GPUs, one ConnectX-7 400 Gb/s = 50 GB/s InfiniBand port per GPU); "
    "latencies and the 5 us per op are assumptions, not published figures"
)
_H200_SOURCE = (
    "NVIDIA H200 Tensor Core GPU data sheet (SXM: 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s "
    "bidirectional, 989 dense BF16 TFLOP/s, 67 FP32); NVIDIA DGX H200 (8 GPUs, 400 Gb/s "
    "ConnectX-7 per GPU); latencies and the 5 us per op are assumptions, not published figures"
)
_A100_SOURCE = (
    "NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB: 2,039 GB/s HBM2e, NVLink 600 GB/s "
    "bidirectional = 300 GB/s per direction, 312 dense BF16 TFLOP/s, 19.5 FP32); NVIDIA DGX "
    "A100 user guide (8 GPUs, one ConnectX-6 200 Gb/s = 25 GB/s HDR InfiniBand port per "
    "GPU); latencies and the 5 us per op are assumptions, not published figures"
)

PRESETS: dict[str, Topology] = {
    "h100_8x_ib400": Topology(
        "h100_8x_ib400", 8, 450.0, 5.0, 50.0, 10.0, 3350.0, 80.0, 989.0, _H100_SOURCE, 67.0, 5.0
    ),
    "h200_8x_ib400": Topology(
        "h200_8x_ib400", 8, 450.0, 5.0, 50.0, 10.0, 4800.0, 141.0, 989.0, _H200_SOURCE, 67.0, 5.0
    ),
    "a100_8x_ib200": Topology(
        "a100_8x_ib200", 8, 300.0, 5.0, 25.0, 10.0, 2039.0, 80.0, 312.0, _A100_SOURCE, 19.5, 5.0
    ),
    # A host of CPU ranks under gloo: loopback TCP inside the host, 25 GbE across hosts.
    # Rough figures of a small cloud VM; calibrate (recsys plan --calibrate) before trusting
    # a prediction made from them.
    "cpu_host": Topology(
        "cpu_host",
        2,
        1.0,
        100.0,
        3.125,
        200.0,
        10.0,
        16.0,
        0.05,
        "assumptions for a small CPU host (gloo over loopback TCP, 25 GbE = 3.125 GB/s between "
        "hosts, 5 us per op); calibrate",
        op_us=5.0,
    ),
}

_FIELDS = {f.name for f in fields(Topology)}


def topology(
    preset: str = "", path: str | Path = "", ranks_per_node: int = 0, **overrides: float
) -> Topology:
    """A preset, or a topology file (which may itself start from a preset), with
    ``ranks_per_node`` (0: the preset's or file's) and any figure overridden.

    Raises:
        ValueError: an unknown preset or figure, a bad value, or both a preset and a file.
    """
    if preset and path:
        raise ValueError(f"a hardware preset ({preset!r}) or a topology file ('{path}'), not both")
    if path:
        base = load_topology(path)
    else:
        name = preset or "h100_8x_ib400"
        if name not in PRESETS:
            raise ValueError(
                f"hardware preset {name!r}{did_you_mean(name, PRESETS)}; the presets are "
                f"{', '.join(PRESETS)}"
            )
        base = PRESETS[name]
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        raise ValueError(f"topology figures {unknown} unknown; expected some of {sorted(_FIELDS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    if ranks_per_node:
        changes["ranks_per_node"] = ranks_per_node
    return replace(base, **changes) if changes else base


def load_topology(path: str | Path) -> Topology:
    """A topology TOML file: its figures (see :class:`Topology`), all of them, or
    ``preset = "<name>"`` and the figures that differ from that preset.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unreadable TOML, an unknown key or preset, or a missing or bad figure.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"topology file '{path}' not found")
    try:
        values = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"topology file '{path}' is not valid TOML: {error}") from None
    preset = values.pop("preset", "")
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        hint = did_you_mean(unknown[0], _FIELDS)
        raise ValueError(f"topology file '{path}': unknown keys {unknown}{hint}")
    if preset:
        if preset not in PRESETS:
            raise ValueError(
                f"topology file '{path}': preset {preset!r}{did_you_mean(preset, PRESETS)}; "
                f"the presets are {', '.join(PRESETS)}"
            )
        return replace(PRESETS[preset], **values)
    optional = {"source", "dense_fp32_tflops", "op_us", "host_share", "sync_wait_us", "device"}
    missing = sorted(_FIELDS - optional - set(values))
    if missing:
        raise ValueError(f"topology file '{path}' lacks {missing} (or a preset to start from)")
    return Topology(**values)


def save_topology(value: Topology, path: str | Path, notes: Sequence[str] = ()) -> None:
    """Write ``value`` as a topology TOML file (atomically), readable by :func:`load_topology`,
    after ``notes`` (comment lines, each starting with ``#``)."""
    lines = list(notes)
    for key, item in asdict(value).items():
        lines.append(f"{key} = {_toml_value(item)}")
    write_text_atomic(Path(path), "\n".join(lines) + "\n")


def _toml_value(item: object) -> str:
    if isinstance(item, str):
        return '"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(item, float):
        return repr(item)
    return str(item)
