"""The kernel compile check itself (tests/kernel_launches.py, tests/kernel_variants.py): a kernel
broken for the compiler is rejected with a message naming it, its variant and the compiler's
words; a spill without a reason fails; interpreter launches expand into the autotune configs a
GPU launch compiles, sent to the tuner the launcher picks."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.autotuner as autotuner

import recsys.ops.mlp.fused_linear as fused_mlp
from recsys.ops.mlp.fused_linear import fused_linear_with_mask
from tests.kernel_launches import (
    compile_failures,
    compile_in_subprocess,
    record_into,
    variant_of,
)
from tests.kernel_variants import (
    autotuners,
    exact_fp32_dot,
    gpu_variants,
    representatives,
    tuner_for,
    unexplained_spills,
)


@triton.jit
def _small_dot_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    # The interpreter multiplies any shapes; the compiler needs K >= 16 for 16-bit operands.
    rows = tl.arange(0, BLOCK)
    tile = rows[:, None] * BLOCK + rows[None, :]
    x = tl.load(x_ptr + tile)
    tl.store(out_ptr + tile, tl.dot(x, x).to(out_ptr.dtype.element_ty))


@triton.jit
def _spilling_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    # A 128 x 128 fp32 tile on 2 warps: 256 values a thread, all live across both reductions.
    rows = tl.arange(0, BLOCK)
    tile = rows[:, None] * BLOCK + rows[None, :]
    x = tl.load(x_ptr + tile)
    tl.store(out_ptr + tile, x * tl.sum(x, axis=0)[None, :] + tl.sum(x, axis=1)[:, None])


def _launch(kernel, dtype: torch.dtype, block: int, num_warps: int) -> dict:
    """Run ``kernel`` under the interpreter (it must accept it) and return its variant."""
    x = torch.randn(block, block).to(dtype)
    out = torch.empty_like(x)
    recorded: dict[str, dict] = {}
    undo = record_into(recorded, prefix=__name__)
    try:
        kernel[(1,)](x, out, BLOCK=block, num_warps=num_warps)
    finally:
        undo()
    assert torch.isfinite(out.float()).all()
    (variant,) = recorded.values()
    return variant | {"source": "recorded", "tuner": None}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """The two broken kernels' variants and their compile rows (two processes: the rows must
    come back in the variants' order)."""
    variants = [
        _launch(_small_dot_kernel, torch.float16, 8, 1),
        _launch(_spilling_kernel, torch.float32, 128, 2),
    ]
    rows = compile_in_subprocess(variants, (90,), tmp_path_factory.mktemp("compile"), jobs=2)
    return variants, rows


def test_a_kernel_the_compiler_rejects_fails_with_kernel_variant_and_message(compiled):
    variants, rows = compiled
    (failure,) = compile_failures(variants, rows)
    assert failure.startswith(f"{__name__}._small_dot_kernel sm_90 ")
    assert '"BLOCK": 8' in failure and '"num_warps": 1' in failure
    assert "K >= 16" in failure  # the compiler's own words


def test_a_spill_without_a_reason_fails(compiled):
    variants, rows = compiled
    assert "usage" in rows[1] and rows[1]["usage"]["spill_store_bytes"] > 0
    (message,) = unexplained_spills(variants, rows)
    assert message.startswith(f"{__name__}._spilling_kernel sm_90 (fp32, recorded) ")
    assert '"BLOCK": 128' in message and "SPILLS_ALLOWED" in message


def _fused_forward_variants(dtype: torch.dtype) -> list[dict]:
    """The fused-MLP forward launches of one small layer, recorded under the interpreter."""
    recorded: dict[str, dict] = {}
    undo = record_into(recorded)
    try:
        x, weight = torch.randn(5, 24).to(dtype), torch.randn(40, 24).to(dtype)
        fused_linear_with_mask(x, weight, torch.randn(40).to(dtype), activation="gelu")
    finally:
        undo()
    return [v for v in recorded.values() if v["kernel"] == "_forward_kernel"]


_TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")


def _tiles(variants: list[dict]) -> set[tuple]:
    return {
        (
            *(v["constexprs"][k] for k in _TILE),
            v["options"]["num_warps"],
            v["options"]["num_stages"],
        )
        for v in variants
    }


def _config_tiles(tuner) -> set[tuple]:
    return {(*(c.kwargs[k] for k in _TILE), c.num_warps, c.num_stages) for c in tuner.configs}


