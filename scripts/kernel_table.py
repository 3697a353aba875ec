"""Every Triton kernel variant a GPU launch of recsys compiles, compiled for sm_80 and sm_90
without a GPU, with its registers per thread, stack / shared / local memory, spill stores and
compile time -> benchmarks/results/kernels.csv.

The variants start from the ones the op tests launch under the interpreter (every constexpr
choice of the launchers over the tests' shapes and dtypes) and become what a GPU launch compiles
(``tests/kernel_variants.py``): interpreter-only constexprs at their GPU value, a TF32 twin of
every exact-fp32 ``tl.dot``, and one variant per autotune config of the tuner the launcher picks
(column ``tuner``; ``source`` says recorded / tf32 / autotune). Each is compiled by
``triton.compile`` for a ``GPUTarget`` and measured with the triton wheel's ``cuobjdump
-res-usage`` and ptxas's report. Stack or local memory above 0 means spilled registers: the
notes say why that is acceptable (``SPILLS_ALLOWED``), and the script fails on a spill they do
not explain or a compile error. ``shared_bytes`` is what a launch asks for (static plus
dynamic; the notes flag a config over a target's per-block limit, which a GPU refuses to
launch); ``compile_s`` is the seconds ``triton.compile`` took here (CPU-bound, so about what a
GPU machine's first launch, or its autotuner for each config, spends compiling).
Variants are compiled without the divisibility specialization a real launch adds for
16-byte-aligned pointers and sizes, so a launch on a GPU may use somewhat fewer registers. The
file is rewritten on each run: it describes the kernels of one commit. The default test run
compiles the representative variants only (``tests/ops/test_kernels_compile.py``).

    python scripts/kernel_table.py --jobs 2    # all variants: about 40 minutes on 2 CPU cores
    python scripts/kernel_table.py --representative --out-dir /tmp/k   # the default test's set
    python scripts/kernel_table.py --from-raw raw.json   # notes redone from a --save-raw run
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks._harness import git_commit, results_dir, versions  # noqa: E402
from tests.kernel_launches import (  # noqa: E402
    TARGETS,
    compile_failures,
    compile_in_subprocess,
    record_launches,
    variant_label,
)
from tests.kernel_variants import (  # noqa: E402
    float_dtypes,
    gpu_variants,
    notes,
    representatives,
    spilled,
    unexplained_spills,
)
from tests.ops.test_kernels_compile import OP_TESTS  # noqa: E402

COLUMNS = (
    "kernel",
    "source",
    "tuner",
    "dtypes",
    "variant",
    "target",
    "registers",
    "stack_bytes",
    "shared_bytes",
    "local_bytes",
    "spill_store_bytes",
    "spills",
    "compile_s",
    "notes",
    "device",
    "versions",
    "commit",
)


def ptxas_version() -> str:
    """The release of the ptxas the triton wheel ships (``12.9``), which sets the registers."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    text = subprocess.run([str(tool), "--version"], capture_output=True, text=True).stdout
    return text.rsplit("release ", 1)[-1].split(",", 1)[0] if "release " in text else "unknown"


def table_rows(variants: list[dict], compiled: list[dict]) -> list[list]:
    """One CSV row (without the provenance columns) per compiled (variant, target)."""
    rows = []
    for row in compiled:
        usage = row.get("usage")
        if usage is None:
            continue
        variant = variants[row["index"]]
        rows.append(
            [
                f"{variant['module']}.{variant['kernel']}",
                variant["source"],
                variant["tuner"] or "",
                float_dtypes(variant),
                variant_label(variant),
                f"sm_{row['target']}",
                usage["registers"],
                usage["stack_bytes"],
                usage["shared_bytes"],
                usage["local_bytes"],
                usage["spill_store_bytes"],
                "yes" if spilled(usage) else "no",
                usage["compile_s"],
                notes(variant, row["target"], usage),
            ]
        )
    return rows


def compile_all(representative: bool, jobs: int) -> tuple[list[dict], list[dict]]:
    """Record the op tests' launches, expand them into GPU variants (only the representative
    ones when asked) and compile each for every target: (variants, compile rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        recorded = record_launches(OP_TESTS, Path(tmp) / "variants.json", "-k", "triton", jobs=jobs)
        variants = gpu_variants(recorded)
        if representative:
            variants = representatives(variants)
        return variants, compile_in_subprocess(variants, TARGETS, Path(tmp), jobs=jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None, help="default benchmarks/results")
    parser.add_argument("--jobs", type=int, default=1, help="compiler processes (default 1)")
    parser.add_argument(
        "--representative", action="store_true", help="only the default test's variants"
    )
    parser.add_argument("--save-raw", type=Path, help="also write the variants and compile rows")
    parser.add_argument(
        "--from-raw", type=Path, help="write the table from a --save-raw file, compiling nothing"
    )
    args = parser.parse_args()
    os.chdir(REPO_ROOT)
    if args.from_raw:
        raw = json.loads(args.from_raw.read_text())
        variants, compiled = raw["variants"], raw["rows"]
    else:
        variants, compiled = compile_all(args.representative, args.jobs)
    if args.save_raw:
        args.save_raw.write_text(json.dumps({"variants": variants, "rows": compiled}, default=str))
    rows = table_rows(variants, compiled)
    path = results_dir(args.out_dir) / "kernels.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    provenance = ["none (compiled offline)", f"{versions()} ptxas={ptxas_version()}", git_commit()]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(row + provenance for row in rows)
    spills = sum(row[COLUMNS.index("spills")] == "yes" for row in rows)
    print(f"{len(rows)} rows ({len(variants)} variants x {len(TARGETS)} targets) -> {path}")
    print(f"spilling: {spills}")
    problems = compile_failures(variants, compiled) + unexplained_spills(variants, compiled)
    if problems:
        raise SystemExit("compile failures and unexplained spills:\n" + "\n".join(problems))


if __name__ == "__main__":
    main()
