"""Benchmark the feature-interaction ops against the torch code a user would write instead,
eager and under ``torch.compile``.

Ops and shapes (DLRM / DLRM-DCNv2, Criteo-shaped):

- ``dot_interaction``: dense x [B, D] and pooled embeddings [B, F, D], F = 27, D = 128,
  output [x | 378 strict-lower-triangle dot products] (TorchRec's pair order, no padding);
- ``cross_layer``: one full-rank DCN-v2 layer x0 * (W xl + b) + xl at width D_in;
- ``cross_layer_low_rank``: one low-rank layer x0 * (U (V xl) + b) + xl, rank r;
- ``cross_layer_vector``: one DCN-v1 layer x0 * (xl . w) + b + xl.

The cross layers run at MLPerf DLRM-DCNv2's interaction width, D_in = 27 * 128 = 3456 (the bottom
MLP's output and 26 embeddings, concatenated), with its rank r = 512.

Providers, every one on the same inputs:

- ``recsys_auto``: the recsys op with ``backend="auto"`` (Triton on CUDA, the torch path on CPU;
  the cross layers' torch path on CUDA too, which measured faster there);
- ``recsys_triton`` (CUDA, cross layers): the op with ``backend="triton"``, so a GPU run keeps
  measuring the kernels ``auto`` no longer picks;
- ``torch_eager``: the plain torch code a user would write: for the dot interaction TorchRec's
  ``InteractionArch`` forward (cat, bmm, gather of the upper triangle, cat); for the cross layers
  ``F.linear`` and the elementwise expression;
- ``torch_compile``: ``torch.compile`` of that same function (default mode; compiled once per
  case before timing). A compile failure is reported and the provider skipped.

Passes: ``fwd`` (forward with autograd on, as in training) and ``fwd_bwd`` (forward + backward
of a fixed upstream gradient into every input and parameter). dtypes: ``fp32``, and ``bf16``
inputs and parameters (not autocast: every provider gets the same bf16 tensors).

Throughput: GB/s for the dot interaction (bytes of the inputs read and the output written; for
fwd_bwd also the upstream gradient read, the inputs read again and their gradients written),
TFLOP/s for the cross layers (2 * B * D_in * D_in per full-rank layer, 4 * B * D_in * r low rank,
4 * B * D_in vector; x3 for fwd_bwd). The printed table gives each provider relative to
``torch_eager`` and ``torch_compile`` (> 1: faster).

Run: ``python -m benchmarks.interaction [--device cuda] [--quick | --full] [--ops NAME ...]``;
rows go to ``benchmarks/results/interaction.csv`` (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks._harness import (
    Row,
    add_common_args,
    environment,
    format_table,
    gb_per_s,
    is_quick,
    load_note,
    resolve_device,
    tflop_per_s,
    time_fns,
    write_rows,
)
from recsys.ops.interaction.cross import cross_layer, cross_layer_low_rank, cross_layer_vector
from recsys.ops.interaction.dot import dot_interaction

TOPIC = "interaction"
NUM_FEATURES = 27
EMBEDDING_DIM = 128
CROSS_WIDTH = 128 * 27
CROSS_RANK = 512
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = ("dot_interaction", "cross_layer", "cross_layer_low_rank", "cross_layer_vector")


def torchrec_interaction(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """TorchRec ``InteractionArch.forward`` (torchrec/models/dlrm.py), verbatim in effect."""
    B, D = dense.shape
    combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)  # [B, N, D]
    N = combined.shape[1]
    interactions = torch.bmm(combined, torch.transpose(combined, 1, 2))  # [B, N, N]
    rows, cols = torch.triu_indices(N, N, offset=1, device=dense.device)
    return torch.cat((dense, interactions[:, rows, cols]), dim=1)


def cross_eager(x0, xl, weight, bias):
    return x0 * F.linear(xl, weight, bias) + xl


def cross_low_rank_eager(x0, xl, u_weight, v_weight, bias):
    return x0 * F.linear(F.linear(xl, v_weight), u_weight, bias) + xl


def cross_vector_eager(x0, xl, weight, bias):
    return x0 * (xl @ weight).unsqueeze(1) + bias + xl


@dataclass
class Case:
    op: str
    batch: int
    dtype: str

    @property
    def config(self) -> str:
        if self.op == "dot_interaction":
            return f"B={self.batch} F={NUM_FEATURES} D={EMBEDDING_DIM}"
        rank = f" r={CROSS_RANK}" if self.op == "cross_layer_low_rank" else ""
        return f"B={self.batch} D_in={CROSS_WIDTH}{rank}"


def make_inputs(case: Case, device: torch.device, generator: torch.Generator):
    """The op's tensor arguments (all requiring grad) and its (recsys, eager) functions."""
    dtype = DTYPES[case.dtype]

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=generator) * scale
        return t.to(device=device, dtype=dtype).requires_grad_()

    B = case.batch
    if case.op == "dot_interaction":
        args = (randn(B, EMBEDDING_DIM), randn(B, NUM_FEATURES, EMBEDDING_DIM))
        return args, dot_interaction, torchrec_interaction
    D, r = CROSS_WIDTH, CROSS_RANK
    if case.op == "cross_layer":
        args = (randn(B, D), randn(B, D), randn(D, D, scale=D**-0.5), randn(D, scale=0.1))
        return args, cross_layer, cross_eager
    if case.op == "cross_layer_low_rank":
        args = (
            randn(B, D),
            randn(B, D),
            randn(D, r, scale=r**-0.5),
            randn(r, D, scale=D**-0.5),
            randn(D, scale=0.1),
        )
        return args, cross_layer_low_rank, cross_low_rank_eager
    args = (randn(B, D), randn(B, D), randn(D, scale=D**-0.5), randn(D, scale=0.1))
    return args, cross_layer_vector, cross_vector_eager


