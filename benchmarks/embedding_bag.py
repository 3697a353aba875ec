"""Benchmark the multi-table pooled embedding lookup, and its training step with the optimizer
fused into backward, against the peers a user would pick instead.

Cases come from ``configs/bench/embedding_bag.toml`` (``--config``): T tables of N rows and dim
D, batch B, one-hot or multi-hot bags, ids Zipf(1)-skewed with the hot rows scattered over each
table. Every provider of a case holds the same fp32 weights (table t drawn from a generator
seeded by ``(--seed, t)``, TorchRec's default init range) and reads the same batch. Passes:

- ``fwd``: forward with autograd on (as in training), [B, T*D] pooled sums;
- ``fwd_bwd_sgd``: forward + backward of a fixed upstream gradient + an SGD step (lr 0.01);
- ``fwd_bwd_rowwise_adagrad``: the same with row-wise Adagrad (lr 0.01, eps 1e-8).

Providers:

- ``recsys_<backend>``: ``recsys.EmbeddingBagCollection(backend=..., validate=False)``, for
  ``auto`` and each explicit backend in :data:`RECSYS_BACKENDS`; ``fwd`` and ``fwd_bwd_sgd`` on
  one collection built with ``optimizer=SGD``, ``fwd_bwd_rowwise_adagrad`` on one built with
  ``optimizer=RowWiseAdagrad`` (the update runs inside backward; no gradient tensor). A
  backend that raises ValueError on construction or first call is reported as skipped;
- ``recsys_auto_validate``: the ``auto`` collection with ``validate=True`` (the default), fwd;
- ``fbgemm_tbe``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU: HOST placement on
  ComputeDevice.CPU; CUDA: DEVICE), EXACT_SGD / EXACT_ROWWISE_ADAGRAD fused into backward;
- ``torch_embeddingbag``: one ``torch.nn.EmbeddingBag(mode="sum", sparse=True)`` per table,
  outputs concatenated, each table's ids and bag offsets sliced out of the batch beforehand;
  sparse gradients stepped by ``torch.optim.SGD``, or for the row-wise pass by
  ``torch.optim.Adagrad`` (element-wise: the closest torch has; its state is table-sized);
- ``torchrec``: the unsharded ``torchrec.EmbeddingBagCollection`` (fwd; fwd_bwd_sgd with dense
  table gradients and ``torch.optim.SGD``).

The tables of one provider take T*N*D*4 bytes (26 x 1M x 128 fp32: 13.3 GB), so providers are
built one at a time: build, check the forward against a float64 reference, time its passes
(interleaved with each other, see ``benchmarks/_harness.py``), free it, next. Providers are
therefore not interleaved with each other; every row's notes carry the load average when its
provider was timed. A pass that holds a second table-sized tensor (dense gradients, element-wise
Adagrad state) is skipped, with the reason printed, when ``2 * T*N*D*4`` exceeds 60% of the
memory available when the case starts.

Throughput (GB/s) is bytes moved / p50 time, counted the same way for every provider of a pass,
with L ids in the batch and U distinct (table, id) pairs among them:

- ``fwd``: ids ``L*8`` + offsets ``(T*B + 1)*8`` + table rows read ``L*D*4`` + output written
  ``B*T*D*4``;
- ``fwd_bwd_sgd``: ``fwd`` + upstream gradient read ``B*T*D*4`` + each distinct touched row
  read and written once ``U*D*4*2``;
- ``fwd_bwd_rowwise_adagrad``: ``fwd_bwd_sgd`` + each touched row's state read and written
  ``U*4*2``.

The table prints each provider's speed relative to ``fbgemm_tbe`` on the same pass (> 1: faster).

Run: ``python -m benchmarks.embedding_bag [--device cuda] [--quick | --full] [--cases NAME
...]``; rows go to ``benchmarks/results/embedding_bag.csv`` (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import gc
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import recsys
from benchmarks._embedding_bag_cases import (
    Case,
    Workload,
    fill_table,
    load_cases,
    make_batch,
    make_workload,
    reference,
    select_cases,
    table_configs,
)
from benchmarks._harness import (
    REPO_ROOT,
    Row,
    add_common_args,
    available_memory_bytes,
    environment,
    format_table,
    gb_per_s,
    is_quick,
    load_note,
    resolve_device,
    time_fns,
    write_rows,
)
from recsys.embedding.optim import SGD, FusedOptimizer, RowWiseAdagrad

# torch.optim.Adagrad's sparse path warns about sparse invariant checks; nothing to act on here.
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

TOPIC = "embedding_bag"
DEFAULT_CONFIG = REPO_ROOT / "configs" / "bench" / "embedding_bag.toml"
FWD, SGD_PASS, ROWWISE_PASS = "fwd", "fwd_bwd_sgd", "fwd_bwd_rowwise_adagrad"
PASSES = (FWD, SGD_PASS, ROWWISE_PASS)
# Backends tried besides "auto" (CPU: FBGEMM's fused backward where it applies; CUDA: Triton);
# one that cannot run here is reported as skipped.
RECSYS_BACKENDS = {"cpu": ["torch"], "cuda": ["torch"]}
LR, EPS = 0.01, 1e-8
DENSE_MEMORY_FRACTION = 0.6  # a pass holding 2x the tables runs only below this share of free RAM
CHECK_ROWS = 4096  # samples per chunk of the forward check (bounds its float64 temporaries)


def bytes_moved(work: Workload, pass_: str) -> int:
    """The module docstring's count of bytes a pass reads and writes."""
    T, B, D = work.case.num_tables, work.case.batch_size, work.case.dim
    L, U = work.values.numel(), work.num_distinct
    output = B * T * D * 4
    moved = L * 8 + (T * B + 1) * 8 + L * D * 4 + output
    if pass_ != FWD:
        moved += output + U * D * 4 * 2
    if pass_ == ROWWISE_PASS:
        moved += U * 4 * 2
    return moved


