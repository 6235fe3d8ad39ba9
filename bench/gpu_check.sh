#!/usr/bin/env bash
# GPU check: the CUDA-only tests plus the full bandwidth sweep, in one run.
# Usage: bench/gpu_check.sh OUTPUT_DIR
# Installs nothing slow: expects torch and triton already present (the device image
# has them) and installs this package without dependencies.
set -uo pipefail
out=${1:?usage: bench/gpu_check.sh OUTPUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || {
  echo "install failed, see $out/install.log"; exit 1; }
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpu", torch.cuda.get_device_name())' | tee "$out/versions.txt"
status=0
timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests bench \
  --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" || status=1
timeout 200 triton-offload bench --sweep --out "$out/bench" 2>&1 | tee "$out/bench.log" || status=1
exit $status
