"""Measure the current launch's cluster: ``recsys plan --calibrate FILE`` under torchrun.

Every rank times, at several sizes, an all-to-all in which it sends one block to one other rank
and receives one: its neighbour on its own node (the intra-node link) and, when the job spans
nodes, its counterpart on the next node (the inter-node link), and fits latency + bytes /
bandwidth to the medians (least squares); the slowest rank's fit is the one kept, since a
collective waits for its slowest member. It also times an all-reduce at the same sizes (written
to the file as a comment, for comparison with what the model derives from the links), rows
gathered at random from a table (memory bandwidth as lookups see it), a matrix product
(dense throughput) and a chain of tiny ops run forward and backward (the per-op floor, what an
op costs whatever its size: dispatch and autograd on a CPU, a launch on a GPU; timed over a
fifth of a second, so ranks that share cores share it as they do in a step). That chain run
by every rank at once against the first rank of each node alone, three times, gives how much
slower host work runs on a rank of the launch (``host_share``, the median: about the ranks per
CPU core, where they share them); rounds of the chain on the host's CPU, about 2 ms of it a
round each ended by an all-reduce as a step's pieces of work end at its collectives, give what
each collective costs beyond its latency when the ranks reach it at different times
(``sync_wait_us``: a round less ``host_share`` times its work, less the link's latency). Rank 0
writes the :class:`~recsys.distributed.topology.Topology` file. A launch on one node measures no
inter-node link: the file then repeats the intra-node figures for it, and says so.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from recsys.distributed.op_trace import trace_ops
from recsys.distributed.topology import Topology

__all__ = ["SIZES", "calibrate", "fit_link"]

SIZES = (2**10, 2**14, 2**18, 2**21)  # bytes one rank sends per collective


def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(GB/s, latency in microseconds) of ``seconds = latency + size / bandwidth``, fitted by
    least squares; a fit with no slope (a link faster than the timer) keeps the smallest time
    as latency and the largest size over the largest time as bandwidth."""
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / sxx
    if slope <= 0:
        return max(sizes) / max(seconds) / 1e9, min(seconds) * 1e6
    latency = max(mean_y - slope * mean_x, 0.0)
    return 1.0 / slope / 1e9, latency * 1e6


