"""Benchmark recsys's FusedMLP against the torch MLP a user would write, eager and under
``torch.compile``, on DLRM's two MLPs.

MLPs (Criteo DLRM), at batch B in 2048, 16384, 65536 (``--full``; ``--quick``: 2048 only):

- ``bottom``: 13-512-256-128, ReLU after every layer; its input (the dense features) needs no
  gradient;
- ``top``: 479-1024-1024-512-256-1, ReLU after every layer but the last (logits); its input
  (the interaction output) gets a gradient.

Providers, every one with the same weights and inputs:

- ``recsys_auto``: ``recsys.models.layers.FusedMLP(backend="auto")``: the fused Triton kernels
  on CUDA, the plain-torch path on CPU;
- ``torch_eager``: ``nn.Sequential(nn.Linear, nn.ReLU, ..., nn.Linear)``;
- ``torch_compile``: ``torch.compile`` of that Sequential (default mode; compiled, forward and
  backward, before timing, after ``torch._dynamo.reset()`` so no case hits the recompile
  limit). A compile failure is reported and the provider skipped.

Passes: ``fwd`` (forward with autograd on, as in training) and ``fwd_bwd`` (forward + backward
of a fixed upstream gradient, parameter gradients set to None before each step). dtypes:
``fp32``, and ``bf16`` = fp32 parameters under ``torch.autocast(<device>, torch.bfloat16)``
(on CPU too). Before timing, each provider's forward is checked against ``torch_eager`` in
fp32.

Throughput: TFLOP/s from the nominal flops, 2 * B * sum(N_in * N_out) for ``fwd``, 3x that for
``fwd_bwd`` (the same count for every provider). The printed table gives each provider relative
to ``torch_compile`` (> 1: faster).

Run: ``python -m benchmarks.mlp [--device cuda] [--quick | --full] [--mlps bottom top]
[--batch-sizes B ...] [--dtypes fp32 bf16]``; rows go to ``benchmarks/results/mlp.csv`` (see
``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks._harness import (
    Row,
    add_common_args,
    environment,
    format_table,
    is_quick,
    load_note,
    resolve_device,
    tflop_per_s,
    time_fns,
    write_rows,
)
from recsys.models.layers import FusedMLP
from recsys.ops._triton import resolve_backend

TOPIC = "mlp"
PASSES = ("fwd", "fwd_bwd")
BASELINE = "torch_compile"
DTYPES = ("fp32", "bf16")
FULL_BATCHES = (2048, 16384, 65536)
QUICK_BATCHES = (2048,)
# Largest forward difference from torch_eager fp32, relative to max(1, max |output|).
CHECK_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


@dataclass(frozen=True)
class Shape:
    """One MLP: input width, layer widths, ReLU after the last layer, input needs a gradient."""

    in_features: int
    layer_sizes: tuple[int, ...]
    final_activation: bool
    input_grad: bool


MLPS = {
    "bottom": Shape(13, (512, 256, 128), final_activation=True, input_grad=False),
    "top": Shape(479, (1024, 1024, 512, 256, 1), final_activation=False, input_grad=True),
}


@dataclass(frozen=True)
class Case:
    mlp: str
    batch: int
    dtype: str

    @property
    def shape(self) -> Shape:
        return MLPS[self.mlp]

    @property
    def config(self) -> str:
        """The CSV ``config`` column."""
        shape = self.shape
        widths = "-".join(map(str, (shape.in_features, *shape.layer_sizes)))
        return (
            f"mlp={self.mlp} sizes={widths} batch={self.batch} "
            f"final_relu={'yes' if shape.final_activation else 'no'} "
            f"input_grad={'yes' if shape.input_grad else 'no'}"
        )

    def flops(self, pass_: str) -> float:
        shape = self.shape
        widths = (shape.in_features, *shape.layer_sizes)
        forward = 2 * self.batch * sum(a * b for a, b in itertools.pairwise(widths))
        return forward if pass_ == "fwd" else 3 * forward


def eager_mlp(fused: FusedMLP) -> nn.Sequential:
    """The nn.Sequential of Linear + ReLU a user would write, holding copies of fused's weights."""
    modules: list[nn.Module] = []
    last = len(fused.layers) - 1
    for i, layer in enumerate(fused.layers):
        linear = nn.Linear(layer.in_features, layer.out_features, device=layer.weight.device)
        linear.load_state_dict(layer.state_dict())
        modules.append(linear)
        if fused.final_activation or i < last:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def providers(
    case: Case, device: torch.device, generator: torch.Generator
) -> tuple[dict[str, dict[str, Callable[[], object]]], dict[str, str]]:
    """provider -> pass -> a callable running it once; and provider -> notes."""
    shape = case.shape
    torch.manual_seed(int(torch.randint(2**31 - 1, (), generator=generator)))
    fused = FusedMLP(
        shape.in_features, shape.layer_sizes, final_activation=shape.final_activation
    ).to(device)
    eager = eager_mlp(fused)
    x = torch.randn(case.batch, shape.in_features, generator=generator).to(device)
    x.requires_grad_(shape.input_grad)
    if case.dtype == "bf16":
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext()

    def run(model: nn.Module) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            with autocast:
                return model(x)  # [B, N_out]

        return forward

    backend = resolve_backend("auto", device, op="fused_linear", has_triton=True)
    notes = {
        "recsys_auto": f"FusedMLP backend=auto ({backend})",
        "torch_eager": "nn.Sequential(Linear, ReLU, ...)",
        "torch_compile": "torch.compile(nn.Sequential), default mode",
    }
    forwards = {"recsys_auto": run(fused), "torch_eager": run(eager)}
    parameters = {"recsys_auto": list(fused.parameters()), "torch_eager": list(eager.parameters())}
    with torch.no_grad():
        expected = eager(x).float()  # fp32, no autocast
    grad_out = torch.randn(expected.shape, generator=generator).to(device)
    if case.dtype == "bf16":
        grad_out = grad_out.bfloat16()
    torch._dynamo.reset()
    try:
        compiled = run(torch.compile(eager))
        compiled().backward(grad_out)
        forwards[BASELINE] = compiled
        parameters[BASELINE] = parameters["torch_eager"]
    except Exception as error:  # any compiler failure skips the provider, with the reason
        message = (str(error).strip().splitlines() or [""])[0]
        print(f"skip {BASELINE} for {case.config} {case.dtype}: {type(error).__name__}: {message}")

    tol = CHECK_TOLERANCE[case.dtype]
    scale = max(1.0, expected.abs().max().item())
    for name, forward in forwards.items():
        torch.testing.assert_close(
            forward().float(),
            expected,
            rtol=tol,
            atol=tol * scale,
            msg=lambda message, name=name: f"{name} differs from torch_eager fp32: {message}",
        )

    def passes(name: str) -> dict[str, Callable[[], object]]:
        forward, params = forwards[name], parameters[name]

        def fwd_bwd() -> None:
            for p in params:
                p.grad = None
            forward().backward(grad_out)

        return {"fwd": forward, "fwd_bwd": fwd_bwd}

    return {name: passes(name) for name in forwards}, notes


