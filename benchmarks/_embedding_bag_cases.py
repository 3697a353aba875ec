"""Cases and workloads of ``benchmarks/embedding_bag.py``: the ``[[case]]`` entries of its
config file, each table's deterministic weights (the same for every provider), the Zipf(1)
batch, its float64 reference output, and the batch laid out on the device for every
provider."""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._harness import zipf_ids
from recsys import EmbeddingBagConfig, KeyedJaggedTensor  # recsys quiets torchrec's import


@dataclass(frozen=True)
class Case:
    """One ``[[case]]`` of the config file (see its header for the fields)."""

    name: str
    num_tables: int
    rows: int
    dim: int
    pooling: int
    batch_size: int
    quick: bool

    @property
    def table_bytes(self) -> int:
        return self.num_tables * self.rows * self.dim * 4

    @property
    def config(self) -> str:
        """The CSV ``config`` column."""
        return (
            f"tables={self.num_tables} rows={self.rows} dim={self.dim} batch={self.batch_size} "
            f"pooling={self.pooling} ids=zipf1"
        )


def load_cases(path: Path) -> list[Case]:
    """Every ``[[case]]`` of the TOML file at ``path``.

    Raises:
        ValueError: a case lacks a field, has an unknown one, a non-positive size or a
            duplicate name.
    """
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("case", [])
    if not entries:
        raise ValueError(f"--config {path}: no [[case]] entries")
    fields = set(Case.__dataclass_fields__)
    cases = []
    for index, entry in enumerate(entries):
        label = f"--config {path}: case {entry.get('name', index)!r}"
        if set(entry) != fields:
            missing, unknown = sorted(fields - set(entry)), sorted(set(entry) - fields)
            raise ValueError(f"{label}: missing fields {missing}, unknown fields {unknown}")
        for field in ("num_tables", "rows", "dim", "pooling", "batch_size"):
            value = entry[field]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label}: {field}={value!r} must be an integer >= 1")
        if not isinstance(entry["quick"], bool):
            raise ValueError(f"{label}: quick={entry['quick']!r} must be true or false")
        cases.append(Case(**entry))
    names = [case.name for case in cases]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"--config {path}: duplicate case names {duplicates}")
    return cases


def select_cases(cases: list[Case], names: Sequence[str] | None, quick: bool) -> list[Case]:
    """The cases named by --cases (any, quick or not), else the quick ones under --quick, else
    all."""
    if not names:
        return [case for case in cases if case.quick or not quick]
    by_name = {case.name: case for case in cases}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(f"--cases {unknown}: not in the config; it has {list(by_name)}")
    return [by_name[name] for name in names]


# ------------------------------------------------------------------------------ tables and ids


def table_weight(seed: int, table: int, rows: int, dim: int) -> torch.Tensor:
    """Table ``table``'s weights [rows, dim] on CPU, the same on every call: TorchRec's default
    init (uniform in +-sqrt(1 / rows)) from a generator seeded by ``(seed, table)``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + table)
    bound = math.sqrt(1 / rows)
    return torch.empty(rows, dim).uniform_(-bound, bound, generator=generator)


def fill_table(weight: torch.Tensor, *, seed: int, table: int) -> None:
    """``init_fn`` of every provider's table ``table``: writes :func:`table_weight` in place."""
    with torch.no_grad():
        weight.copy_(table_weight(seed, table, weight.shape[0], weight.shape[1]))


def table_configs(case: Case, seed: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{t}",
            embedding_dim=case.dim,
            num_embeddings=case.rows,
            feature_names=[f"f_{t}"],
            init_fn=functools.partial(fill_table, seed=seed, table=t),
        )
        for t in range(case.num_tables)
    ]


def make_batch(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Zipf(1) ids [L] and bag lengths [T*B] on CPU, key-major (table t's bags are t*B ..
    (t+1)*B - 1)."""
    T, B = case.num_tables, case.batch_size
    if case.pooling == 1:
        lengths = torch.ones(T * B, dtype=torch.int64)
    else:
        lengths = torch.randint(0, 2 * case.pooling + 1, (T * B,), generator=generator)
    per_table = lengths.view(T, B).sum(dim=1).tolist()
    return torch.cat([zipf_ids(n, case.rows, generator) for n in per_table]), lengths


def reference(case: Case, seed: int, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum pooling in float64 on CPU, one table at a time: [B, T*D]."""
    B = case.batch_size
    bounds = [0, *torch.cumsum(lengths.view(case.num_tables, B).sum(dim=1), dim=0).tolist()]
    pooled = []
    for t in range(case.num_tables):
        weight = table_weight(seed, t, case.rows, case.dim)  # [N, D]
        ids = values[bounds[t] : bounds[t + 1]]
        bag = torch.repeat_interleave(torch.arange(B), lengths[t * B : (t + 1) * B])
        sums = torch.zeros(B, case.dim, dtype=torch.float64)
        pooled.append(sums.index_add_(0, bag, weight[ids].double()))  # [B, D]
    return torch.cat(pooled, dim=1)


@dataclass
class Workload:
    """One case made concrete: its tables' seed and one batch on the device."""

    case: Case
    seed: int
    device: torch.device
    kjt: KeyedJaggedTensor
    values: torch.Tensor  # [L] int64
    offsets: torch.Tensor  # [T*B + 1] int64
    per_table: list[tuple[torch.Tensor, torch.Tensor]]  # table t's ids [L_t], bag starts [B]
    grad_output: torch.Tensor  # [B, T*D] upstream gradient of the fwd_bwd passes
    num_distinct: int  # U: distinct (table, id) pairs among the ids


def make_workload(
    case: Case, seed: int, values: torch.Tensor, lengths: torch.Tensor, device: torch.device
) -> Workload:
    T, B = case.num_tables, case.batch_size
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, dim=0)
    bounds = offsets[::B].tolist()  # start of each table's ids, and the end
    per_table = [
        (values[bounds[t] : bounds[t + 1]], offsets[t * B : (t + 1) * B] - bounds[t])
        for t in range(T)
    ]
    num_distinct = sum(ids.unique().numel() for ids, _ in per_table)
    values, lengths, offsets = values.to(device), lengths.to(device), offsets.to(device)
    kjt = KeyedJaggedTensor(
        keys=[f"f_{t}" for t in range(T)], values=values, lengths=lengths, offsets=offsets
    )
    generator = torch.Generator().manual_seed(seed)
    return Workload(
        case=case,
        seed=seed,
        device=device,
        kjt=kjt,
        values=values,
        offsets=offsets,
        per_table=[(ids.to(device), starts.to(device)) for ids, starts in per_table],
        grad_output=torch.randn(B, T * case.dim, generator=generator).to(device),
        num_distinct=num_distinct,
    )
