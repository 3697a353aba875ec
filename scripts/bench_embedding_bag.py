"""Benchmark the multi-table pooled embedding lookup against the peers a user would pick instead.

Providers, all on the same tables (same weights) and the same ids in one run:

- ``recsys_torch``: ``recsys.EmbeddingBagCollection(backend="torch")``, default validation on;
- ``recsys_torch_noval``: the same with ``validate=False`` (the validation pass costs this much);
- ``recsys_triton``: ``backend="triton"``, CUDA only, skipped while the op has no kernels;
- ``torchrec``: the unsharded ``torchrec.EmbeddingBagCollection`` (one nn.EmbeddingBag per table);
- ``fbgemm_tbe``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU: HOST placement on
  ComputeDevice.CPU; CUDA: DEVICE), fp32 weights, EXACT_SGD. Its backward applies the SGD
  update in place and builds no gradient tensor; the others build dense table gradients, freed
  after each step (``param.grad = None``, as ``optimizer.zero_grad()`` does).

Cases: 26 tables (Criteo-like) with 1e3..1e6 rows (log-spaced), one dim D for all tables, batch
B, bags one-hot or multi-hot (lengths uniform in 0..16, mean 8, some empty), ids Zipf(1)-skewed
with hot rows scattered over each table. Every provider's output is checked against a float64
reference before it is timed. ``fwd`` is the forward with autograd on (as in training);
``fwd_bwd`` is forward + backward of a fixed upstream gradient.

Throughput is nominal bytes / p50 time, the same count for every provider: forward reads the ids,
offsets and L*D table elements and writes B*sum(D) outputs; backward adds reading the upstream
gradient and writing L*D row gradients. A dense gradient's zero fill is not counted.

Run: ``python scripts/bench_embedding_bag.py [--device cuda] [--quick | --full]``; rows go to
``benchmarks/results/embedding_bag.csv`` (see ``scripts/_harness.py``).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _harness import (
    Row,
    add_common_args,
    environment,
    format_table,
    gb_per_s,
    is_quick,
    resolve_device,
    time_fns,
    write_rows,
)

logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

try:
    import torchrec
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    TORCHREC_MISSING = ""
except ImportError as error:
    TORCHREC_MISSING = f"torchrec does not import ({error})"

try:
    from recsys import EmbeddingBagCollection as RecsysEBC

    RECSYS_MISSING = ""
except ImportError as error:
    RECSYS_MISSING = f"recsys does not import ({error})"

NUM_TABLES = 26
MIN_ROWS, MAX_ROWS = 1_000, 1_000_000
MAX_BAG = 16  # multi-hot lengths are uniform in [0, MAX_BAG]: pooling factor 8
ROWS_NOTE = "rows=1e3..1e6"
IDS_NOTE = "ids=zipf1"
TOPIC = "embedding_bag"
DTYPE = torch.float32


@dataclass
class Inputs:
    """One batch in KJT layout (key-major), plus its KJT when torchrec imports."""

    values: torch.Tensor  # [L] int64
    lengths: torch.Tensor  # [T*B] int64
    offsets: torch.Tensor  # [T*B + 1] int64
    batch_size: int
    kjt: object | None  # torchrec.KeyedJaggedTensor


def table_rows() -> list[int]:
    """Log-spaced table sizes from MIN_ROWS to MAX_ROWS."""
    ratio = (MAX_ROWS / MIN_ROWS) ** (1 / (NUM_TABLES - 1))
    return [round(MIN_ROWS * ratio**t) for t in range(NUM_TABLES)]


def make_inputs(
    rows: list[int],
    batch_size: int,
    multi_hot: bool,
    device: torch.device,
    generator: torch.Generator,
) -> Inputs:
    """Zipf(1) ids: rank r in [0, N) with P(r) ~ 1/(r+1), mapped to rows by a random
    permutation of the table so the hot rows are spread over it."""
    B = batch_size
    if multi_hot:
        lengths = torch.randint(0, MAX_BAG + 1, (len(rows) * B,), generator=generator)
    else:
        lengths = torch.ones(len(rows) * B, dtype=torch.int64)
    per_table = lengths.view(len(rows), B).sum(dim=1).tolist()
    values = []
    for num_rows, num_ids in zip(rows, per_table, strict=True):
        u = torch.rand(num_ids, generator=generator, dtype=torch.float64)
        rank = (torch.pow(num_rows + 1.0, u).floor().long() - 1).clamp_(0, num_rows - 1)
        values.append(torch.randperm(num_rows, generator=generator)[rank])
    values = torch.cat(values).to(device)  # [L]
    lengths = lengths.to(device)  # [T*B]
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(lengths, dim=0)  # [T*B + 1]
    kjt = None
    if not TORCHREC_MISSING:
        kjt = KeyedJaggedTensor(
            keys=[f"cat_{t}" for t in range(len(rows))],
            values=values,
            lengths=lengths,
            offsets=offsets,
        )
    return Inputs(values, lengths, offsets, B, kjt)


def reference(weights: list[torch.Tensor], inputs: Inputs) -> torch.Tensor:
    """Sum pooling in float64, one table at a time: [B, T*D]."""
    B = inputs.batch_size
    bounds = inputs.offsets[::B].tolist()  # start of each table's ids, and the end
    pooled = []
    for t, weight in enumerate(weights):
        ids = inputs.values[bounds[t] : bounds[t + 1]]
        bag = torch.repeat_interleave(
            torch.arange(B, device=ids.device), inputs.lengths[t * B : (t + 1) * B]
        )
        sums = torch.zeros(B, weight.shape[1], dtype=torch.float64, device=ids.device)
        pooled.append(sums.index_add_(0, bag, weight[ids].double()))  # [B, D]
    return torch.cat(pooled, dim=1)


def tables(rows: list[int], dim: int) -> list:
    return [
        EmbeddingBagConfig(
            name=f"t_cat_{t}", embedding_dim=dim, num_embeddings=n, feature_names=[f"cat_{t}"]
        )
        for t, n in enumerate(rows)
    ]


@dataclass
class Provider:
    name: str
    forward: Callable[[Inputs], torch.Tensor]  # -> [B, T*D]
    params: list[torch.Tensor]  # cleared to grad=None before each fwd_bwd step
    notes: str
    reload: Callable[[], None] = lambda: None  # restores the weights an in-place update changed


def build_providers(
    weights: list[torch.Tensor], dim: int, device: torch.device
) -> tuple[list[Provider], list[str]]:
    """Every provider that loads, holding a copy of ``weights``; and why the others were
    skipped."""
    rows = [w.shape[0] for w in weights]
    providers, skipped = [], []
    state = {f"embedding_bags.t_cat_{t}.weight": w for t, w in enumerate(weights)}

    def recsys(name: str, backend: str, validate: bool, notes: str) -> None:
        if RECSYS_MISSING:
            skipped.append(f"{name}: {RECSYS_MISSING}")
            return
        ebc = RecsysEBC(tables(rows, dim), device=device, backend=backend, validate=validate)
        ebc.load_state_dict(state)
        try:  # a backend that cannot run here (no kernels yet, no GPU) raises on first use
            ebc(make_inputs([1] * len(rows), 1, False, device, torch.Generator()).kjt)
        except (ValueError, NotImplementedError, RuntimeError) as error:
            skipped.append(f"{name}: {type(error).__name__}: {error}")
            return
        providers.append(
            Provider(name, lambda x: ebc(x.kjt).values(), list(ebc.parameters()), notes)
        )

    recsys("recsys_torch", "torch", True, "dense table grads; validate=True (default)")
    recsys("recsys_torch_noval", "torch", False, "dense table grads; validate=False")
    if device.type == "cuda":
        recsys("recsys_triton", "triton", False, "validate=False")
    else:
        skipped.append("recsys_triton: on CPU Triton only runs interpreted; not timed")

    if TORCHREC_MISSING:
        skipped.append(f"torchrec: {TORCHREC_MISSING}")
    else:
        ebc = torchrec.EmbeddingBagCollection(tables(rows, dim), device=device)
        ebc.load_state_dict(state)
        providers.append(
            Provider(
                "torchrec", lambda x: ebc(x.kjt).values(), list(ebc.parameters()), "dense grads"
            )
        )

    try:
        providers.append(fbgemm_provider(weights, device))
    except Exception as error:  # any failure to import, build or run means "not available"
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        skipped.append(f"fbgemm_tbe: {type(error).__name__}: {message}")
    return providers, skipped


def fbgemm_provider(weights: list[torch.Tensor], device: torch.device) -> Provider:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    if device.type == "cuda":
        location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
    else:
        location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(w.shape[0], w.shape[1], location, compute) for w in weights],
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=0.01,
        pooling_mode=PoolingMode.SUM,
        device=device,
    )

    def reload() -> None:
        with torch.no_grad():
            for dst, src in zip(tbe.split_embedding_weights(), weights, strict=True):
                dst.copy_(src)

    reload()
    return Provider(
        "fbgemm_tbe",
        lambda x: tbe(x.values, x.offsets),
        [],
        "backward applies EXACT_SGD lr=0.01 in place (no grad tensor)",
        reload,
    )


def nominal_bytes(inputs: Inputs, dim: int, with_backward: bool) -> int:
    L, elem = inputs.values.numel(), DTYPE.itemsize
    output = inputs.batch_size * NUM_TABLES * dim * 4
    forward = L * 8 + inputs.offsets.numel() * 8 + L * dim * elem + output
    return forward + (output + L * dim * elem if with_backward else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--dims", type=int, nargs="+", help="embedding dims to sweep")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="batch sizes to sweep")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    dims = args.dims or ([16, 33, 128] if quick else [16, 33, 64, 128])
    batch_sizes = args.batch_sizes or ([2048] if quick else [2048, 8192])
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    repeats = args.repeats if args.repeats is not None else (5 if quick else 20)
    for reason in (TORCHREC_MISSING, RECSYS_MISSING):
        if reason:
            print(f"note: {reason}; continuing with the providers that load")

    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    generator = torch.Generator().manual_seed(args.seed)
    rows = table_rows()
    results: list[Row] = []
    for dim in dims:
        # TorchRec's default init: uniform in +-sqrt(1 / num_embeddings).
        weights = [
            (torch.rand(n, dim, generator=generator) * 2 - 1).mul_(math.sqrt(1 / n)).to(device)
            for n in rows
        ]
        providers, skipped = build_providers(weights, dim, device)
        for reason in skipped:
            print(f"skip {reason}")
        for batch_size in batch_sizes:
            for multi_hot in (False, True):
                inputs = make_inputs(rows, batch_size, multi_hot, device, generator)
                pooling = MAX_BAG // 2 if multi_hot else 1
                config = (
                    f"tables={NUM_TABLES} {ROWS_NOTE} dim={dim} batch={batch_size} "
                    f"pooling={pooling} {IDS_NOTE}"
                )
                check_outputs(providers, weights, inputs)
                results += time_case(providers, inputs, dim, config, device, warmup, repeats)
                print(f"done {config}", flush=True)
        del providers, weights

    path = write_rows(TOPIC, results, env, args.out_dir)
    print_summary(results)
    print(f"\n{len(results)} rows appended to {path}")


def check_outputs(providers: list[Provider], weights: list[torch.Tensor], inputs: Inputs) -> None:
    """Every provider's forward must match the float64 reference before it is timed."""
    expected = reference(weights, inputs)
    for provider in providers:
        provider.reload()
        torch.testing.assert_close(
            provider.forward(inputs).double(),
            expected,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda message, name=provider.name: f"{name} does not match the reference: "
            + message,
        )


