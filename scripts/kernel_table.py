"""Every Triton kernel variant recsys launches, compiled for sm_80 and sm_90 without a GPU, with
its registers per thread and stack / shared / local memory -> benchmarks/results/kernels.csv.

The variants are the ones the op tests launch under the interpreter (every constexpr choice of
the launchers over the tests' shapes and dtypes); each is compiled by ``triton.compile`` for a
``GPUTarget`` and measured with the triton wheel's ``cuobjdump -res-usage``. Local memory or
stack above 0 means spilled registers. Variants are compiled without the divisibility
specialization a real launch adds for 16-byte-aligned pointers and sizes, so a launch on a GPU
may use somewhat fewer registers. The file is rewritten on each run: it describes the kernels of
one commit. ``tests/ops/test_kernels_compile.py`` compiles one variant per kernel in
the default test run.

    python scripts/kernel_table.py            # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from _harness import git_commit, results_dir, versions  # noqa: E402

from tests.kernel_launches import (  # noqa: E402
    TARGETS,
    compile_variant,
    record_launches,
    resource_usage,
)
from tests.ops.test_kernels_compile import OP_TESTS  # noqa: E402

COLUMNS = (
    "kernel",
    "variant",
    "target",
    "registers",
    "stack_bytes",
    "shared_bytes",
    "local_bytes",
    "spills",
    "notes",
    "versions",
    "commit",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None, help="default benchmarks/results")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        raise SystemExit("kernel_table.py compiles for real GPUs: unset TRITON_INTERPRET")
    os.chdir(REPO_ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        variants = record_launches(OP_TESTS, Path(tmp) / "variants.json", "-k", "triton")
    rows, failures = [], []
    for variant in variants:
        label = json.dumps(variant["constexprs"] | variant["options"], sort_keys=True, default=str)
        for capability in TARGETS:
            try:
                usage = resource_usage(compile_variant(variant, capability))
            except Exception as error:  # reported, and the script fails at the end
                failures.append(f"{variant['kernel']} sm_{capability} {label}: {error}")
                continue
            spilled = usage["local_bytes"] > 0 or usage["stack_bytes"] > 0
            rows.append(
                [
                    f"{variant['module']}.{variant['kernel']}",
                    label,
                    f"sm_{capability}",
                    *usage.values(),
                    "yes" if spilled else "no",
                    "registers spill to stack: not examined yet" if spilled else "",
                ]
            )
    path = results_dir(args.out_dir) / "kernels.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    provenance = [versions(), git_commit()]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(row + provenance for row in rows)
    spills = sum(row[7] == "yes" for row in rows)
    print(f"{len(rows)} rows ({len(variants)} variants x {len(TARGETS)} targets) -> {path}")
    print(f"spilling: {spills}")
    if failures:
        raise SystemExit("compile failures:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