# ------------------------------------------------------------------------------ providers


@dataclass
class Built:
    """A provider holding the case's tables: its forward and one callable per pass to time."""

    forward: Callable[[], torch.Tensor]  # -> [B, T*D]
    steps: dict[str, Callable[[], object]]


@dataclass
class Provider:
    """One way of running the case, built only when it is timed."""

    name: str
    build: Callable[[Workload, Sequence[str]], Built]  # (workload, passes to time) -> Built
    notes: dict[str, str]  # pass -> what qualifies its row; the passes this provider runs
    dense_passes: tuple[str, ...] = ()  # passes that hold a second table-sized tensor
    skip_on: tuple[type[Exception], ...] = ()  # errors of build / first call meaning "cannot run"


def backward_step(
    forward: Callable[[], torch.Tensor],
    grad_output: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
) -> Callable[[], None]:
    """Forward, backward of ``grad_output``, then ``optimizer``'s step (none when the update
    is fused into backward)."""

    def step() -> None:
        forward().backward(grad_output)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def recsys_provider(
    backend: str, optimizer: Callable[[], FusedOptimizer], passes: dict[str, str], validate: bool
) -> Provider:
    def build(work: Workload, run: Sequence[str]) -> Built:
        ebc = recsys.EmbeddingBagCollection(
            table_configs(work.case, work.seed),
            device=work.device,
            backend=backend,
            validate=validate,
            optimizer=optimizer(),
        )

        def forward() -> torch.Tensor:
            return ebc(work.kjt).values()

        step = backward_step(forward, work.grad_output)
        return Built(forward, {p: forward if p == FWD else step for p in run})

    name = "recsys_auto_validate" if validate else f"recsys_{backend}"
    return Provider(name, build, passes, skip_on=(ValueError,))


def fbgemm_provider(optimizer: str, passes: dict[str, str]) -> Provider:
    def build(work: Workload, run: Sequence[str]) -> Built:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        if work.device.type == "cuda":
            location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
        else:
            location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
        case = work.case
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(case.rows, case.dim, location, compute)] * case.num_tables,
            optimizer=EmbOptimType[optimizer],
            learning_rate=LR,
            eps=EPS,
            pooling_mode=PoolingMode.SUM,
            device=work.device,
        )
        for t, weight in enumerate(tbe.split_embedding_weights()):
            fill_table(weight, seed=work.seed, table=t)

        def forward() -> torch.Tensor:
            return tbe(work.values, work.offsets)

        step = backward_step(forward, work.grad_output)
        return Built(forward, {p: forward if p == FWD else step for p in run})

    # NotImplementedError: a CPU-only fbgemm-gpu (fbgemm-gpu-cpu) has no CUDA kernels
    return Provider("fbgemm_tbe", build, passes, skip_on=(ImportError, NotImplementedError))


