#!/usr/bin/env bash
# Run the GPU tests and every benchmark on a CUDA machine in one call.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        (OUT_DIR default: benchmarks/results)
#
# For a machine with torch + triton preinstalled and no venv or network: uses `python3` from
# PATH (override with PYTHON=...) and puts the repository on PYTHONPATH instead of installing it.
# Writes into OUT_DIR: env.txt (nvidia-smi, versions), pytest_gpu.log, bench_<topic>.log and the
# benchmarks' CSV rows (<topic>.csv). A failing step does not stop the others; the exit status is
# non-zero when any step failed, and a summary is printed at the end.
set -u

cd "$(dirname "$0")/.."
OUT_DIR=${1:-benchmarks/results}
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RECSYS_BENCH_DIR="$OUT_DIR"
# Real kernels on the GPU, not the CPU interpreter the CPU test runs use.
export TRITON_INTERPRET=0

SUMMARY=()
FAILED=0

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
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
        "$(git status --porcelain 2>/dev/null | grep -q . && echo '(dirty)')"
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
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    step "pytest -m gpu" "$OUT_DIR/pytest_gpu.log" gpu_tests
    if grep -q "^NO GPU TESTS" "$OUT_DIR/pytest_gpu.log"; then
        SUMMARY[-1]="SKIP  pytest -m gpu (no test is marked gpu)"
    fi
else
    SUMMARY+=("FAIL  pytest -m gpu (pytest is not installed for $PYTHON)")
    FAILED=1
fi

for script in scripts/bench_*.py; do
    [ -e "$script" ] || continue
    topic=$(basename "$script" .py)
    step "$topic --device cuda" "$OUT_DIR/$topic.log" "$PYTHON" "$script" --device cuda
done

echo
echo "== summary (results and logs in $OUT_DIR)"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
