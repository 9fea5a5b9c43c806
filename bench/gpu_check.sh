#!/usr/bin/env bash
# Every check that needs a GPU, in under five minutes on one GPU: prints one table
# (check | result | figure) and exits non-zero if a correctness check fails. See bench/gpu_check.py.
#
#   bench/gpu_check.sh                      # on a machine with a CUDA GPU
#   bench/gpu_check.sh --cpu-dry-run        # the plumbing on CPU (Triton interpreter, tiny sizes)
#   bench/gpu_check.sh --markdown out.md    # also write the table as Markdown
#
# Which Python, first match wins:
#   1. $PYTHON, if set;
#   2. the Makefile's venv ($VENV, default .venv) if its torch sees a GPU (or for --cpu-dry-run);
#   3. without --cpu-dry-run: a python3 on PATH whose torch sees a GPU and that has lightning and
#      triton (a GPU image's own Python; this repo goes on PYTHONPATH, nothing is installed);
#   4. --cpu-dry-run only: the venv, made as `make venv` makes it. Without --cpu-dry-run no venv is
#      made (a GPU machine may have no network): the check stops, saying to set PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
export VENV

dry=0
for arg in "$@"; do
    [ "$arg" = "--cpu-dry-run" ] && dry=1
done
case "${GPU_CHECK_CPU_DRY_RUN:-0}" in ""|0) ;; *) dry=1 ;; esac

sees_gpu() {  # $1: a python; true if its torch is a CUDA build that sees a device and lightning imports
    "$1" -c 'import sys, torch, lightning, triton; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1
}

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x "$VENV/bin/python" ] && { [ "$dry" = 1 ] || sees_gpu "$VENV/bin/python"; }; then
    PY="$VENV/bin/python"
elif [ "$dry" = 0 ] && command -v python3 >/dev/null && sees_gpu python3; then
    PY="$(command -v python3)"
elif [ "$dry" = 1 ]; then
    make -s venv  # VENV and TORCH pass through the environment (the Makefile's `?=`)
    PY="$VENV/bin/python"
else
    echo "gpu_check: no Python here has torch with a CUDA device, lightning and triton; set PYTHON=<such a python>" >&2
    exit 2
fi
if ! "$PY" -c 'import torch, lightning' >/dev/null 2>&1; then
    echo "gpu_check: $PY lacks torch or lightning" >&2
    exit 2
fi

echo "gpu_check: $PY" >&2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" bench/gpu_check.py "$@"
