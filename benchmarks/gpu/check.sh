#!/usr/bin/env bash
# The GPU check of cpvlm: one H100/H200-class GPU, under 500 s by default, installs nothing
# (but the wheels of --wheels, carried in).
#
#   bash benchmarks/gpu/check.sh --out DIR/gpu.json             # everything, JSON in DIR
#   bash benchmarks/gpu/check.sh --out DIR/gpu.json --deadline 300 --skip train
#   bash benchmarks/gpu/check.sh --wheels WHEELS --out DIR/gpu.json   # the pinned libraries
#   sections: tests errors speed varlen nccl train (in that order, the slow train run last)
#
# --wheels WHEELS first installs every wheel of the folder WHEELS (pip --no-index --find-links
# WHEELS: nothing from the network) into a venv in a temporary folder (removed at the end) that
# sees the machine's packages (--system-site-packages, and $py's own where that is a venv): the
# machine's torch stays, the carried transformers, trl, peft, accelerate shadow its own, and the
# check runs on that venv's interpreter. The JSON's environment names the versions it found.
# Where the machine lacks a dependency of the wheels, they are installed with --no-deps and the
# JSON says what was missing; where they cannot be installed at all, the JSON says why, the
# check runs on the machine's packages and exits 1. WHEELS is filled on a machine with the
# registry by the `pip download` line of docs/training.md (python benchmarks/gpu/check.py
# --requirements prints the pinned set: transformers, trl, peft, accelerate and what they need
# beyond torch, numpy, pandas and pyarrow).
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
args=()
wheels=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels)
      [ $# -ge 2 ] || { echo "check.sh: --wheels needs a folder" >&2; exit 2; }
      wheels="$2"; shift 2 ;;
    --wheels=*) wheels="${1#--wheels=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -z "$wheels" ]; then
  exec "$py" -u "$root/benchmarks/gpu/check.py" ${args[@]+"${args[@]}"}
fi

[ -d "$wheels" ] || { echo "check.sh: --wheels $wheels: no such folder" >&2; exit 2; }
wheels="$(cd "$wheels" && pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/cpvlm-gpu-check.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
venv="$tmp/venv"

make_venv() {
  # No pip (nor setuptools) of the venv's own where the machine has pip: the machine's, seen
  # through its site-packages, installs into the venv, and nothing of the venv's shadows the
  # machine's packages (ensurepip's old setuptools would fail torch's requirement of a newer).
  if "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m venv --without-pip --system-site-packages "$venv" || return 1
  else
    "$py" -m venv --system-site-packages "$venv" || return 1
  fi
  # --system-site-packages reaches the base interpreter's packages only: where $py is a venv
  # itself (the machine's torch in it), its site-packages go on the path too, after the venv's.
  local outer site
  outer="$("$py" -c 'import site, sys
if sys.prefix != sys.base_prefix: print(*site.getsitepackages(), sep="\n")')" || return 1
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  [ -z "$outer" ] || printf '%s\n' "$outer" >"$site/cpvlm_outer_site.pth"
}

errors() {  # pip's ERROR lines of a log, else its end
  grep -E '^ERROR' "$1" | head -c 1500 || tail -c 1500 "$1"
}

pip_install() {
  "$venv/bin/python" -m pip install --disable-pip-version-check --no-input --no-index \
    --find-links "$wheels" "$@" "$wheels"/*.whl
}

echo "check.sh: installing every wheel of $wheels into a venv over $py's packages"
if ! compgen -G "$wheels/*.whl" >/dev/null; then
  export CPVLM_CHECK_WHEELS_ERROR="no *.whl in $wheels"
elif ! make_venv >"$tmp/venv.log" 2>&1; then
  export CPVLM_CHECK_WHEELS_ERROR="no venv: $(errors "$tmp/venv.log")"
elif pip_install >"$tmp/pip.log" 2>&1; then
  py="$venv/bin/python"
elif pip_install --no-deps >"$tmp/pip-no-deps.log" 2>&1; then
  # What the machine lacks for the carried wheels (an old pyarrow, say) is named in the JSON;
  # the carried versions are still the ones the check runs.
  py="$venv/bin/python"
  export CPVLM_CHECK_WHEELS_NO_DEPS="$(errors "$tmp/pip.log")"
else
  export CPVLM_CHECK_WHEELS_ERROR="$(errors "$tmp/pip-no-deps.log")"
fi
if [ -n "${CPVLM_CHECK_WHEELS_ERROR:-}" ]; then
  printf 'check.sh: the wheels are not installed, the check runs on %s as it is:\n%s\n' \
    "$py" "$CPVLM_CHECK_WHEELS_ERROR" >&2
fi
export CPVLM_CHECK_WHEELS="$wheels"
"$py" -u "$root/benchmarks/gpu/check.py" ${args[@]+"${args[@]}"}