def torch_embeddingbag_provider() -> Provider:
    def build(work: Workload, run: Sequence[str]) -> Built:
        case = work.case
        bags = []
        for t in range(case.num_tables):
            weight = torch.empty(case.rows, case.dim, device=work.device)
            fill_table(weight, seed=work.seed, table=t)
            bags.append(
                torch.nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode="sum", sparse=True)
            )
        params = [bag.weight for bag in bags]

        def forward() -> torch.Tensor:
            inputs = zip(bags, work.per_table, strict=True)
            pooled = [bag(ids, starts) for bag, (ids, starts) in inputs]  # T x [B, D]
            return torch.cat(pooled, dim=1)  # [B, T*D]

        steps: dict[str, Callable[[], object]] = {}
        for pass_ in run:
            if pass_ == FWD:
                steps[pass_] = forward
            elif pass_ == SGD_PASS:
                optimizer = torch.optim.SGD(params, lr=LR)
                steps[pass_] = backward_step(forward, work.grad_output, optimizer)
            else:  # torch.optim.Adagrad allocates its table-sized state here
                optimizer = torch.optim.Adagrad(params, lr=LR, eps=EPS)
                steps[pass_] = backward_step(forward, work.grad_output, optimizer)
        return Built(forward, steps)

    notes = {
        FWD: "one nn.EmbeddingBag per table, outputs torch.cat'ed",
        SGD_PASS: "sparse grads + torch.optim.SGD",
        ROWWISE_PASS: "sparse grads + torch.optim.Adagrad: element-wise Adagrad, the closest "
        "torch has (state as big as the table)",
    }
    return Provider("torch_embeddingbag", build, notes, dense_passes=(ROWWISE_PASS,))


def torchrec_provider() -> Provider:
    def build(work: Workload, run: Sequence[str]) -> Built:
        import torchrec

        ebc = torchrec.EmbeddingBagCollection(
            table_configs(work.case, work.seed), device=work.device
        )

        def forward() -> torch.Tensor:
            return ebc(work.kjt).values()

        steps: dict[str, Callable[[], object]] = {FWD: forward}
        if SGD_PASS in run:
            optimizer = torch.optim.SGD(ebc.parameters(), lr=LR)
            steps[SGD_PASS] = backward_step(forward, work.grad_output, optimizer)
        return Built(forward, {p: steps[p] for p in run})

    notes = {
        FWD: "unsharded torchrec.EmbeddingBagCollection",
        SGD_PASS: "unsharded, dense table grads + torch.optim.SGD",
    }
    return Provider("torchrec", build, notes, dense_passes=(SGD_PASS,))


def providers(device: torch.device) -> list[Provider]:
    """Every provider, in the order they are built; fbgemm_tbe first (the baseline)."""
    result = [
        fbgemm_provider(
            "EXACT_SGD", {FWD: "", SGD_PASS: "EXACT_SGD fused into backward (no grad tensor)"}
        ),
        fbgemm_provider(
            "EXACT_ROWWISE_ADAGRAD",
            {ROWWISE_PASS: "EXACT_ROWWISE_ADAGRAD fused into backward (no grad tensor)"},
        ),
    ]
    for backend in ["auto", *RECSYS_BACKENDS[device.type]]:
        result.append(
            recsys_provider(
                backend,
                lambda: SGD(lr=LR),
                {FWD: "validate=False", SGD_PASS: "validate=False; optimizer=SGD, fused"},
                validate=False,
            )
        )
        result.append(
            recsys_provider(
                backend,
                lambda: RowWiseAdagrad(lr=LR, eps=EPS),
                {ROWWISE_PASS: "validate=False; optimizer=RowWiseAdagrad, fused"},
                validate=False,
            )
        )
        if backend == "auto":
            result.append(
                recsys_provider(
                    "auto", lambda: SGD(lr=LR), {FWD: "validate=True (default)"}, validate=True
                )
            )
    return [*result, torch_embeddingbag_provider(), torchrec_provider()]


# ------------------------------------------------------------------------------ running a case


