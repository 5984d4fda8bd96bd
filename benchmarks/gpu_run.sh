#!/usr/bin/env bash
# The GPU benchmark and the GPU tests in one command, on a machine with an NVIDIA GPU and a CUDA build of torch.
#
#   benchmarks/gpu_run.sh prepare                        # first, where PyPI is at hand (see below)
#   benchmarks/gpu_run.sh [STAGE...] [-- GPU.PY ARGUMENTS]
#
# Stages, in this order (default: install bench staging zero tests):
#   prepare  download into .whl/ the wheels a GPU machine without PyPI needs beside its torch and Lightning:
#            mpich, mpi4py, hydra-core, omegaconf 2.3, antlr4 (built here: PyPI has its source only), for CPython
#            $GPU_RUN_PYTHON_VERSION (3.12) on x86_64 Linux. Carry .whl/ (ignored by git) with the checkout.
#   install  with .whl/: a venv in $GPU_RUN_VENV (/tmp/mpistrategy-gpu) that sees the packages of the python3
#            holding torch (through a .pth file: the venv's own packages come first, so the carried mpi4py, linked
#            to the carried MPICH, wins), the wheels, this checkout (editable; on PYTHONPATH where it cannot be
#            installed). Without .whl/: the current Python as it is (pip install -e ".[mpich,test]" beforehand).
#   bench    python benchmarks/gpu.py [GPU.PY ARGUMENTS]: 2 ranks, then 1 rank, every contender;
#            writes gpu.json and gpu.png to $GPU_RUN_RESULTS (benchmarks/results).
#   staging  python benchmarks/gpu_staging.py $GPU_RUN_STAGING: where mpi_ad's staged synchronisation spends a step
#            (2 ranks; bucket caps and shared memory on or off as gpu_staging.py's options); writes gpu_staging.json.
#   zero     python benchmarks/zero.py --accelerator gpu $GPU_RUN_ZERO: sharded optimizer state (ZeRO stages 1 and
#            2) against flat mpi_ad and ZeroRedundancyOptimizer with DDP, 2 and 4 ranks; writes zero.json and zero.png.
#   tests    pytest -ra ${GPU_RUN_TESTS:-tests/gpu} (test files, -k expressions, pytest options).
# The stages after a failed one still run; the exit status is the first failure's. Where $OUT is set, each stage's
# log, the results and a description of the machine (environment.txt) are copied there as soon as they exist.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${GPU_RUN_VENV:-/tmp/mpistrategy-gpu}
RESULTS=${GPU_RUN_RESULTS:-benchmarks/results}
LOGS=${OUT:-$(mktemp -d)}
stages=()
while [ $# -gt 0 ]; do
    case $1 in
        --) shift; break ;;
        prepare | install | bench | staging | zero | tests) stages+=("$1"); shift ;;
        *) echo "gpu_run.sh: unknown stage '$1' (prepare, install, bench, staging, zero, tests; gpu.py's arguments after --)" >&2
           exit 2 ;;
    esac
done
[ ${#stages[@]} -gt 0 ] || stages=(install bench staging zero tests)
mkdir -p "$LOGS"

prepare() {
    local version=${GPU_RUN_PYTHON_VERSION:-3.12}
    local platforms=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64
                     manylinux_2_5_x86_64)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        "${platforms[@]/#/--platform=}" -d .whl mpich mpi4py "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" &&
        python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 &&
        ls .whl
}

install() {
    if [ ! -d .whl ]; then
        echo "no .whl/: using $(command -v python) as it is"
        python -c "import mpi4py, torch, lightning, mpistrategy" || return 1
        return 0
    fi
    local image_packages purelib
    image_packages=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))") ||
        { echo "python3 has no torch: run on the machine's Python with its CUDA build of torch" >&2; return 1; }
    python3 -m venv "$VENV" || return 1
    purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$image_packages" > "$purelib/image.pth"
    "$VENV/bin/pip" install -q --no-index --no-deps --no-compile --ignore-installed .whl/*.whl || return 1
    "$VENV/bin/pip" install -q --no-index --no-deps --no-build-isolation -e . ||
        echo "this checkout goes on PYTHONPATH (it could not be installed)"
}

use_environment() {
    if [ -x "$VENV/bin/python" ] && [ -d .whl ]; then
        # shellcheck disable=SC1091
        source "$VENV/bin/activate"
        (cd / && python -c "import mpistrategy" 2>/dev/null) || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    {
        date -u +%Y-%m-%dT%H:%M:%SZ
        nvidia-smi -L 2>&1 || true
        python -c "import torch, lightning, mpi4py; from mpi4py import MPI
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())
print('lightning', lightning.__version__, 'mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0])"
    } > "$LOGS/environment.txt" 2>&1
}

bench() {
    python benchmarks/gpu.py --results "$RESULTS" "$@" || return 1
    if [ -n "${OUT:-}" ]; then cp "$RESULTS/gpu.json" "$RESULTS/gpu.png" "$OUT/"; fi
}

staging() {
    # shellcheck disable=SC2086  # the options are words
    python benchmarks/gpu_staging.py --results "$RESULTS" ${GPU_RUN_STAGING:-} || return 1
    if [ -n "${OUT:-}" ]; then cp "$RESULTS/gpu_staging.json" "$OUT/"; fi
}

zero() {
    # shellcheck disable=SC2086  # the options are words
    python benchmarks/zero.py --accelerator gpu --results "$RESULTS" ${GPU_RUN_ZERO:-} || return 1
    if [ -n "${OUT:-}" ]; then cp "$RESULTS/zero.json" "$RESULTS/zero.png" "$OUT/"; fi
}

tests() {
    # shellcheck disable=SC2086
    python -m pytest -ra ${GPU_RUN_TESTS:-tests/gpu}
}

failed=0
for stage in "${stages[@]}"; do
    [ "$stage" = prepare ] || [ "$stage" = install ] || use_environment
    echo "=== $stage"
    start=$SECONDS
    if [ "$stage" = bench ]; then bench "$@" 2>&1 | tee "$LOGS/$stage.log"; else "$stage" 2>&1 | tee "$LOGS/$stage.log"; fi
    code=${PIPESTATUS[0]}
    echo "=== $stage: exit $code after $((SECONDS - start)) s" | tee -a "$LOGS/$stage.log"
    [ "$code" -eq 0 ] || [ "$failed" -ne 0 ] || failed=$code
done
exit "$failed"
