#!/usr/bin/env bash
# The prepared GPU check for one H100/H200 (one command, ~10 minutes at most):
#
#   1. loop  (benchmarks/gpu_loop_check.py, ~1-2 min): the real DPCC loop on the GPU -- the tiny
#            model of examples/tiny_cpu.yaml at TP1, local spec, bf16, 2 iterations over two
#            launches: rollout, old log-probs, update, checkpoint, then resume, one more iteration,
#            checkpoint. Checks statuses, resume, checkpoints and finite metrics; one JSON line.
#   2. bench (benchmarks/gpu_check.py, <= 7 min): a DPCC update step vs the plain Megatron LM step
#            of the same ~1B GPT, in BF16 (and FP8 when Transformer Engine is present); one JSON line.
#
#   WHEELS=/path/to/wheels bash benchmarks/gpu_check.sh [gpu_check.py args]
#   GPU_CHECK_PARTS=loop WHEELS=... bash benchmarks/gpu_check.sh       # the loop only
#
# Works on an offline node whose Python has torch preinstalled but not megatron-core or this
# package: whatever is missing is installed from the local wheel directory $WHEELS (default
# ./wheels) into a private directory ($DPCC_SITE), never over the node's own packages, and with
# --no-deps, so pip neither replaces the preinstalled torch nor looks for anything else. The loop
# also needs pyyaml and psutil (megatron-core's checkpoint save); torch brings sympy. From a
# source checkout the package itself is imported from the tree. `bash benchmarks/gpu_wheels.sh`
# fills ./wheels for the GPU node's Python (default 3.12: megatron-core 0.19.2, pyyaml, psutil).
#
# Environment: PYTHON (default: python3), WHEELS, DPCC_SITE (default: $TMPDIR/dpcc-gpu-check-site),
# GPU_CHECK_PARTS ("loop bench" by default), GPU_LOOP_TIMEOUT (seconds per loop launch, default
# 240), GPU_CHECK_TIMEOUT (seconds for the benchmark, default 420), GPU_LOOP_ARGS (extra
# arguments for gpu_loop_check.py, e.g. --allow-cpu for a dry run on a machine without a GPU),
# DPCC_FORCE_INSTALL=1 (install from $WHEELS even when the modules import already; for testing
# the install path). Exit status: the first failing part's, else 0.
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

PARTS="${GPU_CHECK_PARTS:-loop bench}"

"$PY" -c "import torch" || { echo "gpu_check: $PY cannot import torch" >&2; exit 2; }
missing=()
if [ "${DPCC_FORCE_INSTALL:-0}" = 1 ] || ! have megatron.core; then missing+=(megatron-core); fi
if ! have dpcc_megatron; then missing+=(dpcc-megatron); fi
if [[ " $PARTS " == *" loop "* ]]; then
    have yaml || missing+=(pyyaml)
    have psutil || missing+=(psutil)
fi
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
need=(numpy megatron.core dpcc_megatron)
[[ " $PARTS " == *" loop "* ]] && need+=(yaml psutil)
for mod in "${need[@]}"; do
    have "$mod" || { echo "gpu_check: $mod still does not import with $PY; add its wheel to $WHEELS" >&2; exit 2; }
done

"$PY" -c "import torch, megatron.core as m; print('gpu_check: torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count(), 'megatron-core', getattr(m, '__version__', '?'))"
status=0
if [[ " $PARTS " == *" loop "* ]]; then
    # shellcheck disable=SC2086  # GPU_LOOP_ARGS is a list of words
    "$PY" "$HERE/gpu_loop_check.py" --timeout "${GPU_LOOP_TIMEOUT:-240}" ${GPU_LOOP_ARGS:-} || status=$?
    [ "$status" = 0 ] || echo "gpu_check: the loop check failed (status $status)" >&2
fi
if [[ " $PARTS " == *" bench "* ]]; then
    timeout --signal=TERM --kill-after=15 "$LIMIT" "$PY" "$HERE/gpu_check.py" "$@" || { rc=$?; [ "$status" = 0 ] && status=$rc; }
fi
exit "$status"
