#!/usr/bin/env bash
# The GPU check of cpvlm: one H100/H200-class GPU, under 500 s by default, installs nothing.
#
#   bash benchmarks/gpu/check.sh --out DIR/gpu.json             # everything, JSON in DIR
#   bash benchmarks/gpu/check.sh --out DIR/gpu.json --deadline 300 --skip train
#   sections: tests errors speed varlen nccl train (in that order, the slow train run last)
#
# Runs benchmarks/gpu/check.py (see its docstring): the CUDA tests, the CP block kernels' errors
# against float64, their speed against SDPA flash on the same work, varlen against one call per
# document, on 2+ GPUs the NCCL checks, and one `cpvlm train` step against the plain HF model.
# The JSON is rewritten after every section; every section that cannot run says why, in the
# printed table and in the JSON. Exit status 1 when a section failed or ran out of time.
# The interpreter: $PYTHON, else python3, else python (GPU images often have only python3).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"  # a relative --out stays the caller's
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py="${PYTHON:-}"
if [ -z "$py" ]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1; then py="$candidate"; break; fi
  done
fi
if [ -z "$py" ]; then
  echo "check.sh: no Python interpreter (set PYTHON, or put python3 or python on PATH)" >&2
  exit 127
fi
exec "$py" -u "$root/benchmarks/gpu/check.py" "$@"