def select_cases(mlps: list[str], batches: tuple[int, ...], dtypes: list[str]) -> list[Case]:
    return [Case(mlp, b, dtype) for mlp in mlps for b in batches for dtype in dtypes]


def print_case(case: Case, rows: list[Row]) -> None:
    """One line per (pass, provider): p50, p20-p80, TFLOP/s and the speed relative to
    torch_compile."""
    baseline = {r.pass_: r.timing.p50_ms for r in rows if r.provider == BASELINE}
    lines = []
    for r in rows:
        base = baseline.get(r.pass_)
        lines.append(
            [
                r.pass_,
                r.provider,
                f"{r.timing.p50_ms:.3f}",
                f"{r.timing.p20_ms:.3f}-{r.timing.p80_ms:.3f}",
                f"{r.throughput:.3f}",
                f"{base / r.timing.p50_ms:.2f}x" if base else "-",
            ]
        )
    header = ["pass", "provider", "p50 ms", "p20-p80 ms", "TFLOP/s", f"vs {BASELINE}"]
    print(f"\n{case.config} {case.dtype}")
    print(format_table(header, lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--mlps", nargs="+", choices=list(MLPS), default=list(MLPS))
    parser.add_argument(
        "--batch-sizes", nargs="+", type=int, help="instead of the --quick / --full batches"
    )
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    batches = tuple(args.batch_sizes or (QUICK_BATCHES if quick else FULL_BATCHES))
    warmup = args.warmup if args.warmup is not None else (2 if quick else 10)
    repeats = args.repeats if args.repeats is not None else (5 if quick else 50)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    generator = torch.Generator().manual_seed(args.seed)

    num_rows = 0
    for case in select_cases(args.mlps, batches, args.dtypes):
        print(f"running {case.config} {case.dtype}", flush=True)
        timed, notes = providers(case, device, generator)
        fns = {(name, p): by_pass[p] for name, by_pass in timed.items() for p in PASSES}
        load = load_note()
        timings = time_fns(fns, device, warmup=warmup, repeats=repeats)
        del timed, fns
        gc.collect()
        rows = []
        base = {p: timings[(BASELINE, p)].p50_ms for p in PASSES if (BASELINE, p) in timings}
        for pass_ in PASSES:
            for (name, p), timing in timings.items():
                if p != pass_:
                    continue
                ratio = (
                    f"{base[pass_] / timing.p50_ms:.2f}x {BASELINE}"
                    if pass_ in base and name != BASELINE
                    else ""
                )
                autocast = "autocast bf16" if case.dtype == "bf16" else ""
                rows.append(
                    Row(
                        op=TOPIC,
                        pass_=pass_,
                        provider=name,
                        config=case.config,
                        dtype=case.dtype,
                        timing=timing,
                        throughput=tflop_per_s(case.flops(pass_), timing.p50_ms),
                        throughput_unit="TFLOP/s",
                        notes="; ".join(n for n in (notes[name], autocast, load, ratio) if n),
                    )
                )
        path = write_rows(TOPIC, rows, env, args.out_dir)
        num_rows += len(rows)
        print_case(case, rows)
    print(f"\n{num_rows} rows appended to {path}")


if __name__ == "__main__":
    main()
