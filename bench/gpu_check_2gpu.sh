#!/usr/bin/env bash
# The checks that need two GPUs (NCCL across processes), in under five minutes; prints one table and exits
# non-zero if a row fails. See bench/gpu_check_2gpu.py.
#
#   bench/gpu_check_2gpu.sh                 # on a machine with 2 CUDA GPUs
#   bench/gpu_check_2gpu.sh --cpu-dry-run   # gloo on CPU, 2 processes, tiny sizes
#
# Python: $PYTHON if set, else the venv ($VENV, default .venv) if it has lightning, else python3 on PATH.
# Nothing is installed; each launch's collectives time out after --timeout seconds (90 by default).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import lightning' >/dev/null 2>&1; then
    PY="$VENV/bin/python"
else
    PY="$(command -v python3)"
fi
if ! "$PY" -c 'import torch, lightning' >/dev/null 2>&1; then
    echo "gpu_check_2gpu: $PY lacks torch or lightning; set PYTHON" >&2
    exit 2
fi
echo "gpu_check_2gpu: $PY" >&2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 300 "$PY" bench/gpu_check_2gpu.py "$@"