def nominal_work(case: Case, pass_: str) -> tuple[float, str]:
    """Bytes (dot interaction) or flops (cross layers) one call moves or does, and the unit."""
    size = 2 if case.dtype == "bf16" else 4
    B = case.batch
    if case.op == "dot_interaction":
        N, D = NUM_FEATURES + 1, EMBEDDING_DIM
        inputs = B * N * D * size
        output = B * (D + N * (N - 1) // 2) * size
        total = inputs + output if pass_ == "fwd" else 3 * inputs + 2 * output
        return total, "GB/s"
    D, r = CROSS_WIDTH, CROSS_RANK
    flops = {"cross_layer": 2 * B * D * D, "cross_layer_low_rank": 4 * B * D * r}.get(
        case.op, 4 * B * D
    )
    return (flops if pass_ == "fwd" else 3 * flops), "TFLOP/s"


def providers(
    case: Case, device: torch.device, generator: torch.Generator
) -> dict[str, dict[str, Callable[[], object]]]:
    """provider -> pass -> a callable running it once."""
    args, recsys_fn, eager_fn = make_inputs(case, device, generator)
    functions: dict[str, Callable[..., torch.Tensor]] = {
        "recsys_auto": recsys_fn,
        "torch_eager": eager_fn,
    }
    if device.type == "cuda" and case.op.startswith("cross_layer"):
        functions["recsys_triton"] = functools.partial(recsys_fn, backend="triton")
    try:
        compiled = torch.compile(eager_fn)
        out = compiled(*args)
        out.backward(torch.ones_like(out))
        functions["torch_compile"] = compiled
    except Exception as error:  # any compiler failure skips the provider, with the reason
        print(f"skip torch_compile for {case.op} {case.config}: {type(error).__name__}: {error}")
    expected = eager_fn(*args)
    grad_out = torch.randn(expected.shape, generator=generator).to(device, expected.dtype)
    for name, fn in functions.items():
        got = fn(*args)
        tol = 1e-3 if case.dtype == "fp32" else 5e-2
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * scale, msg=name)

    def passes(fn: Callable[..., torch.Tensor]) -> dict[str, Callable[[], object]]:
        def fwd() -> object:
            return fn(*args)

        def fwd_bwd() -> object:
            return torch.autograd.grad(fn(*args), args, grad_out)

        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    return {name: passes(fn) for name, fn in functions.items()}


def select_cases(ops: list[str], quick: bool, device: torch.device) -> list[Case]:
    if quick:
        batches = {op: (2048,) for op in OPS}
        batches["cross_layer"] = (512,)  # 3456^2 fp32 GEMMs take ~1 s per call on 2 CPU cores
    else:
        batches = {op: (2048, 16384, 65536) for op in OPS}
    return [
        Case(op, batch, dtype) for op in ops for batch in batches[op] for dtype in ("fp32", "bf16")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    warmup = args.warmup if args.warmup is not None else (2 if quick else 10)
    repeats = args.repeats if args.repeats is not None else (5 if quick else 50)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    generator = torch.Generator().manual_seed(args.seed)

    rows: list[Row] = []
    for case in select_cases(args.ops, quick, device):
        load = load_note()
        timed = providers(case, device, generator)
        for pass_ in ("fwd", "fwd_bwd"):
            fns = {name: by_pass[pass_] for name, by_pass in timed.items()}
            timings = time_fns(fns, device, warmup=warmup, repeats=repeats)
            work, unit = nominal_work(case, pass_)
            rate = gb_per_s if unit == "GB/s" else tflop_per_s
            for name, timing in timings.items():
                rows.append(
                    Row(
                        op=case.op,
                        pass_=pass_,
                        provider=name,
                        config=case.config,
                        dtype=case.dtype,
                        timing=timing,
                        throughput=rate(work, timing.p50_ms),
                        throughput_unit=unit,
                        notes=load,
                    )
                )
        del timed
        gc.collect()
        print(f"done {case.op} {case.config} {case.dtype}", flush=True)

    def p50(row: Row, provider: str) -> float | None:
        for other in rows:
            key = (other.op, other.pass_, other.config, other.dtype, other.provider)
            if key == (row.op, row.pass_, row.config, row.dtype, provider):
                return other.timing.p50_ms
        return None

    lines = []
    for row in rows:
        ratios = []
        for peer in ("torch_eager", "torch_compile"):
            peer_ms = p50(row, peer)
            ratio = f"{peer_ms / row.timing.p50_ms:.2f}x" if peer_ms else "-"
            ratios.append(ratio)
            if peer_ms and row.provider != peer:
                row.notes += f"; {peer_ms / row.timing.p50_ms:.2f}x {peer}"
        lines.append(
            [
                row.op,
                row.pass_,
                row.config,
                row.dtype,
                row.provider,
                f"{row.timing.p50_ms:.3f}",
                f"{row.throughput:.2f} {row.throughput_unit}",
                *ratios,
            ]
        )
    header = ["op", "pass", "config", "dtype", "provider", "p50 ms", "throughput"]
    print(format_table([*header, "vs eager", "vs compile"], lines))
    path = write_rows(TOPIC, rows, env, args.out_dir)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
