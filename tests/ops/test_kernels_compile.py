"""Every Triton kernel of recsys compiles for real GPUs (sm_80 and sm_90) with the constexprs,
tiles and launch options a GPU launch uses: the interpreter that runs the other op tests accepts
programs the compiler rejects (tl.dot shapes and layouts, constexpr misuse, pointer types) and
runs fixed tiles where a GPU autotunes, and a user's first GPU run must not be where those
surface. No GPU needed: triton.compile targets a GPUTarget and the triton wheel ships ptxas.

The default run compiles representative variants (``tests.kernel_variants.representatives``:
each kernel's first recorded launch and the largest tile of each launch path, autotuners
included) and fails on a compile error or a spill that ``SPILLS_ALLOWED`` does not explain. The
slow test and ``scripts/kernel_table.py`` (benchmarks/results/kernels.csv) compile every
variant."""

from __future__ import annotations

import os

import pytest

from tests.kernel_launches import (
    TARGETS,
    compile_failures,
    compile_in_subprocess,
    launched_kernels,
    record_launches,
)
from tests.kernel_variants import gpu_variants, representatives, unexplained_spills

# Recorded in two halves at once on two cores (record_launches' slices): the attention tests,
# two thirds of the recording, open one half and close the other.
OP_TESTS = [
    "tests/ops/jagged/test_jagged_attention.py",
    "tests/ops/interaction/test_dot_interaction.py",
    "tests/ops/interaction/test_cross_interaction.py",
    "tests/ops/mlp/test_fused_mlp.py",
    "tests/ops/embedding_bag/test_embedding_bag.py",
    "tests/ops/test_input_checks.py",
    "tests/ops/slot_map/test_slot_map.py",
    "tests/ops/jagged/test_jagged_attention_masks.py",
    "tests/ops/jagged/test_jagged_concat.py",
    "tests/ops/jagged/test_jagged_dense_add.py",
]


def recorded_variants(workdir) -> list[dict]:
    """The variants the op tests launch under the interpreter (a process per core), checked to
    cover every kernel ``recsys/ops`` launches."""
    jobs = len(os.sched_getaffinity(0))
    variants = record_launches(OP_TESTS, workdir / "variants.json", "-k", "triton", jobs=jobs)
    missing = launched_kernels() - {(v["module"], v["kernel"]) for v in variants}
    assert not missing, f"kernels no op test launched under the interpreter: {sorted(missing)}"
    return variants


def assert_compiled_without_unexplained_spills(variants: list[dict], rows: list[dict]) -> None:
    failures = compile_failures(variants, rows)
    assert not failures, "compile failures:\n" + "\n".join(failures)
    spills = unexplained_spills(variants, rows)
    assert not spills, "unexplained register spills:\n" + "\n".join(spills)


def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path):
    variants = representatives(gpu_variants(recorded_variants(tmp_path)))
    rows = compile_in_subprocess(variants, TARGETS, tmp_path, jobs=len(os.sched_getaffinity(0)))
    assert_compiled_without_unexplained_spills(variants, rows)


@pytest.mark.slow
def test_every_gpu_variant_compiles_for_sm80_and_sm90(tmp_path):
    variants = gpu_variants(recorded_variants(tmp_path))
    jobs = len(os.sched_getaffinity(0))
    rows = compile_in_subprocess(variants, TARGETS, tmp_path, jobs=jobs)
    assert_compiled_without_unexplained_spills(variants, rows)
