#!/usr/bin/env bash
# One prepared GPU check on one H100/H200, at most 8 minutes: a DPCC update step vs the plain
# Megatron LM step of the same ~1B GPT, in BF16 (and FP8 when Transformer Engine is present).
# Prints figures side by side and ends with one JSON line (see benchmarks/gpu_check.py).
#
#   WHEELS=/path/to/wheels bash benchmarks/gpu_check.sh [gpu_check.py args]
#
# Works on an offline node whose Python has torch preinstalled but not megatron-core or this
# package: whatever is missing is installed from the local wheel directory $WHEELS (default
# ./wheels) into a private directory ($DPCC_SITE), never over the node's own packages, and with
# --no-deps, so pip neither replaces the preinstalled torch nor looks for this package's other
# dependencies (the check needs only torch, numpy and megatron-core). From a source checkout the
# package itself is imported from the tree. README.md "GPU check" says how to build $WHEELS.
#
# Environment: PYTHON (default: python3), WHEELS, DPCC_SITE (default: $TMPDIR/dpcc-gpu-check-site),
# GPU_CHECK_TIMEOUT (seconds for the measurement, default 420), DPCC_FORCE_INSTALL=1 (install
# from $WHEELS even when the modules import already; for testing the install path).
set -euo pipefail

PY="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
WHEELS="${WHEELS:-$ROOT/wheels}"
SITE="${DPCC_SITE:-${TMPDIR:-/tmp}/dpcc-gpu-check-site}"
LIMIT="${GPU_CHECK_TIMEOUT:-420}"

if [ -f "$ROOT/dpcc_megatron/__init__.py" ]; then
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

have() { "$PY" -c "import $1" >/dev/null 2>&1; }

"$PY" -c "import torch" || { echo "gpu_check: $PY cannot import torch" >&2; exit 2; }
missing=()
if [ "${DPCC_FORCE_INSTALL:-0}" = 1 ] || ! have megatron.core; then missing+=(megatron-core); fi
if ! have dpcc_megatron; then missing+=(dpcc-megatron); fi
if [ "${#missing[@]}" -gt 0 ]; then
    if [ ! -d "$WHEELS" ]; then
        echo "gpu_check: need ${missing[*]} but the wheel directory $WHEELS does not exist" \
             "(set WHEELS=...; see README.md, GPU check)" >&2
        exit 2
    fi
    echo "gpu_check: installing ${missing[*]} from $WHEELS into $SITE"
    mkdir -p "$SITE"
    "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps --upgrade \
        --target "$SITE" "${missing[@]}"
fi
for mod in numpy megatron.core dpcc_megatron; do
    have "$mod" || { echo "gpu_check: $mod still does not import with $PY; add its wheel to $WHEELS" >&2; exit 2; }
done

"$PY" -c "import torch; print('gpu_check: torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count())"
exec timeout --signal=TERM --kill-after=15 "$LIMIT" "$PY" "$HERE/gpu_check.py" "$@"
