#!/usr/bin/env bash
# Try this backend on a vLLM release it does not claim yet (not a step of .ci/run):
#
#   bash ci/vllm_canary.sh [RELEASE]        e.g. bash ci/vllm_canary.sh 0.35.0
#
# RELEASE defaults to the newest vLLM release on the configured package index. Builds
# CANARY_VENV (default .venv-canary) as ci/venv.sh builds a test environment: torch 2.13.0
# (the CPU build) and this clone editable with its test and tiers extras, then the pinned
# list of the release (ci/vllm-cpu.txt for 0.33, ci/vllm-X.Y-cpu.txt) or, for a release
# with no list, the newest list without its vllm pin, then vllm==RELEASE with --no-deps.
# Then, each step run whatever the previous one gave:
#   1. ci/vllm_imports.py: do vLLM's modules import with those pins (the first that fails);
#   2. the registry of private vLLM names (triton_offload/vllm/internals.py): every name
#      that moved or changed, checked against the entries of RELEASE's minor release, or of
#      the newest release the registry knows when RELEASE is outside the supported range;
#   3. the project's vLLM tests, as .ci/run runs them on 0.34.
# Ends with a summary (vLLM version, broken names, failed tests); exits 1 if any step
# found a problem, 2 on a usage or build error. Logs stay in CANARY_VENV/canary/.
set -uo pipefail
[ $# -le 1 ] || { echo "usage: bash ci/vllm_canary.sh [RELEASE]" >&2; exit 2; }
cd "$(dirname "$0")/.."
venv=$(realpath -m "${CANARY_VENV:-.venv-canary}")  # relative to the clone's root
export PIP_DISABLE_PIP_VERSION_CHECK=1
started=$(date +%s)

if [ $# -eq 1 ]; then
  version=$1
else
  # "vllm (X.Y.Z)" on the first line: the newest release (pre-releases are left out).
  version=$(python3 -m pip index versions vllm 2>/dev/null | sed -n 's/^vllm (\(.*\))$/\1/p')
  [ -n "$version" ] || { echo "vllm_canary: no vllm release found on the package index" >&2; exit 2; }
fi
release=$(echo "$version" | cut -d. -f1,2)
echo "vllm_canary: vLLM $version in $venv"

# The pinned list: the release's own, else the one with the newest vllm pin.
pins=""
for list in ci/vllm-cpu.txt ci/vllm-*-cpu.txt; do
  [ "$(sed -n 's/^vllm==//p' "$list" | cut -d. -f1,2)" = "$release" ] && pins=$list
done
if [ -z "$pins" ]; then
  pins=$(for list in ci/vllm-cpu.txt ci/vllm-*-cpu.txt; do
    echo "$(sed -n 's/^vllm==//p' "$list") $list"
  done | sort -V | tail -n 1 | cut -d' ' -f2)
  echo "vllm_canary: no pinned list for vLLM $release; using $pins without its vllm pin"
fi

log=$venv/canary
shown_log=${log#"$PWD/"}  # relative to the clone where it lies inside it
build() {
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || return 1
  mkdir -p "$log"
  "$venv/bin/python" -m pip install -q torch==2.13.0 -e '.[test,tiers]' || return 1
  grep -v '^vllm==' "$pins" >"$log/pins.txt"
  "$venv/bin/python" -m pip install -q --no-deps -r "$log/pins.txt" || return 1
  "$venv/bin/python" -m pip install -q --no-deps "vllm==$version" || return 1
}
if ! build; then
  echo "vllm_canary: building $venv for vLLM $version failed (pip's message above)" >&2
  exit 2
fi
installed=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))')
. "$venv/bin/activate"
export VLLM_TARGET_DEVICE=cpu

echo "vllm_canary: 1/3 vLLM's modules import (ci/vllm_imports.py)"
python ci/vllm_imports.py >"$log/imports.txt" 2>&1
imports_rc=$?
cat "$log/imports.txt"

echo "vllm_canary: 2/3 the registry of private vLLM names (triton_offload/vllm/internals.py)"
rm -f "$log/registry.txt"
python - "$log/registry.txt" <<'PY'
"""Write one line per relied-on name that does not hold on the installed vLLM."""

import sys

from triton_offload.vllm.compat import UnsupportedVLLMError, installed_vllm_version, vllm_release
from triton_offload.vllm.internals import RELIANCES, internals_problems

known = max(release for reliance in RELIANCES for release in reliance.releases)
try:
    release = vllm_release()
except UnsupportedVLLMError as error:
    release = known
    print(f"{error}\nchecking the names relied on for vLLM {release[0]}.{release[1]}")
try:
    problems = internals_problems(release)
except Exception as error:  # a release that breaks the check itself is a finding too
    problems = [f"the registry check failed: {type(error).__name__}: {error}"]
count = sum(release in reliance.releases for reliance in RELIANCES)
print(f"vllm {installed_vllm_version()}: {count - len(problems)} of {count} names hold")
with open(sys.argv[1], "w") as out:
    out.writelines(f"{line}\n" for line in problems)
PY
registry_rc=$?
if [ $registry_rc -ne 0 ] && [ ! -s "$log/registry.txt" ]; then
  echo "the registry check did not run (exit $registry_rc; its error above)" >"$log/registry.txt"
fi
[ -s "$log/registry.txt" ] && registry_rc=1
cat "$log/registry.txt"

limit=${CANARY_TEST_TIMEOUT:-3600}
echo "vllm_canary: 3/3 the project's vLLM tests (pytest tests -k \"vllm or fault or interrupt or tiers or pointers\"," \
  "at most $limit s; failures are printed as they happen, everything is in $shown_log/pytest.txt)"
# -v: each test's name is written when it starts, so a hung or killed run still names the
# tests that failed and the one it was in.
timeout --kill-after=30 "$limit" python -m pytest tests -k "vllm or fault or interrupt or tiers or pointers" \
  -v -rfE -p no:cacheprovider --continue-on-collection-errors 2>&1 |
  tee "$log/pytest.txt" |
  grep --line-buffered -E '^tests/.* (FAILED|ERROR)( |$)|^(FAILED|ERROR) |^=+ .* in [0-9.]+s'
tests_rc=${PIPESTATUS[0]}
{
  sed -nE 's/^(tests\/[^ ]+) (FAILED|ERROR)( .*)?$/\2 \1/p' "$log/pytest.txt"
  sed -nE 's/^(FAILED|ERROR) ([^ ]+).*/\1 \2/p' "$log/pytest.txt"
} | sort -u >"$log/failed.txt"
tests_line=$(grep -E '^=+ .* in [0-9.]+s' "$log/pytest.txt" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
[ -n "$tests_line" ] || tests_line="no pytest summary: $(tail -n 1 "$log/pytest.txt")"

minutes=$(( ($(date +%s) - started) / 60 ))
seconds=$(( ($(date +%s) - started) % 60 ))
echo
echo "==== vllm_canary summary: vLLM $installed ($pins pins), ${minutes} min ${seconds} s ===="
if [ $imports_rc -eq 0 ]; then
  echo "imports: every module of ci/vllm_imports.py imports"
else
  echo "imports: FAILED ($(tail -n 1 "$log/imports.txt"))"
fi
if [ $registry_rc -eq 0 ]; then
  echo "registry: every private name relied on holds"
else
  echo "registry: $(wc -l <"$log/registry.txt") broken name(s):"
  sed 's/^/  /' "$log/registry.txt"
fi
if [ $tests_rc -eq 0 ]; then
  echo "tests: passed ($tests_line)"
else
  if [ $tests_rc -eq 124 ] || [ $tests_rc -eq 137 ]; then
    running=$(grep -oE '^tests/[^ ]+' "$log/pytest.txt" | tail -n 1)
    echo "tests: STOPPED after $limit s (CANARY_TEST_TIMEOUT), in ${running:-collection}"
  fi
  echo "tests: FAILED, exit $tests_rc ($tests_line)"
  if [ -s "$log/failed.txt" ]; then
    echo "tests that failed ($(wc -l <"$log/failed.txt")):"
    sed 's/^/  /' "$log/failed.txt"
  fi
fi
echo "logs: $shown_log"
if [ $imports_rc -ne 0 ] || [ $registry_rc -ne 0 ] || [ $tests_rc -ne 0 ]; then
  exit 1
fi
