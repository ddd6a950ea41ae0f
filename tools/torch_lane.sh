#!/usr/bin/env bash
# The fast lane (pytest -m "not slow") on one torch release, in a venv of its own:
#
#   bash tools/torch_lane.sh 2.11.0            # the oldest torch cpvlm supports
#   bash tools/torch_lane.sh 2.11.0 -x -q      # more pytest arguments after the version
#   TORCH_LANE_VENV=DIR bash tools/torch_lane.sh --install 2.11.0   # only make the venv DIR
#   TORCH_LANE_VENV=DIR bash tools/torch_lane.sh 2.11.0             # the lane in venv DIR
#
# Installs torch==VERSION and the pinned test environment (pip install -c constraints.txt -e
# ".[test]", the torch pin overriding any torch line of constraints.txt) into the venv, prints the
# versions, runs the lane and its wall time, and exits with pytest's status. Without
# TORCH_LANE_VENV the venv is made in a temporary folder and removed at the end; with it, a venv
# whose install has finished is reused (.ci/run makes it in the background while the main suite
# runs: the install is mostly downloading). Run from anywhere in a clone; the interpreter is
# $PYTHON, else python3.
#
# torch and its CUDA libraries (about 1.7 GB for a CUDA build) are kept as wheels in
# $TORCH_LANE_WHEELS (default ~/.cache/cpvlm/torch-lane-wheels) and installed from there without
# the index on later runs: pip's own cache is not relied on (it writes nothing on some machines).
set -euo pipefail

install_only=0
if [ "${1:-}" = "--install" ]; then
    install_only=1
    shift
fi
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash tools/torch_lane.sh [--install] TORCH_VERSION [PYTEST_ARGS...]" >&2
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
venv="${TORCH_LANE_VENV:-$tmp/venv}"
py="$venv/bin/python"
ready="$venv/.cpvlm-torch-lane-$version"  # written once the install has finished

if [ -f "$ready" ]; then
    echo "+ torch==$version: the venv $venv, made before"
else
    "${PYTHON:-python3}" -m venv "$venv"
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
    touch "$ready"
fi
install_s=$((SECONDS - start))
if [ "$install_only" = 1 ]; then
    echo "torch_lane: torch $version installed in $venv in $install_s s"
    exit 0
fi

# Subprocesses of the tests that look up python or cpvlm on PATH get this venv's.
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
unset PYTHONHOME
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
