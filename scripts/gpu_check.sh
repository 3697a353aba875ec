#!/usr/bin/env bash
# Run the GPU tests and every benchmark on a CUDA machine in one call, most important first.
#
#   bash scripts/gpu_check.sh [--budget SECONDS] [OUT_DIR [STEP...]]
#   (OUT_DIR default: benchmarks/results)
#
# Steps, in this order (STEP names a subset; all of them by default):
#   device_tests       the op and embedding tests with CUDA as torch's default device, so the
#                      compiled kernels are checked against the same float64 references as
#                      under the interpreter (correctness of every kernel on the device first)
#   gpu_tests          pytest -m gpu
#   train_cuda_graphs  the default recipe 300 steps eager, compiled, and with train.cuda_graphs:
#                      samples/s of each as train_step.csv rows
#   mlperf_dcnv2_step  the training step of configs/dlrm_dcnv2_mlperf.toml at full size, every
#                      table in device memory (row-wise Adagrad state: 98 GiB), batch 65,536, on
#                      batches made beforehand: benchmarks/mlperf_dlrm.py --max-rows 0, fp32 and
#                      bf16, dense layers on Triton (auto) and on torch; mlperf_dlrm.csv rows
#   mlperf_dcnv2       configs/dlrm_dcnv2_mlperf.toml with every table in device memory (row-wise
#                      Adagrad state: 98 GiB in all; needs 120 GiB of device memory), 300 steps
#                      of 65,536: its log and metrics.jsonl under OUT_DIR/mlperf_dcnv2/ (end to
#                      end: the synthetic data is made as it trains, by the loader's workers)
#   kernel_table       scripts/kernel_table.py (compiles for sm_80 / sm_90: runs without a GPU)
#   bench_<topic>      `python -m benchmarks.<topic> --device cuda` for each benchmark module
#
# --budget SECONDS bounds the whole call: each step runs under `timeout` with at most what is
# left of the budget (and at most its own cap, STEP_CAPS below), a step with less than a minute
# left is skipped with a line saying so, and what a step wrote before its time ran out is kept
# (every step writes its logs and rows as it goes). Without a budget nothing is timed out.
# Without a CUDA device the GPU steps are skipped, each with a line, and the others run.
#
# BENCH_ARGS is added to every benchmark's command line (e.g. BENCH_ARGS=--quick).
# RECSYS_COMMIT names the commit in the results where the tree arrived without .git (a GPU
# machine that receives a copy of it).
#
# For a machine with torch + triton preinstalled and no venv or network: uses `python3` from
# PATH (override with PYTHON=...) and puts the repository on PYTHONPATH instead of installing it.
# TorchRec for such a machine: `bash scripts/offline_wheels.sh DIR` where pip works, then there
# `bash DIR/install.sh /tmp/site && export PYTHONPATH=/tmp/site` before this script.
# Writes into OUT_DIR: env.txt (nvidia-smi, versions), a log per step and the benchmarks' CSV rows
# (<topic>.csv). A failing step does not stop the others; the exit status is non-zero when any
# step failed (a step stopped by the budget is listed as TIME, not as a failure), and a summary
# is printed at the end.
set -u

cd "$(dirname "$0")/.."
BUDGET=0
if [ "${1:-}" = "--budget" ]; then
    if ! [[ "${2:-}" =~ ^[0-9]+$ ]] || [ "$2" -lt 1 ]; then
        echo "gpu_check.sh: --budget ${2:-}: expected a number of seconds >= 1" >&2
        exit 2
    fi
    BUDGET=$2
    shift 2
fi
START=$(date +%s)
MIN_STEP_S=60  # a step is not started with less of the budget left
RESERVE_S=10   # kept for the summary
# The most each step may take under a budget (seconds); bench_* steps take BENCH_CAP each.
declare -A STEP_CAPS=(
    [device_tests]=240 [gpu_tests]=150 [train_cuda_graphs]=180 [mlperf_dcnv2_step]=300
    [mlperf_dcnv2]=240
    [kernel_table]=300
)
BENCH_CAP=120
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

