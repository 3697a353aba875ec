#!/usr/bin/env bash
# Wheels for running recsys (and scripts/gpu_check.sh) on a CUDA machine that has torch and
# triton but no TorchRec and no network: download them here, carry the folder there.
#
#   bash scripts/offline_wheels.sh DIR [PYTHON_VERSION [TORCHREC_VERSION [FBGEMM_VERSION]]]
#   (defaults: 3.12, torchrec 1.6.1 and fbgemm-gpu-cpu 1.6.0, the versions for torch 2.11)
#
# DIR then holds the wheels (TorchRec and its pure-Python needs, and FBGEMM's CPU build: the
# CUDA build is a 465 MB wheel for 1.6.0), a sitecustomize.py and install.sh. There, run
#
#   bash DIR/install.sh /tmp/site && export PYTHONPATH=/tmp/site
#
# The CPU build of FBGEMM has no CUDA kernels: KeyedJaggedTensor's offsets of a CUDA tensor
# (fbgemm::asynchronous_complete_cumsum) get a torch implementation from sitecustomize.py, and
# benchmarks report FBGEMM's GPU providers as skipped. Everything recsys runs on the GPU is
# its own Triton and torch code.
set -euo pipefail

if [ $# -lt 1 ] || [ -z "$1" ] || [ "${1:0:1}" = "-" ]; then
    echo "usage: bash scripts/offline_wheels.sh DIR [PYTHON_VERSION [TORCHREC [FBGEMM]]]" >&2
    exit 2
fi
DIR=$1
PY=${2:-3.12}
TORCHREC=${3:-1.6.1}
FBGEMM=${4:-1.6.0}
if ! [[ "$PY" =~ ^3\.[0-9]+$ ]]; then
    echo "offline_wheels.sh: python version '$PY': expected 3.N, e.g. 3.12" >&2
    exit 2
fi
mkdir -p "$DIR"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
# TorchRec's needs that a CUDA image with torch does not already have (numpy, tqdm,
# torchmetrics, portalocker, cloudpickle, packaging and pyre-extensions usually are there;
# tensordict 0.11.0 and pyvers 0.2.2: the versions seen working with torch 2.11).
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${platforms[@]}" -d "$DIR" \
    "torchrec==$TORCHREC" "fbgemm-gpu-cpu==$FBGEMM" tensordict==0.11.0 iopath pyvers==0.2.2 orjson \
    importlib_metadata pytest-timeout  # pytest-timeout: gpu_check.sh's 60 s per GPU test

cat >"$DIR/sitecustomize.py" <<'PY'
"""Installed by scripts/offline_wheels.sh: FBGEMM's CPU build on a CUDA machine gets a torch
implementation of fbgemm::asynchronous_complete_cumsum for CUDA tensors (KeyedJaggedTensor's
offsets)."""
try:
    import torch
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    if not torch._C._dispatch_has_kernel_for_dispatch_key(
        "fbgemm::asynchronous_complete_cumsum", "CUDA"
    ):
        _lib = torch.library.Library("fbgemm", "IMPL")

        def _complete_cumsum(t):
            zero = t.new_zeros(t.shape[:-1] + (1,))
            return torch.cat([zero, torch.cumsum(t, -1, dtype=t.dtype)], dim=-1)

        _lib.impl("asynchronous_complete_cumsum", _complete_cumsum, "CUDA")
except Exception as error:  # never stop an interpreter from starting
    import sys

    print(f"sitecustomize: no CUDA cumsum for FBGEMM's CPU build: {error}", file=sys.stderr)
PY

cat >"$DIR/install.sh" <<'SH'
#!/usr/bin/env bash
# bash install.sh TARGET: the wheels beside this script into TARGET (then PYTHONPATH=TARGET),
# with $PYTHON (default python3): the interpreter the wheels were downloaded for.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
target=${1:?usage: bash install.sh TARGET}
"${PYTHON:-python3}" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" "$here"/*.whl
cp "$here/sitecustomize.py" "$target/"
SH
echo "wrote $(ls "$DIR"/*.whl | wc -l) wheels, sitecustomize.py and install.sh to $DIR" \
    "($(du -sh "$DIR" | cut -f1)); there: bash $DIR/install.sh /tmp/site && export PYTHONPATH=/tmp/site"
