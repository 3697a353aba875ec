"""benchmarks.attention runs end to end on a tiny case and writes its rows (no timing is
judged: the numbers of a loaded 2-core machine mean nothing)."""

from __future__ import annotations

import csv

import torch

from benchmarks.attention import CSV_COLUMNS, Case, main, padded_hstu, zipf_lengths
from recsys.ops.jagged.attention import jagged_attention_reference


def test_the_padded_eager_provider_is_hstu_attention():
    case = Case(max_len=12, batch=5, heads=2, dim=4, dtype="fp32")
    lengths = zipf_lengths(case, torch.Generator().manual_seed(0))
    assert int(lengths[0]) == 12 and int(lengths.min()) >= 1
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    q, k, v = (torch.randn(int(lengths.sum()), 2, 4, dtype=torch.float64) for _ in range(3))
    want = jagged_attention_reference(q, k, v, offsets, 12, alpha=0.5)
    assert torch.allclose(padded_hstu(q, k, v, offsets, 12, 0.5), want, atol=1e-12)


def test_a_tiny_run_writes_one_row_per_provider_and_pass(tmp_path):
    tiny = ["--max-lens", "24", "--batch", "3", "--warmup", "0", "--repeats", "1"]
    main([*tiny, "--out-dir", str(tmp_path)])
    with open(tmp_path / "attention.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    found = {(row["provider"], row["pass"]) for row in rows}
    assert found == {
        (provider, pass_)
        for provider in ("recsys_jagged", "torch_padded", "torch_sdpa")
        for pass_ in ("fwd", "fwd_bwd")
    }
    for row in rows:
        assert row["config"] == "B=3 N=24 H=4 D=64 zipf" and row["device"] and row["commit"]
        assert float(row["time_p50_ms"]) > 0 and float(row["peak_mem_mb"]) > 0
        if row["provider"] == "recsys_jagged":
            assert "CPU: the op's padded torch path" in row["notes"]