def time_case(
    providers: list[Provider],
    inputs: Inputs,
    dim: int,
    config: str,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> list[Row]:
    """Forwards of all providers (interleaved), then their forward+backwards: rows of one case."""
    grad_out = torch.randn(inputs.batch_size, NUM_TABLES * dim, device=device)  # [B, T*D]

    def forward(provider: Provider) -> Callable[[], None]:
        return lambda: provider.forward(inputs)

    def forward_backward(provider: Provider) -> Callable[[], None]:
        def step() -> None:
            provider.forward(inputs).backward(grad_out)
            # Free the dense gradients as optimizer.zero_grad() does, so that only one
            # provider's are alive at a time and each step allocates them afresh.
            for param in provider.params:
                param.grad = None

        return step

    rows = []
    for pass_, make_step in (("fwd", forward), ("fwd_bwd", forward_backward)):
        steps = {provider.name: make_step(provider) for provider in providers}
        timings = time_fns(steps, device, warmup=warmup, repeats=repeats)
        num_bytes = nominal_bytes(inputs, dim, with_backward=pass_ == "fwd_bwd")
        for provider in providers:
            timing = timings[provider.name]
            rows.append(
                Row(
                    op=TOPIC,
                    pass_=pass_,
                    provider=provider.name,
                    config=config,
                    dtype="fp32",
                    timing=timing,
                    throughput=gb_per_s(num_bytes, timing.p50_ms),
                    throughput_unit="GB/s",
                    notes=provider.notes,
                )
            )
    return rows


def print_summary(results: list[Row]) -> None:
    """One line per (config, pass, provider): p50, GB/s and the speed relative to torchrec."""
    baseline = {(r.config, r.pass_): r.timing.p50_ms for r in results if r.provider == "torchrec"}
    lines = []
    for r in results:
        base = baseline.get((r.config, r.pass_))
        lines.append(
            [
                r.config.split(" dim=")[1].replace(f" {IDS_NOTE}", ""),
                r.pass_,
                r.provider,
                f"{r.timing.p50_ms:.3f}",
                f"{r.timing.p20_ms:.3f}-{r.timing.p80_ms:.3f}",
                f"{r.throughput:.2f}",
                f"{base / r.timing.p50_ms:.2f}x" if base else "-",
            ]
        )
    header = ["dim=...", "pass", "provider", "p50 ms", "p20-p80 ms", "GB/s", "vs torchrec"]
    print()
    print(format_table(header, lines))


if __name__ == "__main__":
    main()
