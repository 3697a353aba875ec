"""What a GPU launch compiles, from the variants the interpreter recorded
(``tests.kernel_launches``), and which of them may spill registers.

Under the interpreter a launcher may launch a kernel differently than on a GPU. Three
differences are bridged here:

- ``GPU_VALUES`` (``tests.kernel_launches``): constexprs set only for the interpreter
  (``DOT_IN_FP32``) take their GPU value.
- TF32: the tests run fp32 with ``torch.backends.cuda.matmul.allow_tf32`` off, so every fp32
  ``tl.dot`` is recorded as exact (``INPUT_PRECISION="ieee"``); a GPU user who turns TF32 on
  launches the same variant with ``"tf32"``. Each exact-fp32 variant gets that twin.
- Autotuning: a launcher that runs a kernel through ``triton.autotune`` on a GPU launches one
  fixed tile under the interpreter. Every ``Autotuner`` of a ``recsys.ops`` module is found by
  :func:`autotuners`, and each recorded variant of its kernel becomes one variant per config of
  the tuner the launcher would pick (config kwargs replace the constexprs, its ``num_warps`` /
  ``num_stages`` become options), tagged with the tuner's name. Where a kernel has several
  tuners, ``TUNER_RULES`` says which variants each one gets, as the launcher decides (checked
  against the launcher in ``tests/test_kernel_launches.py``).

The recorded launch of a tuned kernel stays in the list too: no GPU launch uses its tile, but
it is what the CPU tests check. The default test compiles :func:`representatives` (per kernel
its first recorded variant, and the largest tile of each launch path and dtype);
``scripts/kernel_table.py`` and the slow test compile every variant. A variant with stack or
local memory spilled registers; ``SPILLS_ALLOWED`` holds the few that may, each with its reason.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.kernel_launches import GPU_VALUES, MAX_SHARED_BYTES, variant_label

_FLOAT_POINTERS = ("*fp64", "*fp32", "*bf16", "*fp16")


def float_dtypes(variant: dict[str, Any]) -> str:
    """The floating-point pointer types of ``variant``'s arguments, sorted: ``"bf16,fp32"``."""
    found = {kind for kind in variant["signature"].values() if kind in _FLOAT_POINTERS}
    return ",".join(sorted(kind[1:] for kind in found))


def exact_fp32_dot(variant: dict[str, Any]) -> bool:
    """Whether ``variant`` runs its ``tl.dot`` on fp32 operands exactly: ``INPUT_PRECISION``
    ``"ieee"`` and fp32 the only float pointer type. On a GPU such a dot is FMAs on operands
    held in registers (no tensor cores), with their own tiles."""
    exact = variant["constexprs"].get("INPUT_PRECISION") == "ieee"
    return exact and float_dtypes(variant) == "fp32"


# Tuner (module.attribute) -> the variants a launcher sends through it, for a kernel that runs
# through several tuners. fused_mlp._forward: exact fp32 on the FMA tiles, the rest (bf16,
# fp16, fp32 as TF32) on the tensor-core tiles.
TUNER_RULES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "recsys.ops.mlp.fused_linear._forward_kernel_fma": exact_fp32_dot,
    "recsys.ops.mlp.fused_linear._forward_kernel_tuned": lambda variant: not exact_fp32_dot(
        variant
    ),
}


@functools.cache
def autotuners() -> dict[tuple[str, str], dict[str, Any]]:
    """Every ``triton.autotune`` object of a ``recsys.ops`` module, by the (module, name) of the
    kernel it tunes: ``{kernel: {"recsys.ops.x._tuned_name": Autotuner, ...}}``."""
    import triton.runtime.autotuner as autotuner

    import recsys.ops

    found: dict[tuple[str, str], dict[str, Any]] = {}
    for module_info in pkgutil.walk_packages(recsys.ops.__path__, "recsys.ops."):
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if isinstance(value, autotuner.Autotuner):
                kernel = (value.base_fn.__module__, value.base_fn.__name__)
                found.setdefault(kernel, {})[f"{module_info.name}.{name}"] = value
    return found


def tuner_for(variant: dict[str, Any], tuners: dict[str, Any]) -> str:
    """The name of the tuner in ``tuners`` (name -> Autotuner, all of one kernel) that a launch
    of ``variant`` goes through on a GPU.

    Raises:
        ValueError: the kernel has several tuners and ``TUNER_RULES`` lacks one of them, or the
            rules give ``variant`` to no tuner or to more than one.
    """
    if len(tuners) == 1:
        return next(iter(tuners))
    unruled = sorted(set(tuners) - set(TUNER_RULES))
    kernel = f"{variant['module']}.{variant['kernel']}"
    if unruled:
        raise ValueError(
            f"{kernel} runs through the autotuners {sorted(tuners)}; TUNER_RULES in "
            f"tests/kernel_variants.py has no rule for {unruled} (say which variants each gets)"
        )
    chosen = [name for name in tuners if TUNER_RULES[name](variant)]
    if len(chosen) != 1:
        raise ValueError(
            f"TUNER_RULES give {kernel} {variant_label(variant)} ({float_dtypes(variant)}) to "
            f"{chosen or 'no tuner'}; expected exactly one of {sorted(tuners)}"
        )
    return chosen[0]


