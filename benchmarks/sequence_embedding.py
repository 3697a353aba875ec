"""Benchmark the unpooled embedding lookup (``recsys.EmbeddingCollection``) with its fused
update against what a user would pick instead for sequence features.

Case: one item table (``rows`` x ``dim``, fp32) read by one feature, ``batch`` users with
histories of ``max_len`` ids each (Zipf-skewed, so ids repeat within and across histories);
one training step of the lookup: forward, a fixed upstream gradient [ids, dim], backward with
Adagrad (``lr`` 0.05, eps 1e-10) applied to the touched rows.

Providers, on the same ids, upstream gradient and table:

- ``recsys``: ``EmbeddingCollection(optimizer=Adagrad)`` (backend auto: FBGEMM's C++ fused
  backward on CPU, Triton on CUDA), ids not validated (``validate="off"``, as a trusted
  pipeline; ``recsys_checked`` validates them, a host sync);
- ``recsys_torch``: the same with ``backend="torch"``;
- ``recsys_bag_one_id``: ``EmbeddingBagCollection`` over the same ids as one-id bags: the
  lookup the unpooled collection runs underneath, so the gap to ``recsys`` is its own glue;
- ``fbgemm_tbe``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` with
  ``PoolingMode.NONE`` and EXACT_ADAGRAD (what TorchRec's sharded EmbeddingCollection runs);
- ``torch_sparse``: ``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad`` (sparse gradient);
- ``torchrec_dense``: ``torchrec.EmbeddingCollection`` (unsharded: ``nn.Embedding``, dense
  gradient) + ``torch.optim.Adagrad``.

Throughput: GB/s of the nominal bytes, the same for every provider: the rows read forward and
their gradient read backward (2 x ids x dim x 4).

Run: ``python -m benchmarks.sequence_embedding [--device cuda] [--quick | --full]``; rows go to
``benchmarks/results/sequence_embedding.csv`` (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

from benchmarks._harness import (
    Row,
    add_common_args,
    environment,
    format_table,
    gb_per_s,
    is_quick,
    load_note,
    resolve_device,
    time_fns,
    write_rows,
    zipf_ids,
)
from recsys import EmbeddingBagCollection, EmbeddingCollection
from recsys.embedding.optim import Adagrad

TOPIC = "sequence_embedding"
LR, EPS = 0.05, 1e-10


@dataclass(frozen=True)
class Case:
    rows: int
    dim: int
    batch: int
    max_len: int

    @property
    def config(self) -> str:
        return (
            f"1 table x {self.rows} rows x dim {self.dim}, batch {self.batch} x max_len "
            f"{self.max_len} (zipf ids)"
        )


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(1_000_000, 64, 256, 50), Case(1_000_000, 64, 2048, 50)]
    return [Case(1_000_000, 64, b, n) for b in (2048, 8192) for n in (50, 200)]


def step_fns(case: Case, device: torch.device, seed: int) -> dict[str, Callable[[], None]]:
    """One training step of the lookup per provider (each owns its copy of the table)."""
    generator = torch.Generator().manual_seed(seed)
    num_ids = case.batch * case.max_len
    ids = zipf_ids(num_ids, case.rows, generator).to(device)
    lengths = torch.full((case.batch,), case.max_len, device=device)
    upstream = torch.randn(num_ids, case.dim, generator=generator).to(device)
    table = torch.empty(case.rows, case.dim).uniform_(-0.01, 0.01, generator=generator)
    kjt = KeyedJaggedTensor(keys=["history"], values=ids, lengths=lengths)
    kjt.length_per_key()  # as the loader hands it: sizes known on the host
    one_id = KeyedJaggedTensor(keys=["history"], values=ids, lengths=torch.ones_like(ids))
    one_id.length_per_key()
    config = dict(name="item", embedding_dim=case.dim, num_embeddings=case.rows)
    fns: dict[str, Callable[[], None]] = {}

    def unpooled(backend: str, validate: bool | str) -> Callable[[], None]:
        ec = EmbeddingCollection(
            [EmbeddingConfig(**config, feature_names=["history"])],
            device=device,
            backend=backend,
            validate=validate,
            optimizer=Adagrad(lr=LR, eps=EPS),
        )
        ec.embeddings.item.weight.data.copy_(table)
        return lambda: (ec(kjt)["history"].values() * upstream).sum().backward()

    fns["recsys"] = unpooled("auto", "off")
    fns["recsys_checked"] = unpooled("auto", True)
    fns["recsys_torch"] = unpooled("torch", "off")
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(**config, feature_names=["history"])],
        device=device,
        validate="off",
        optimizer=Adagrad(lr=LR, eps=EPS),
    )
    ebc.embedding_bags.item.weight.data.copy_(table)
    fns["recsys_bag_one_id"] = lambda: (ebc(one_id).values() * upstream).sum().backward()
    fns["fbgemm_tbe"] = _fbgemm_step(case, table, ids, upstream, device)

    embedding = torch.nn.Embedding(case.rows, case.dim, sparse=True, device=device)
    embedding.weight.data.copy_(table)
    sparse_opt = torch.optim.Adagrad(embedding.parameters(), lr=LR, eps=EPS)

    def torch_sparse() -> None:
        sparse_opt.zero_grad()
        (embedding(ids) * upstream).sum().backward()
        sparse_opt.step()

    fns["torch_sparse"] = torch_sparse
    theirs = torchrec.EmbeddingCollection(
        [EmbeddingConfig(**config, feature_names=["history"])], device=device
    )
    theirs.embeddings.item.weight.data.copy_(table)
    dense_opt = torch.optim.Adagrad(theirs.parameters(), lr=LR, eps=EPS)

    def torchrec_dense() -> None:
        dense_opt.zero_grad()
        (theirs(kjt)["history"].values() * upstream).sum().backward()
        dense_opt.step()

    fns["torchrec_dense"] = torchrec_dense
    return fns


def _fbgemm_step(
    case: Case, table: torch.Tensor, ids: torch.Tensor, upstream: torch.Tensor, device
) -> Callable[[], None]:
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
        [(case.rows, case.dim, location, compute)],
        optimizer=EmbOptimType.EXACT_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.NONE,
    )
    tbe.split_embedding_weights()[0].copy_(table)
    offsets = torch.arange(ids.numel() + 1, device=device)
    return lambda: (tbe(ids, offsets) * upstream).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = is_quick(args)
    warmup = args.warmup if args.warmup is not None else 2
    repeats = args.repeats if args.repeats is not None else (7 if quick else 30)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    rows: list[Row] = []
    for case in cases(quick):
        load = load_note()
        fns = step_fns(case, device, args.seed)
        timings = time_fns(fns, device, warmup=warmup, repeats=repeats, min_time_s=0.0)
        nominal = 2 * case.batch * case.max_len * case.dim * 4
        for name, timing in timings.items():
            rows.append(
                Row(
                    op="embedding_lookup",
                    pass_="fwd_bwd_adagrad",
                    provider=name,
                    config=case.config,
                    dtype="fp32",
                    timing=timing,
                    throughput=gb_per_s(nominal, timing.p50_ms),
                    throughput_unit="GB/s",
                    notes=f"{load}; load after: {load_note()}",
                )
            )
        del fns
        gc.collect()
    lines = [[r.config, r.provider, f"{r.timing.p50_ms:.2f}", f"{r.throughput:.2f}"] for r in rows]
    print(format_table(["config", "provider", "p50 ms", "GB/s"], lines))
    path = write_rows(TOPIC, rows, env, args.out_dir)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
