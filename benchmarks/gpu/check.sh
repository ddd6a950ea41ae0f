#!/usr/bin/env bash
# The GPU check of cpvlm: one H100/H200-class GPU, under 8 minutes, installs nothing.
#
#   bash benchmarks/gpu/check.sh                      # everything -> benchmarks/results/gpu.json
#   bash benchmarks/gpu/check.sh --skip train nccl    # sections: tests errors speed varlen train nccl
#   bash benchmarks/gpu/check.sh --out gpu-dry.json  # write elsewhere (a CPU dry run, say)
#
# Runs the CUDA tests, then benchmarks/gpu/check.py: the CP block kernels' errors against
# float64, their speed against SDPA flash on the same work, varlen against one call per
# document, one `cpvlm train` step against the plain HF model, and on 2+ GPUs the NCCL checks.
# Every section that cannot run says why, in the printed table and in the JSON. Exit status 1
# when a section failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python benchmarks/gpu/check.py "$@"