# wanted NAME: true when NAME was asked for (or no step was named).
wanted() {
    [ ${#STEPS[@]} -eq 0 ] && return 0
    local s
    for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
    return 1
}

# skip NAME WHY: record a step that does not run here.
skip() {
    STEP_RC=-1
    echo "== $1: skipped ($2)"
    SUMMARY+=("SKIP  $1 ($2)")
}

# step NAME CAP LOG COMMAND...: run COMMAND with its output in LOG and on screen, under the
# budget (at most CAP seconds); record the outcome. STEP_RC is COMMAND's exit status (or -1 when
# the budget left no time to start it).
step() {
    local name=$1 cap=$2 log=$3
    shift 3
    local limit=0
    STEP_RC=-1
    if [ "$BUDGET" -gt 0 ]; then
        local left=$((BUDGET - ($(date +%s) - START) - RESERVE_S))
        if [ "$left" -lt "$MIN_STEP_S" ]; then
            skip "$name" "budget: ${left}s left of ${BUDGET}s"
            return
        fi
        limit=$((left < cap ? left : cap))
        echo "== $name  (log: $log; at most ${limit}s)"
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
    else
        echo "== $name  (log: $log)"
        "$@" 2>&1 | tee "$log"
    fi
    STEP_RC=${PIPESTATUS[0]}
    if [ "$STEP_RC" -eq 0 ]; then
        SUMMARY+=("PASS  $name")
    elif [ "$limit" -gt 0 ] && { [ "$STEP_RC" -eq 124 ] || [ "$STEP_RC" -eq 137 ]; }; then
        SUMMARY+=("TIME  $name (stopped by the budget after ${limit}s; what it wrote is kept in $log)")
    else
        SUMMARY+=("FAIL  $name (exit $STEP_RC, see $log)")
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

HAS_CUDA=1
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
then
    HAS_CUDA=0
    echo "NOTE: torch sees no CUDA device: the GPU steps are skipped, the others run"
fi
if ! "$PYTHON" -c "import torchrec" 2>/dev/null; then
    echo "NOTE: torchrec does not import here. recsys imports torchrec for KeyedJaggedTensor, so"
    echo "      tests that import recsys fail and benchmarks skip the providers that need it;"
    echo "      everything else still runs."
fi

# gpu_step NAME CAP LOG COMMAND...: step, or a SKIP line without a CUDA device.
gpu_step() {
    if [ "$HAS_CUDA" -eq 0 ]; then
        skip "$1" "no CUDA device"
        return
    fi
    step "$@"
}

HAS_PYTEST=1
if ! "$PYTHON" -c "import pytest" 2>/dev/null; then
    HAS_PYTEST=0
    SUMMARY+=("FAIL  pytest (pytest is not installed for $PYTHON)")
fi

# The op and embedding tests again, on the GPU: CUDA is torch's default device (tests/conftest.py).
if wanted device_tests && [ "$HAS_PYTEST" -eq 1 ]; then
    gpu_step device_tests "${STEP_CAPS[device_tests]}" "$OUT_DIR/pytest_device.log" \
        env RECSYS_TEST_DEVICE=cuda "$PYTHON" -m pytest tests/ops tests/embedding -q \
        -p no:cacheprovider -m "not slow and not gpu"
fi
# -m gpu on the command line replaces pyproject's "-m 'not slow and not gpu'"; pytest exits 5
# when it collects nothing: no GPU-marked test yet is reported, not failed. -v: a line per test as
# it finishes, so a step stopped by the budget still says which tests passed.
# With pytest-timeout there, no test may take more than 60 s (Triton's autotuning compiles each
# config), so the step ends on its own and prints every failure's traceback.
if wanted gpu_tests && [ "$HAS_PYTEST" -eq 1 ]; then
    per_test=()
    "$PYTHON" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 60)
    gpu_step gpu_tests "${STEP_CAPS[gpu_tests]}" "$OUT_DIR/pytest_gpu.log" \
        "$PYTHON" -m pytest -m gpu -v --durations=15 -p no:cacheprovider \
        ${per_test[@]+"${per_test[@]}"}
    if [ "${STEP_RC:-0}" -eq 5 ]; then
        SUMMARY[-1]="SKIP  gpu_tests (no test is marked gpu)"
    fi
fi

# The default recipe's step with and without CUDA graphs (train.cuda_graphs), beside the eager and
# the compiled step: 300 steps each, windows of 50, the first left out (warm-up, compilation and
# graph recording); rows in train_step.csv.
if wanted train_cuda_graphs; then
    gpu_step train_cuda_graphs "${STEP_CAPS[train_cuda_graphs]}" \
        "$OUT_DIR/train_cuda_graphs.log" "$PYTHON" -m benchmarks.train_step \
        --device cuda --variants fp32 compile cuda_graphs --steps 300 --window 50
fi

# MLPerf's DLRM-DCNv2 at full size, every table in device memory: its training step alone (rows
# in mlperf_dlrm.csv), then a training run (samples/s in its log).
MEMORY_GIB=""
# big_gpu_step NAME CAP LOG COMMAND...: gpu_step, or a SKIP line on a device under 120 GiB.
big_gpu_step() {
    if [ -z "$MEMORY_GIB" ]; then
        MEMORY_GIB=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_properties(0)\
.total_memory // 2**30 if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
    fi
    if [ "$HAS_CUDA" -eq 1 ] && [ "$MEMORY_GIB" -lt 120 ]; then
        skip "$1" "needs 120 GiB of device memory, the device has ${MEMORY_GIB} GiB"
        return
    fi
    gpu_step "$@"
}
if wanted mlperf_dcnv2_step; then
    big_gpu_step mlperf_dcnv2_step "${STEP_CAPS[mlperf_dcnv2_step]}" \
        "$OUT_DIR/mlperf_dcnv2_step.log" "$PYTHON" -m benchmarks.mlperf_dlrm --device cuda \
        --max-rows 0 --batch-size 65536 --embedding-optimizer rowwise_adagrad \
        --precision fp32 bf16 --warmup 2 --repeats 10
fi
if wanted mlperf_dcnv2; then
    big_gpu_step mlperf_dcnv2 "${STEP_CAPS[mlperf_dcnv2]}" "$OUT_DIR/mlperf_dcnv2.log" \
        "$PYTHON" -m recsys train --config configs/dlrm_dcnv2_mlperf.toml --run.device=cuda \
        --train.embedding_optimizer=rowwise_adagrad --train.max_steps=300 \
        --train.log_every_steps=25 --train.eval_every_steps=0 \
        --data.synthetic.num_valid_samples=65536 --data.synthetic.num_test_samples=262144 \
        --checkpoint.save_final=false --train.progress_bar=false --run.tensorboard=false \
        --run.dir="$OUT_DIR/mlperf_dcnv2" --run.overwrite=true
fi

if wanted kernel_table; then
    step kernel_table "${STEP_CAPS[kernel_table]}" "$OUT_DIR/kernel_table.log" \
        "$PYTHON" scripts/kernel_table.py --jobs "$(nproc)" --out-dir "$OUT_DIR"
fi

# One step per benchmark module (benchmarks/_*.py are its helpers), named bench_<topic>.
for module in benchmarks/[!_]*.py; do
    [ -e "$module" ] || continue
    name=bench_$(basename "$module" .py)
    wanted "$name" || continue
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    gpu_step "$name" "$BENCH_CAP" "$OUT_DIR/$name.log" "$PYTHON" -m "benchmarks.${name#bench_}" \
        --device cuda ${BENCH_ARGS:-}
done

echo
took="$(($(date +%s) - START))s"
[ "$BUDGET" -gt 0 ] && took="$took of a ${BUDGET}s budget"
echo "== summary (results and logs in $OUT_DIR; $took)"
printf '%s\n' "${SUMMARY[@]}"
# non-zero when any step failed (SKIP and TIME lines do not count)
! printf '%s\n' "${SUMMARY[@]}" | grep -q '^FAIL'