def test_autotuned_kernels_expand_into_every_config_of_the_launchers_tuner():
    tuners = autotuners()[("recsys.ops.mlp.fused_linear", "_forward_kernel")]
    fma, tensor_core = (
        "recsys.ops.mlp.fused_linear._forward_kernel_fma",
        "recsys.ops.mlp.fused_linear._forward_kernel_tuned",
    )
    assert set(tuners) == {fma, tensor_core}
    for dtype in (torch.float32, torch.bfloat16):
        (recorded,) = _fused_forward_variants(dtype)
        variants = gpu_variants([recorded])
        assert variants[0]["source"] == "recorded" and variants[0]["tuner"] is None
        assert variants[0]["constexprs"]["DOT_IN_FP32"] is False  # its GPU value
        tuned = [v for v in variants if v["source"] == "autotune"]
        assert all(v["constexprs"]["ACTIVATION"] == "gelu" for v in tuned)
        by_tuner = {name: [v for v in tuned if v["tuner"] == name] for name in tuners}
        exact = [v for v in by_tuner[tensor_core] if v["constexprs"]["INPUT_PRECISION"] == "ieee"]
        if dtype == torch.float32:  # exact fp32 on the FMA tiles, its TF32 twin on tensor cores
            assert _tiles(by_tuner[fma]) == _config_tiles(tuners[fma])
            assert not exact
        else:
            assert not by_tuner[fma]
            assert _tiles(exact) == _config_tiles(tuners[tensor_core])
        assert _tiles(by_tuner[tensor_core]) == _config_tiles(tuners[tensor_core])
        assert len(tuned) == sum(len(t.configs) for t in tuners.values()) - (
            0 if dtype == torch.float32 else len(tuners[fma].configs)
        )


@pytest.mark.parametrize(
    ("dtype", "allow_tf32"),
    [
        (torch.float32, False),
        (torch.float32, True),
        (torch.bfloat16, False),
        (torch.float16, False),
    ],
)
def test_tuner_rules_pick_the_tuner_the_launcher_picks(dtype, allow_tf32, monkeypatch):
    """Run the launcher's GPU branch with the tuners replaced by a recorder: the rule must send
    the variant it launches to the same tuner."""
    launched = []

    def record_tuner(self, *args, grid, warmup, **kwargs):
        launched.append((self, variant_of(self.base_fn, args, kwargs)))

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", allow_tf32)
    monkeypatch.setattr(fused_mlp, "triton_interpreted", lambda: False)
    monkeypatch.setattr(autotuner.Autotuner, "run", record_tuner)
    fused_linear_with_mask(torch.randn(4, 16).to(dtype), torch.randn(16, 16).to(dtype))
    ((tuner, variant),) = launched
    tuners = autotuners()[("recsys.ops.mlp.fused_linear", "_forward_kernel")]
    (name,) = [name for name, each in tuners.items() if each is tuner]
    assert tuner_for(variant, tuners) == name
    assert exact_fp32_dot(variant) == (dtype == torch.float32 and not allow_tf32)


def test_variants_specialize_as_a_gpu_launch_does():
    def kernel(a_ptr, b_ptr, n, m, one, seed, BLOCK: tl.constexpr):
        pass

    x = torch.empty(4, 32)
    variant = variant_of(kernel, (x, x[:, 1:], 32, 17, 1, 48), {"BLOCK": 4}, ("seed",))
    assert variant["signature"] == {
        "a_ptr": "*fp32",
        "b_ptr": "*fp32",
        "n": "i32",
        "m": "i32",
        "one": "constexpr",
        "seed": "i32",
        "BLOCK": "constexpr",
    }
    assert variant["constexprs"] == {"one": 1, "BLOCK": 4}
    assert variant["aligned"] == ["a_ptr", "n"]  # b_ptr is 4 bytes in; seed is not specialized


def test_a_kernel_with_several_tuners_and_no_rule_is_an_error():
    variant = {"module": "m", "kernel": "k", "signature": {}, "constexprs": {}, "options": {}}
    with pytest.raises(ValueError, match=r"m\.k runs through the autotuners .*no rule for"):
        tuner_for(variant, {"m.tuned_a": object(), "m.tuned_b": object()})
    assert tuner_for(variant, {"m.only": object()}) == "m.only"


def test_representatives_are_the_first_launch_and_the_largest_tile_of_each_path():
    def variant(block: int, source: str = "recorded", tuner: str | None = None) -> dict:
        return {
            "module": "m",
            "kernel": "k",
            "signature": {"x_ptr": "*fp32"},
            "constexprs": {"BLOCK_M": block, "BLOCK_N": 16},
            "options": {},
            "source": source,
            "tuner": tuner,
        }

    variants = [
        variant(32),
        variant(64),
        variant(16, "tf32"),
        variant(256, "tf32") | {"constexprs": {"BLOCK_M": 256, "INPUT_PRECISION": "tf32"}},
        variant(16, "autotune", "m.t"),
        variant(128, "autotune", "m.t"),
        variant(128, "autotune", "m.t") | {"options": {"num_warps": 8}},
        variant(16) | {"signature": {"x_ptr": "*bf16"}},
        variant(32, "autotune", "m.t") | {"signature": {"x_ptr": "*bf16"}},
    ]
    # a TF32 twin is the largest only where its path has nothing else; direct launches have
    # one path per dtype, a tuner one in all
    assert representatives(variants) == [variants[0], variants[1], variants[5], variants[7]]