def check_forward(name: str, output: torch.Tensor, expected: torch.Tensor) -> None:
    """``output`` [B, T*D] must match the float64 reference, compared in chunks of samples."""
    for start in range(0, expected.shape[0], CHECK_ROWS):
        torch.testing.assert_close(
            output[start : start + CHECK_ROWS].detach().cpu().double(),
            expected[start : start + CHECK_ROWS],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda message: f"{name} does not match the reference: {message}",
        )


def run_case(case: Case, seed: int, device: torch.device, warmup: int, repeats: int) -> list[Row]:
    """Build, check and time every provider on one case, one at a time; prints why a provider
    or pass was skipped."""
    generator = torch.Generator().manual_seed(seed)
    values, lengths = make_batch(case, generator)
    expected = reference(case, seed, values, lengths)  # [B, T*D] float64, CPU
    work = make_workload(case, seed, values, lengths, device)
    del values, lengths
    available = available_memory_bytes(device)
    dense_fits = 2 * case.table_bytes <= DENSE_MEMORY_FRACTION * available
    rows = []
    for provider in providers(device):
        run = list(provider.notes)
        if not dense_fits:
            for pass_ in provider.dense_passes:
                print(
                    f"skip {provider.name} {pass_}: needs 2 x {case.table_bytes / 1e9:.1f} GB "
                    f"(tables + table-sized grads or state), over {DENSE_MEMORY_FRACTION:.0%} "
                    f"of the {available / 1e9:.1f} GB available"
                )
            run = [p for p in run if p not in provider.dense_passes]
        if not run:
            continue
        print(f"{case.name}: {provider.name} {'/'.join(run)}", flush=True)
        built = None
        try:
            built = provider.build(work, run)
            output = built.forward()
        except provider.skip_on as error:
            message = (str(error).strip().splitlines() or [""])[0]
            print(f"skip {provider.name} {'/'.join(run)}: {type(error).__name__}: {message}")
            built = None  # free its tables before the next provider is built
            continue
        check_forward(provider.name, output, expected)
        del output
        load = load_note()
        timings = time_fns(built.steps, device, warmup=warmup, repeats=repeats)
        del built
        gc.collect()
        for pass_, timing in timings.items():
            notes = "; ".join(n for n in (provider.notes[pass_], load) if n)
            rows.append(
                Row(
                    op=TOPIC,
                    pass_=pass_,
                    provider=provider.name,
                    config=case.config,
                    dtype="fp32",
                    timing=timing,
                    throughput=gb_per_s(bytes_moved(work, pass_), timing.p50_ms),
                    throughput_unit="GB/s",
                    notes=notes,
                )
            )
    return rows


def print_case(case: Case, rows: list[Row]) -> None:
    """One line per (pass, provider): p50, p20-p80, GB/s and the speed relative to fbgemm_tbe."""
    baseline = {r.pass_: r.timing.p50_ms for r in rows if r.provider == "fbgemm_tbe"}
    lines = []
    for r in sorted(rows, key=lambda r: PASSES.index(r.pass_)):
        base = baseline.get(r.pass_)
        lines.append(
            [
                r.pass_,
                r.provider,
                f"{r.timing.p50_ms:.3f}",
                f"{r.timing.p20_ms:.3f}-{r.timing.p80_ms:.3f}",
                f"{r.throughput:.2f}",
                f"{base / r.timing.p50_ms:.2f}x" if base else "-",
            ]
        )
    header = ["pass", "provider", "p50 ms", "p20-p80 ms", "GB/s", "vs fbgemm_tbe"]
    print(f"\n{case.name}: {case.config}")
    print(format_table(header, lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="cases TOML")
    parser.add_argument(
        "--cases", nargs="+", metavar="NAME", help="run these cases (quick or not) only"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    cases = select_cases(load_cases(args.config), args.cases, quick)
    if not cases:
        raise ValueError(f"--config {args.config}: no case has quick = true; run with --full")
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    repeats = args.repeats if args.repeats is not None else (5 if quick else 20)

    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    print(f"cases: {', '.join(case.name for case in cases)}")
    num_rows = 0
    for case in cases:
        rows = run_case(case, args.seed, device, warmup, repeats)
        path = write_rows(TOPIC, rows, env, args.out_dir)
        num_rows += len(rows)
        print_case(case, rows)
    print(f"\n{num_rows} rows appended to {path}")


if __name__ == "__main__":
    main()
