"""Benchmark HSTU jagged attention (``recsys.ops.jagged.attention``) against the padded
formulations a user would write instead, on the same jagged batch.

Case: B sequences with Zipf-distributed lengths up to a maximum N (one sequence of length N,
the others ``min(N, zipf)``, P(r) ~ 1/r, so most are short, as user histories are), H heads of
width D, jagged q, k, v [sum n_b, H, D] plus offsets. Max lengths 64 .. 4096.

Providers, every one from the same jagged q, k, v to a jagged output (padding and unpadding
are part of the padded providers' cost, as in a model that keeps the jagged layout):

- ``recsys_jagged``: ``jagged_attention(backend="auto")``: the Triton kernels on CUDA (no
  [B, N, N] tensor); on CPU the op's torch path, which is itself a padded formulation (the
  interpreter is not a speed): CPU rows say so in their notes;
- ``torch_padded``: HSTU in eager PyTorch on the padded batch: pad to [B, H, N, D],
  ``silu(alpha q k^T) / N`` masked causally [B, H, N, N], times v, unpad;
- ``torch_sdpa``: ``F.scaled_dot_product_attention(is_causal=True)`` on the padded batch:
  softmax attention (other math, FlashAttention on CUDA), the transformer peer of the paper's
  comparison; for valid rows causal masking already hides the padding.

Passes: ``fwd`` (autograd on) and ``fwd_bwd`` (forward + gradients of q, k, v for a fixed
upstream gradient). Peak memory: on CUDA ``max_memory_allocated`` above the inputs during one
call; on CPU the running sum of the allocations and frees ``torch.profiler`` records during
one call (tensors torch allocates; no allocator caching on CPU). Throughput: TFLOP/s from the
causal flops of the *jagged* batch (2 matmuls x 2 sum n_b^2 / 2 H D forward, x3 with
backward), the same count for every provider, so padding shows up as lost throughput.

Run: ``python -m benchmarks.attention [--device cuda] [--quick | --full] [--max-lens 64 512]``;
rows go to ``benchmarks/results/attention.csv`` (the harness's columns plus ``peak_mem_mb``).
"""

from __future__ import annotations

import argparse
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks._harness import (
    COLUMNS,
    Row,
    add_common_args,
    append_csv,
    environment,
    format_table,
    is_quick,
    load_note,
    resolve_device,
    tflop_per_s,
    time_fns,
)
from recsys.ops.jagged.attention import jagged_attention

TOPIC = "attention"
CSV_COLUMNS = (
    *COLUMNS[: COLUMNS.index("device")],
    "peak_mem_mb",
    *COLUMNS[COLUMNS.index("device") :],
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROVIDERS = ("recsys_jagged", "torch_padded", "torch_sdpa")


@dataclass
class Case:
    max_len: int
    batch: int
    heads: int
    dim: int
    dtype: str

    @property
    def config(self) -> str:
        return f"B={self.batch} N={self.max_len} H={self.heads} D={self.dim} zipf"


def zipf_lengths(case: Case, generator: torch.Generator) -> torch.Tensor:
    """[B] lengths in 1 .. N, P(n) ~ 1/n, the first one N (so the padded batch is [B, N])."""
    u = torch.rand(case.batch, generator=generator, dtype=torch.float64)
    lengths = torch.pow(case.max_len + 1.0, u).floor().long().clamp(1, case.max_len)
    lengths[0] = case.max_len
    return lengths


def padded_hstu(q, k, v, offsets, max_len: int, alpha: float) -> torch.Tensor:
    """HSTU attention the eager way: pad, [B, H, N, N] weights, unpad."""
    lengths = offsets.diff()
    batch, total = lengths.numel(), q.shape[0]
    row = torch.repeat_interleave(torch.arange(batch, device=q.device), lengths, output_size=total)
    col = torch.arange(total, device=q.device) - offsets[:-1][row]

    def pad(x):  # [T, H, D] -> [B, H, N, D]
        padded = x.new_zeros(batch, max_len, *x.shape[1:]).index_put((row, col), x)
        return padded.transpose(1, 2)

    qp, kp, vp = pad(q), pad(k), pad(v)
    steps = torch.arange(max_len, device=q.device)
    mask = (steps[None, :, None] >= steps[None, None, :]) & (
        steps[None, None, :] < lengths[:, None, None]
    )  # [B, N, N]
    weights = F.silu(alpha * qp @ kp.transpose(2, 3)) * mask[:, None] / max_len
    return (weights @ vp).transpose(1, 2)[row, col]  # [T, H, D]


def padded_sdpa(q, k, v, offsets, max_len: int, alpha: float) -> torch.Tensor:
    """Softmax attention on the padded batch (``is_causal``), back to jagged rows."""
    lengths = offsets.diff()
    batch, total = lengths.numel(), q.shape[0]
    row = torch.repeat_interleave(torch.arange(batch, device=q.device), lengths, output_size=total)
    col = torch.arange(total, device=q.device) - offsets[:-1][row]

    def pad(x):
        padded = x.new_zeros(batch, max_len, *x.shape[1:]).index_put((row, col), x)
        return padded.transpose(1, 2)

    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=alpha)
    return out.transpose(1, 2)[row, col]


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Memory one call of ``fn`` allocates at its peak, above what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted(
        (event.time_range.start, event.self_cpu_memory_usage)
        for event in prof.events()
        if event.self_cpu_memory_usage
    )
    running = peak = 0
    for _, change in changes:
        running += change
        peak = max(peak, running)
    return peak / 2**20


