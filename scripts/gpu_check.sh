#!/usr/bin/env bash
# Run the GPU tests and every benchmark on a CUDA machine in one call.
#
#   bash scripts/gpu_check.sh [OUT_DIR [STEP...]]   (OUT_DIR default: benchmarks/results)
#
# STEP names what to run, all of them by default: `gpu_tests` (pytest -m gpu), `device_tests`
# (the op and embedding tests with CUDA as torch's default device, so the compiled kernels are
# checked against the same float64 references as under the interpreter), `kernel_table`
# (scripts/kernel_table.py), `train_cuda_graphs` (the default recipe 300 steps eager, compiled, and
# with train.cuda_graphs: samples/s of each as train_step.csv rows) and one per benchmark: `bench_<topic>` (`bench_mlp`, ...) runs
# `python -m benchmarks.<topic>`. BENCH_ARGS is added to every benchmark's command line (e.g.
# BENCH_ARGS=--quick). RECSYS_COMMIT names the commit in the results where the tree arrived
# without .git (a GPU machine that receives a copy of it).
#
# For a machine with torch + triton preinstalled and no venv or network: uses `python3` from
# PATH (override with PYTHON=...) and puts the repository on PYTHONPATH instead of installing it.
# Writes into OUT_DIR: env.txt (nvidia-smi, versions), pytest_gpu.log, bench_<topic>.log and the
# benchmarks' CSV rows (<topic>.csv). A failing step does not stop the others; the exit status is
# non-zero when any step failed, and a summary is printed at the end.
set -u

cd "$(dirname "$0")/.."
OUT_DIR=${1:-benchmarks/results}
shift $(($# > 0 ? 1 : 0))
STEPS=("$@")
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RECSYS_BENCH_DIR="$OUT_DIR"
# Real kernels on the GPU, not the CPU interpreter the CPU test runs use.
export TRITON_INTERPRET=0

SUMMARY=()
FAILED=0

# wanted NAME: true when NAME was asked for (or no step was named).
wanted() {
    [ ${#STEPS[@]} -eq 0 ] && return 0
    local s
    for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
    return 1
}

# step NAME LOG COMMAND...: run COMMAND with its output in LOG and on screen; record the outcome.
step() {
    local name=$1 log=$2
    shift 2
    echo "== $name  (log: $log)"
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("PASS  $name")
    else
        SUMMARY+=("FAIL  $name (exit $rc, see $log)")
        FAILED=1
    fi
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(hostname)"
    echo "repo: $PWD"
    if [ -n "${RECSYS_COMMIT:-}" ]; then
        echo "commit: $RECSYS_COMMIT"
    else
        echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
            "$(git status --porcelain 2>/dev/null | grep -q . && echo '(dirty)')"
    fi
    echo
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    echo
    "$PYTHON" - <<'EOF' 2>&1
import importlib, platform
print("python", platform.python_version(), platform.machine())
for name in ("torch", "triton", "torchrec", "fbgemm_gpu", "pytest", "numpy"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as error:
        print(f"{name} MISSING ({type(error).__name__}: {error})")
try:
    import torch
    print("cuda available:", torch.cuda.is_available(), "| torch cuda:", torch.version.cuda)
    for i in range(torch.cuda.device_count()):
        print(f"cuda:{i}", torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
except Exception as error:
    print("torch cuda query failed:", error)
EOF
} >"$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"
echo

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
then
    echo "WARNING: torch sees no CUDA device; the GPU steps below will fail" >&2
fi
if ! "$PYTHON" -c "import torchrec" 2>/dev/null; then
    echo "NOTE: torchrec does not import here. recsys imports torchrec for KeyedJaggedTensor, so"
    echo "      tests that import recsys fail and benchmarks skip the providers that need it;"
    echo "      everything else still runs."
fi

# pytest exits 5 when it collects nothing: no GPU-marked tests yet is reported, not failed.
gpu_tests() {
    # -m gpu on the command line replaces pyproject's "-m 'not slow and not gpu'".
    "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider
    local rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "NO GPU TESTS: pytest collected no test marked gpu"
        return 0
    fi
    return "$rc"
}
# The op and embedding tests again, on the GPU: CUDA is torch's default device (tests/conftest.py).
device_tests() {
    RECSYS_TEST_DEVICE=cuda "$PYTHON" -m pytest tests/ops tests/embedding -q -p no:cacheprovider \
        -m "not slow and not gpu"
}
if ! "$PYTHON" -c "import pytest" 2>/dev/null; then
    SUMMARY+=("FAIL  pytest (pytest is not installed for $PYTHON)")
    FAILED=1
else
    if wanted gpu_tests; then
        step "pytest -m gpu" "$OUT_DIR/pytest_gpu.log" gpu_tests
        if grep -q "^NO GPU TESTS" "$OUT_DIR/pytest_gpu.log"; then
            SUMMARY[-1]="SKIP  pytest -m gpu (no test is marked gpu)"
        fi
    fi
    if wanted device_tests; then
        step "op and embedding tests on cuda" "$OUT_DIR/pytest_device.log" device_tests
    fi
fi
if wanted kernel_table; then
    step "kernel_table" "$OUT_DIR/kernel_table.log" "$PYTHON" scripts/kernel_table.py \
        --jobs "$(nproc)" --out-dir "$OUT_DIR"
fi

# The default recipe's step with and without CUDA graphs (train.cuda_graphs), beside the eager and
# the compiled step: 300 steps each, windows of 50, the first left out (warm-up, compilation and
# graph recording); rows in train_step.csv.
if wanted train_cuda_graphs; then
    step "train_cuda_graphs" "$OUT_DIR/train_cuda_graphs.log" "$PYTHON" -m benchmarks.train_step \
        --device cuda --variants fp32 compile cuda_graphs --steps 300 --window 50
fi

# One step per benchmark module (benchmarks/_*.py are its helpers), named bench_<topic>.
for module in benchmarks/[!_]*.py; do
    [ -e "$module" ] || continue
    name=bench_$(basename "$module" .py)
    wanted "$name" || continue
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    step "$name --device cuda" "$OUT_DIR/$name.log" "$PYTHON" -m "benchmarks.${name#bench_}" \
        --device cuda ${BENCH_ARGS:-}
done

echo
echo "== summary (results and logs in $OUT_DIR)"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