def _median_seconds(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _one_peer(size: int, peer_of: Callable[[int], int], device: torch.device):
    """An all-to-all in which each rank sends ``size`` bytes to ``peer_of(rank)`` only, and
    receives as much from the rank whose peer it is."""
    world, rank = dist.get_world_size(), dist.get_rank()
    words = max(size // 4, 1)
    send = torch.ones(words, device=device)
    recv = torch.empty(words, device=device)
    out_splits, in_splits = [0] * world, [0] * world
    out_splits[peer_of(rank)] = words
    in_splits[next(r for r in range(world) if peer_of(r) == rank)] = words

    def run() -> None:
        dist.all_to_all_single(recv, send, in_splits, out_splits)

    return run


def _link(peer_of: Callable[[int], int], device: torch.device, repeats: int) -> tuple[float, float]:
    """This link's fit, to the slowest rank's times (each size's maximum over ranks)."""
    times = [_median_seconds(_one_peer(s, peer_of, device), device, repeats) for s in SIZES]
    return fit_link(SIZES, _over_ranks(times, dist.ReduceOp.MAX, device))


def _allreduce_line(device: torch.device, repeats: int) -> str:
    cells = []
    for size in SIZES:
        tensor = torch.ones(max(size // 4, 1), device=device)
        seconds = _median_seconds(lambda t=tensor: dist.all_reduce(t), device, repeats)
        cells.append(f"{size} B {seconds * 1e6:.0f} us")
    return "# all-reduce (median): " + ", ".join(cells)


def _memory_gbs(device: torch.device, repeats: int) -> float:
    """Rows gathered at random from a 64 MiB table (rows of 64 fp32), as lookups read them:
    the bytes read and written per second."""
    table = torch.ones(2**18, 64, device=device)
    ids = torch.randint(0, table.shape[0], (2**16,), device=device)
    out = torch.empty(ids.numel(), 64, device=device)
    seconds = _median_seconds(lambda: torch.index_select(table, 0, ids, out=out), device, repeats)
    return 2 * out.numel() * 4 / seconds / 1e9


def _dense_tflops(device: torch.device, repeats: int) -> float:
    n = 1024
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    seconds = _median_seconds(lambda: torch.mm(a, b), device, repeats)
    return 2 * n**3 / seconds / 1e12


def _chain(device: torch.device) -> Callable[[], None]:
    """64 tiny ops forward and their backward: what an op costs whatever its size."""
    leaf = torch.ones(8, device=device, requires_grad=True)

    def chain() -> None:
        value = leaf
        for _ in range(64):
            value = value * 1.0001
        value.sum().backward()

    chain()  # warm-up
    return chain


def _chain_seconds(chain: Callable[[], None], device: torch.device, seconds: float) -> float:
    """Seconds per ``chain()``, run for ``seconds``."""
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        chain()
        runs += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / runs


def _op_us(device: torch.device, seconds: float = 0.2) -> float:
    """Microseconds per op of the tiny-op chain (:func:`_chain`), run for ``seconds``."""
    chain = _chain(device)
    return _chain_seconds(chain, device, seconds) / trace_ops(chain).ops * 1e6


def _over_ranks(values: Sequence[float], op, device: torch.device) -> list[float]:
    """``values`` reduced over the ranks with ``op`` (on ``device``: NCCL reduces CUDA
    tensors only)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _chain_alone(local: int, device: torch.device, seconds: float = 0.2) -> float:
    """Seconds of one per-op chain on the host's CPU, timed by the first rank of each node
    alone (the others asleep, not waiting in a collective, which may poll); the slowest."""
    chain = _chain(torch.device("cpu"))
    dist.barrier()
    if dist.get_rank() % local == 0:
        alone = _chain_seconds(chain, torch.device("cpu"), seconds)
    else:
        alone = 0.0
        time.sleep(2 * seconds)
    dist.barrier()
    return _over_ranks([alone], dist.ReduceOp.MAX, device)[0]


def _rounds_seconds(device: torch.device, chains: int, rounds: int) -> float:
    """Every rank runs ``chains`` per-op chains on the host's CPU and then all-reduces one
    value, ``rounds`` times: the mean seconds of a round (the ranks' mean)."""
    chain = _chain(torch.device("cpu"))
    flag = torch.zeros(1, device=device)

    def run() -> None:
        for _ in range(chains):
            chain()
        dist.all_reduce(flag)

    run()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mean = (time.perf_counter() - start) / rounds
    return _over_ranks([mean], dist.ReduceOp.SUM, device)[0] / dist.get_world_size()


def _share_once(local: int, device: torch.device, seconds: float = 0.2) -> float:
    """How many times longer a per-op chain takes on a rank with every rank of the launch
    running chains at once than in the first rank of each node alone: the ranks' mean."""
    alone = _chain_alone(local, device, seconds)
    chain = _chain(torch.device("cpu"))
    dist.barrier()
    mine = _chain_seconds(chain, torch.device("cpu"), seconds)
    together = _over_ranks([mine], dist.ReduceOp.SUM, device)[0] / dist.get_world_size()
    return together / alone


def _host_work(local: int, device: torch.device, latency_us: float) -> tuple[float, float]:
    """``host_share`` and ``sync_wait_us``: the median of three measures of how much slower
    host work runs with every rank busy (:func:`_share_once`, at least 1), then rounds of
    about 2 ms of the per-op chain (timed alone) each ended by an all-reduce, as a step's
    pieces of work end at its collectives: a round less ``host_share`` times its work, less
    the link's latency, is what a collective costs with ranks reaching it at different
    times (at least 0)."""
    share = max(1.0, statistics.median(_share_once(local, device) for _ in range(3)))
    chain_s = _chain_alone(local, device)
    chains = max(1, round(2e-3 / chain_s))
    rounds = _rounds_seconds(device, chains, 200)
    return share, max(0.0, (rounds - share * chains * chain_s) * 1e6 - latency_us)


def _memory_gib(device: torch.device, local: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages / local / 2**30  # the host's memory, shared by its ranks


def calibrate(device: torch.device, repeats: int = 5) -> tuple[Topology, list[str]]:
    """Measure this launch (see the module docstring): the topology, and comment lines of
    what was measured. Every rank must call it."""
    world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    local = local or world
    if world < 2:
        raise ValueError("calibration measures links between ranks: launch it with torchrun "
                         "--nproc-per-node=2 or more")  # fmt: skip
    if world % local:
        raise ValueError(f"LOCAL_WORLD_SIZE {local} does not divide WORLD_SIZE {world}")
    nodes = world // local
    if local > 1:  # the next rank of the same node
        intra = _link(lambda r: r - r % local + (r % local + 1) % local, device, repeats)
    else:
        intra = None
    inter = _link(lambda r: (r + local) % world, device, repeats) if nodes > 1 else None
    notes = [_allreduce_line(device, repeats)]
    if intra is None:
        intra = inter
        notes.append("# one rank per node: no intra-node link measured (inter-node figures)")
    if inter is None:
        inter = intra
        notes.append("# one node: no inter-node link measured (intra-node figures repeated)")
    memory = _memory_gbs(device, repeats)
    tflops = _dense_tflops(device, repeats)
    dist.barrier()
    op_us = _op_us(device)
    host_share, sync_wait = _host_work(local, device, (intra if nodes == 1 else inter)[1])
    figures = _over_ranks([memory, tflops, -op_us], dist.ReduceOp.MIN, device)  # the slowest
    backend = dist.get_backend()
    measured = Topology(
        name=f"calibrated ({backend}, {nodes} x {local} ranks, {device.type})",
        ranks_per_node=local,
        intra_gbs=intra[0],
        intra_latency_us=intra[1],
        inter_gbs=inter[0],
        inter_latency_us=inter[1],
        memory_gbs=float(figures[0]),
        memory_gib=_memory_gib(device, local),
        dense_tflops=float(figures[1]),
        source=f"recsys plan --calibrate: medians of {repeats} runs at {list(SIZES)} bytes",
        op_us=-float(figures[2]),
        host_share=host_share,
        sync_wait_us=sync_wait,
        device=device.type,
    )
    return measured, notes
