#!/usr/bin/env bash
# The fast lane (pytest -m "not slow") on one torch release, in a venv of its own:
#
#   bash tools/torch_lane.sh 2.11.0            # the oldest torch cpvlm supports
#   bash tools/torch_lane.sh 2.11.0 -x -q      # more pytest arguments after the version
#
# Makes a venv in a temporary folder (removed at the end), installs torch==VERSION and the pinned
# test environment (pip install -c constraints.txt -e ".[test]", the torch pin overriding any torch
# line of constraints.txt), prints the versions, runs the lane and its wall time, and exits with
# pytest's status. Run from anywhere in a clone; the interpreter is $PYTHON, else python3.
#
# torch and its CUDA libraries (about 1.7 GB for a CUDA build) are kept as wheels in
# $TORCH_LANE_WHEELS (default ~/.cache/cpvlm/torch-lane-wheels) and installed from there without
# the index on later runs: pip's own cache is not relied on (it writes nothing on some machines).
set -euo pipefail

if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash tools/torch_lane.sh TORCH_VERSION [PYTEST_ARGS...]" >&2
    exit 2
fi
version="$1"
shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start=$SECONDS
export PIP_DISABLE_PIP_VERSION_CHECK=1

tmp="$(mktemp -d "${TMPDIR:-/tmp}/cpvlm-torch-lane.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
# Subprocesses of the tests that look up python or cpvlm on PATH get this venv's.
export VIRTUAL_ENV="$tmp/venv" PATH="$tmp/venv/bin:$PATH"
unset PYTHONHOME

echo "+ torch==$version"
wheels="${TORCH_LANE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/cpvlm/torch-lane-wheels}"
mkdir -p "$wheels"
offline=(--no-index --find-links "$wheels")
if ! "$py" -m pip install -q "${offline[@]}" "torch==$version" 2>/dev/null; then
    "$py" -m pip download -q -d "$wheels" "torch==$version"
    "$py" -m pip install -q "${offline[@]}" "torch==$version"
fi

# constraints.txt without its torch line (if any): the version asked for is the pin.
grep -viE '^torch *([=<>!~;[]|$)' constraints.txt >"$tmp/constraints.txt" || true
echo "+ pip install -c constraints.txt -e .[test] torch==$version"
"$py" -m pip install -q -c "$tmp/constraints.txt" -e ".[test]" "torch==$version"
install_s=$((SECONDS - start))

"$py" - <<'EOF'
import platform
from importlib.metadata import version

import torch

names = ("transformers", "trl", "peft", "accelerate", "datasets", "pytest")
print(f"python {platform.python_version()}, torch {torch.__version__} (cuda {torch.version.cuda}),",
      ", ".join(f"{n} {version(n)}" for n in names))
EOF

shown=""
[ $# -eq 0 ] || shown="$(printf ' %q' "$@")"
echo "+ python -m pytest -m \"not slow\"$shown"
lane_start=$SECONDS
set +e
"$py" -m pytest -m "not slow" "$@"
status=$?
set -e
echo "torch_lane: torch $version: pytest exit $status in $((SECONDS - lane_start)) s" \
    "(install $install_s s, all $((SECONDS - start)) s)"
exit "$status"