def _with_gpu_values(variant: dict[str, Any]) -> dict[str, Any]:
    constexprs = variant["constexprs"] | {
        k: v for k, v in GPU_VALUES.items() if k in variant["constexprs"]
    }
    return variant | {"constexprs": constexprs, "source": "recorded", "tuner": None}


def _tf32_twin(variant: dict[str, Any]) -> dict[str, Any]:
    constexprs = variant["constexprs"] | {"INPUT_PRECISION": "tf32"}
    return variant | {"constexprs": constexprs, "source": "tf32"}


def _configured(variant: dict[str, Any], tuner: str, config: Any) -> dict[str, Any]:
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if getattr(config, "num_ctas", 1) != 1:
        options["num_ctas"] = config.num_ctas
    if getattr(config, "maxnreg", None) is not None:
        options["maxnreg"] = config.maxnreg
    return variant | {
        "constexprs": variant["constexprs"] | config.kwargs,
        "options": options,
        "source": "autotune",
        "tuner": tuner,
    }


def gpu_variants(recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The variants GPU launches compile, from the ``recorded`` interpreter launches (see the
    module docstring), each once, each with ``source`` (``"recorded"``, ``"tf32"`` or
    ``"autotune"``) and ``tuner`` (the tuner's name, or None). A recorded launch of a tuned
    kernel stays in the list (it is what the CPU tests check) but no GPU launch uses its tile.
    """
    tuned = autotuners()
    found: dict[str, dict[str, Any]] = {}
    for variant in map(_with_gpu_values, recorded):
        bases = [variant]
        if exact_fp32_dot(variant):
            bases.append(_tf32_twin(variant))
        tuners = tuned.get((variant["module"], variant["kernel"]))
        expanded = [variant] if tuners else bases
        for base in bases if tuners else ():
            name = tuner_for(base, tuners)
            expanded += [_configured(base, name, config) for config in tuners[name].configs]
        for each in expanded:
            found.setdefault(json.dumps(each, sort_keys=True, default=str), each)
    return list(found.values())


def tile_size(variant: dict[str, Any]) -> int:
    """Product of the variant's integer ``BLOCK_*`` constexprs: the elements of its tile."""
    blocks = [
        value
        for name, value in variant["constexprs"].items()
        if name.startswith("BLOCK_") and isinstance(value, int) and not isinstance(value, bool)
    ]
    return math.prod(blocks)


def representatives(variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the default test compiles: for every kernel its first recorded variant, and for
    every GPU launch path of it (direct launches of each float dtype set, or each tuner) the
    variant with the largest tile (the first such; a TF32 twin only where the path has nothing
    else), each once, in order."""

    def size(variant: dict[str, Any]) -> tuple[bool, int]:
        return variant["constexprs"].get("INPUT_PRECISION") != "tf32", tile_size(variant)

    chosen: dict[Any, dict[str, Any]] = {}
    largest: dict[Any, dict[str, Any]] = {}
    for variant in variants:
        kernel = (variant["module"], variant["kernel"])
        if variant["source"] == "recorded":
            chosen.setdefault(kernel, variant)
        if _interpreter_only(variant):
            continue
        path = (*kernel, variant["tuner"], variant["tuner"] or float_dtypes(variant))
        if path not in largest or size(variant) > size(largest[path]):
            largest[path] = variant
    picked = {json.dumps(v, sort_keys=True, default=str): v for v in chosen.values()}
    for variant in largest.values():
        picked.setdefault(json.dumps(variant, sort_keys=True, default=str), variant)
    return list(picked.values())


# --------------------------------------------------------------------------- spills


@dataclass(frozen=True)
class SpillAllowance:
    """Variants of ``kernel`` (module.name) that may spill registers, and why that is
    acceptable. A variant matches when :func:`variant_fields` holds every item of ``match``."""

    kernel: str
    match: dict[str, Any]
    reason: str


_FMA = "recsys.ops.mlp.fused_linear._forward_kernel_fma"
_TENSOR_CORES = "recsys.ops.mlp.fused_linear._forward_kernel_tuned"
SPILLS_ALLOWED: tuple[SpillAllowance, ...] = (
    SpillAllowance(
        "recsys.ops.mlp.fused_linear._forward_kernel",
        {"tuner": _TENSOR_CORES},
        "a tensor-core autotune candidate: the tuner times every config on the GPU and keeps the "
        "fastest, so a config that spills costs its compile time (compile_s), not the run. The "
        "fused epilogue spills on top of the fp32 accumulators (int64 element offsets over the "
        "whole tile, the saved pre-activation, dropout's tl.rand): most with dropout and with "
        "rows not 16-byte aligned, least for relu without dropout",
    ),
    SpillAllowance(
        "recsys.ops.mlp.fused_linear._forward_kernel",
        {"tuner": _FMA, "DROPOUT": True},
        "an FMA autotune candidate with dropout (at most 80 B): tl.rand over the tile's int64 "
        "element offsets on top of the FMA operands; the same tiles without dropout do not "
        "spill, and the tuner keeps the fastest config",
    ),
    SpillAllowance(
        "recsys.ops.mlp.fused_linear._backward_kernel",
        {"ACTIVATION": "gelu", "DROPOUT": True},
        "16 B on sm_80 only (168 registers; none on sm_90): the 64-bit addresses of four "
        "[32, 64] tiles (dy, z, mask bytes, dz) live together with erf's polynomial",
    ),
)
_INTERPRETER_TILE = (
    "the interpreter's fixed tile: a GPU launch autotunes instead, so no GPU compiles this one"
)


def variant_fields(variant: dict[str, Any]) -> dict[str, Any]:
    """What a :class:`SpillAllowance` matches on: constexprs, options, ``floats``
    (:func:`float_dtypes`), ``source`` and ``tuner``."""
    return (
        variant["constexprs"]
        | variant["options"]
        | {
            "floats": float_dtypes(variant),
            "source": variant["source"],
            "tuner": variant["tuner"],
        }
    )


def spilled(usage: dict[str, Any]) -> bool:
    """Whether a measured variant keeps anything in stack or local memory (spilled
    registers, or an array ptxas could not hold in registers)."""
    return usage["stack_bytes"] > 0 or usage["local_bytes"] > 0


def spill_reason(variant: dict[str, Any]) -> str | None:
    """Why ``variant`` may spill: its ``SPILLS_ALLOWED`` reason, or for the interpreter's tile
    of a kernel that GPU launches autotune, that no GPU compiles it; None when it may not."""
    if _interpreter_only(variant):
        return _INTERPRETER_TILE
    fields = variant_fields(variant)
    kernel = f"{variant['module']}.{variant['kernel']}"
    for allowance in SPILLS_ALLOWED:
        if allowance.kernel == kernel and allowance.match.items() <= fields.items():
            return allowance.reason
    return None


def unexplained_spills(variants: list[dict[str, Any]], rows: list[dict]) -> list[str]:
    """One message per compiled row (``tests.kernel_launches.compile_report``) that spilled
    without a reason in ``SPILLS_ALLOWED``."""
    messages = []
    for row in rows:
        usage, variant = row.get("usage"), variants[row["index"]]
        if usage is None or not spilled(usage) or spill_reason(variant):
            continue
        messages.append(
            f"{variant['module']}.{variant['kernel']} sm_{row['target']} "
            f"({float_dtypes(variant)}, {variant['source']}) {variant_label(variant)}: "
            f"{usage['registers']} registers, {usage['stack_bytes']} B stack, "
            f"{usage['local_bytes']} B local, ptxas: {usage['spill_store_bytes']} B spill stores"
            " -- change the launch choice, or add it to SPILLS_ALLOWED with the reason"
        )
    return messages


def notes(variant: dict[str, Any], capability: int, usage: dict[str, Any]) -> str:
    """The notes column of a kernel-table row: why a spill is acceptable, a config no GPU of
    that target can launch, an interpreter-only tile."""
    said = []
    if spilled(usage):
        said.append(spill_reason(variant) or "spills registers: NOT EXPLAINED")
    limit = MAX_SHARED_BYTES[capability]
    if usage["shared_bytes"] > limit:
        said.append(
            f"needs {usage['shared_bytes']} B shared memory, over sm_{capability}'s {limit} B: "
            "the GPU refuses it and the autotuner skips it (compiled for nothing)"
        )
    if _interpreter_only(variant) and not spilled(usage):
        said.append(_INTERPRETER_TILE)
    return "; ".join(said)


def _interpreter_only(variant: dict[str, Any]) -> bool:
    tuned = (variant["module"], variant["kernel"]) in autotuners()
    return tuned and variant["source"] == "recorded"
