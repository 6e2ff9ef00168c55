#!/usr/bin/env bash
# Fill a wheel directory for benchmarks/gpu_check.sh on an offline GPU node, from a machine with
# network access to PyPI (any Python with pip):
#
#   bash benchmarks/gpu_wheels.sh [DIR]          # default DIR: ./wheels
#
# Downloads, for the GPU node's Python (GPU_PYTHON_VERSION, default 3.12) and platform
# (GPU_PLATFORM, default manylinux_2_28_x86_64): megatron-core (MCORE_VERSION, default 0.19.2, the
# newest release, Python >= 3.12), pyyaml and psutil -- binary wheels only, without dependencies
# (the node's torch is never replaced). About 3.5 MB. The checkout itself provides dpcc_megatron.
set -euo pipefail
DIR="${1:-wheels}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
    --platform "${GPU_PLATFORM:-manylinux_2_28_x86_64}" -d "$DIR" \
    "megatron-core==${MCORE_VERSION:-0.19.2}" pyyaml psutil
ls -l "$DIR"