def make_case(case: Case, device: torch.device, generator: torch.Generator):
    """Jagged q, k, v (requiring grad), offsets, the upstream gradient and the causal flops."""
    lengths = zipf_lengths(case, generator)
    total = int(lengths.sum())
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device)
    dtype = DTYPES[case.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()

    q, k, v = (randn(total, case.heads, case.dim) for _ in range(3))
    grad_out = torch.randn(total, case.heads, case.dim, generator=generator).to(device, dtype)
    pairs = float((lengths * (lengths + 1) // 2).sum())
    flops = 2 * 2 * pairs * case.heads * case.dim
    return (q, k, v), offsets, grad_out, flops


def providers(case: Case, device: torch.device, generator: torch.Generator):
    """provider -> pass -> callable, the jagged providers checked against each other, and the
    forward flops."""
    (q, k, v), offsets, grad_out, flops = make_case(case, device, generator)
    alpha = 1.0 / math.sqrt(case.dim)
    n = case.max_len
    functions: dict[str, Callable[[], torch.Tensor]] = {
        "recsys_jagged": lambda: jagged_attention(q, k, v, offsets, n, alpha=alpha, validate=False),
        "torch_padded": lambda: padded_hstu(q, k, v, offsets, n, alpha),
        "torch_sdpa": lambda: padded_sdpa(q, k, v, offsets, n, alpha),
    }
    for name, fn in list(functions.items()):
        try:  # a padded provider at N = 4096 may not fit a smaller GPU: skipped, with the reason
            torch.autograd.grad(fn(), (q, k, v), grad_out)
        except torch.OutOfMemoryError as error:
            print(f"skip {name} for {case.config}: out of memory ({str(error)[:80]})")
            del functions[name]
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if "torch_padded" in functions:
        want = functions["torch_padded"]().float()
        got = functions["recsys_jagged"]().float()
        tol = 1e-3 if case.dtype == "fp32" else 3e-2
        scale = max(1e-6, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)

    def passes(fn: Callable[[], torch.Tensor]) -> dict[str, Callable[[], object]]:
        return {
            "fwd": fn,
            "fwd_bwd": lambda: torch.autograd.grad(fn(), (q, k, v), grad_out),
        }

    return {name: passes(fn) for name, fn in functions.items()}, flops


def select_cases(quick: bool, device: torch.device, max_lens: list[int] | None) -> list[Case]:
    dtype = "bf16" if device.type == "cuda" else "fp32"
    if max_lens is None:
        max_lens = [64, 256] if quick else [64, 128, 256, 512, 1024, 2048, 4096]
    batch = 8 if quick else 64
    return [Case(n, batch, 4, 64, dtype) for n in max_lens]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--max-lens", type=int, nargs="+", default=None, help="N values")
    parser.add_argument("--batch", type=int, default=None, help="sequences per batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    quick = is_quick(args)
    warmup = args.warmup if args.warmup is not None else (2 if quick else 10)
    repeats = args.repeats if args.repeats is not None else (5 if quick else 30)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    generator = torch.Generator().manual_seed(args.seed)
    path_note = "triton kernels" if device.type == "cuda" else "CPU: the op's padded torch path"

    rows: list[tuple[Row, float]] = []
    for case in select_cases(quick, device, args.max_lens):
        if args.batch is not None:
            case.batch = args.batch
        load = load_note()
        timed, flops = providers(case, device, generator)
        for pass_ in ("fwd", "fwd_bwd"):
            fns = {name: by_pass[pass_] for name, by_pass in timed.items()}
            timings = time_fns(fns, device, warmup=warmup, repeats=repeats)
            work = flops if pass_ == "fwd" else 3 * flops
            for name, timing in timings.items():
                notes = load + (f"; {path_note}" if name == "recsys_jagged" else "")
                if name == "torch_sdpa":
                    notes += "; softmax attention (other math)"
                row = Row(
                    op="hstu_attention",
                    pass_=pass_,
                    provider=name,
                    config=case.config,
                    dtype=case.dtype,
                    timing=timing,
                    throughput=tflop_per_s(work, timing.p50_ms),
                    throughput_unit="TFLOP/s",
                    notes=notes,
                )
                rows.append((row, peak_memory_mb(fns[name], device)))
        del timed
        gc.collect()
        print(f"done {case.config} {case.dtype}", flush=True)

    lines = [
        [
            row.pass_,
            row.config,
            row.dtype,
            row.provider,
            f"{row.timing.p50_ms:.3f}",
            f"{row.throughput:.4f}",
            f"{peak:.1f}",
        ]
        for row, peak in rows
    ]
    header = ["pass", "config", "dtype", "provider", "p50 ms", "TFLOP/s", "peak MiB"]
    print(format_table(header, lines))
    csv_lines = [
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
            f"{row.throughput:.4f}",
            row.throughput_unit,
            f"{peak:.2f}",
            env["device"],
            env["versions"],
            env["commit"],
            env["timestamp"],
            row.notes,
        ]
        for row, peak in rows
    ]
    path = append_csv(TOPIC, CSV_COLUMNS, csv_lines, args.out_dir)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
