#!/usr/bin/env bash
# GPU check in one call: the CUDA tests, the preset bench, the launch-grid sweep
# (num_programs x tile size, and per-plane vs per-job path choice, on the hybrid
# presets), then the page sweep, each under its own time limit so that the whole run
# ends within GPU_CHECK_BUDGET seconds (default 450: under 8 minutes, start-up
# included). The page sweep gets what is left.
#
# Usage: bench/gpu_check.sh OUTPUT_DIR [--dry-run]
#
#   --dry-run   the same steps sized for a CPU-only machine (the CUDA tests skip, the
#               bench runs --quick on one tiny case) and without installing anything:
#               checks this script and the import shim, not the GPU.
#
# Installs nothing from the network: `pip install --no-deps --no-build-isolation -e .`
# needs only the setuptools already present; if that fails, or the installed package
# cannot import triton_offload.kernels, a symlinked copy of the tree in which
# kernels/ and bench/ sit inside triton_offload/ (as setup.cfg maps them) is used
# instead. Every step runs under `timeout -s INT`: pytest then still writes its junit
# XML and the bench still writes its results (it also stops itself at --max-seconds).
#
# OUTPUT_DIR never holds more than 8 files (a remote runner may return no more):
#   summary.txt          steps (exit code, seconds), versions, nvidia-smi, install
#   gpu-tests.xml/.log   pytest -m cuda (junit XML and -v log)
#   presets-report.md    bench report of the model presets
#   sweep-report.md      bench report of the page-size x pages-per-job sweep
#   presets-bandwidth.png, sweep-bandwidth.png   the two benches' plots
#   details.tar.gz       everything: all logs, results.json and plots of both benches,
#                        grid-sweep/ (the launch-grid sweep; its pick is in summary.txt)
# details.tar.gz is refreshed after every step, so a run stopped from outside keeps
# what the finished steps wrote. Exit status: 0 when every step ran and passed.
set -uo pipefail

usage="usage: bench/gpu_check.sh OUTPUT_DIR [--dry-run]"
out=${1:?$usage}
dry_run=0
case "${2:-}" in
  "") ;;
  --dry-run) dry_run=1 ;;
  *) echo "$usage" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$work" "$work.tgz"' EXIT
summary="$out/summary.txt"
start=$SECONDS
if [ "$dry_run" = 1 ]; then budget=${GPU_CHECK_BUDGET:-240}; else budget=${GPU_CHECK_BUDGET:-450}; fi
status=0

export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PIP_NO_INPUT=1
export MPLBACKEND=Agg
if [ "$dry_run" = 0 ]; then unset TRITON_INTERPRET; fi

log() { printf '%s\n' "$*" | tee -a "$summary"; }
remaining() { echo $((budget - (SECONDS - start))); }

pack() {  # everything written so far, in one archive next to the summary
  cp "$summary" "$work/summary.txt" 2>/dev/null
  tar -czf "$work.tgz" --exclude=./shim -C "$work" . 2>/dev/null &&
    mv -f "$work.tgz" "$out/details.tar.gz"
}

# step NAME CAP_SECONDS LOG COMMAND...: run under min(CAP, budget left - 10 s) seconds.
step() {
  local name=$1 cap=$2 logfile=$3
  shift 3
  local left limit began rc
  left=$(remaining)
  limit=$((left - 10 < cap ? left - 10 : cap))
  if [ "$limit" -lt 15 ]; then
    log "$(printf '%-16s %-8s %5s s  %s' "$name" skipped 0 "budget spent ($left s left)")"
    status=1
    return 0
  fi
  began=$SECONDS
  (cd "$run_dir" && timeout -s INT -k 15 "$limit" "$@") >"$logfile" 2>&1
  rc=$?
  local note=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note="TIMED OUT after $limit s"; fi
  [ "$rc" = 0 ] || status=1
  log "$(printf '%-16s rc=%-5s %5s s  %s' "$name" "$rc" $((SECONDS - began)) "$note")"
  pack
  return 0
}

: >"$summary"
log "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) budget ${budget} s$([ "$dry_run" = 1 ] && echo ' (dry run)')"
log "repo $repo ($(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
run_dir=$repo

# --- the GPU as the driver sees it --------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi >"$work/nvidia-smi.txt" 2>&1
  timeout 20 nvidia-smi --format=csv --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,clocks.max.sm \
    >"$work/nvidia-smi.csv" 2>&1
  sed 's/^/nvidia-smi: /' "$work/nvidia-smi.csv" | tee -a "$summary"
  timeout 20 nvidia-smi topo -m >>"$work/nvidia-smi.txt" 2>&1
else
  echo "nvidia-smi: not found" >"$work/nvidia-smi.txt"
fi

# --- install (no network), else the import shim ---------------------------------------
import_check='import triton_offload, triton_offload.kernels.copy_blocks, triton_offload.bench.harness
print("triton_offload from", triton_offload.__file__)
print("kernels from", triton_offload.kernels.copy_blocks.__file__)'
installed=0
if [ "$dry_run" = 0 ] || [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  if (cd "$repo" && timeout 90 "$py" -m pip install -q --no-deps --no-build-isolation -e .) \
    >"$work/install.log" 2>&1 && (cd "$work" && timeout 60 "$py" -c "$import_check") \
    >>"$work/install.log" 2>&1; then
    installed=1
    log "install: pip install --no-deps --no-build-isolation -e . worked"
  else
    log "install: pip install -e . failed or does not import (see install.log); using the shim"
  fi
else
  echo "dry run: nothing installed" >"$work/install.log"
fi
if [ "$installed" = 0 ]; then
  # A copy of the tree made of symlinks, with kernels/ and bench/ inside triton_offload/.
  shim="$work/shim"
  mkdir -p "$shim/triton_offload"
  for entry in conftest.py pyproject.toml setup.cfg tests bench kernels; do
    [ -e "$repo/$entry" ] && cp -rs "$repo/$entry" "$shim/$entry"
  done
  for entry in "$repo"/triton_offload/*; do
    ln -s "$entry" "$shim/triton_offload/$(basename "$entry")"
  done
  ln -s "$repo/kernels" "$shim/triton_offload/kernels"
  ln -s "$repo/bench" "$shim/triton_offload/bench"
  run_dir=$shim
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
  if (cd "$work" && timeout 60 "$py" -c "$import_check") >>"$work/install.log" 2>&1; then
    log "install: using the shim $shim (PYTHONPATH)"
  else
    log "install: the shim does not import either (see install.log)"
    status=1
  fi
fi

# --- versions ---------------------------------------------------------------------------
(cd "$work" && timeout 60 "$py" - >"$work/versions.txt" 2>&1) <<'PY'
import importlib.metadata as md
import platform

import torch

print("python", platform.python_version(), platform.platform())
for name in ("torch", "triton", "numpy", "pytest", "pytest-benchmark", "pytest-timeout",
             "hypothesis", "matplotlib", "setuptools", "cuda-bindings", "cuda-python", "vllm"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
print("torch.version.cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print("gpu", props.name, "sm", f"{props.major}.{props.minor}",
          "SMs", props.multi_processor_count, "memory GiB", round(props.total_memory / 2**30, 1))
import triton_offload.kernels.copy_blocks as copy_blocks

print("kernels", copy_blocks.__file__, "interpreted", copy_blocks._INTERPRETED)
PY
log "--- versions"
sed 's/^/  /' "$work/versions.txt" | tee -a "$summary"
log "--- steps (budget left $(remaining) s)"
pack

# --- pytest options: only plugins that are present ------------------------------------
pytest_opts=(-p no:cacheprovider -o addopts= -rA -v)
if "$py" -c 'import pytest_benchmark' >/dev/null 2>&1; then
  pytest_opts+=(--benchmark-disable)
else
  pytest_opts+=(--deselect bench/suites/bench_kernel_tables.py)  # needs the benchmark fixture
fi
if "$py" -c 'import pytest_timeout' >/dev/null 2>&1; then
  pytest_opts+=(--timeout 120)  # one hung test must not eat the whole step
fi

# 1. the CUDA tests (skipped with a reason without a GPU)
step gpu-tests 170 "$out/gpu-tests.log" "$py" -m pytest "${pytest_opts[@]}" -m cuda \
  --junitxml="$out/gpu-tests.xml" \
  tests/test_copy_kernel_cuda.py tests/test_engine_cuda.py tests/test_bench_cuda.py \
  bench/suites/bench_kernel_tables.py
cp "$out/gpu-tests.log" "$work/" 2>/dev/null
cp "$out/gpu-tests.xml" "$work/" 2>/dev/null

# 2. the model presets, then 3. the sweep (each stops starting cases at --max-seconds)
if [ "$dry_run" = 1 ]; then
  preset_args=(--quick --presets llama3.1-8b-tp4 --paths torch,triton,per-page-copy)
  sweep_args=(--quick --presets llama3.1-8b-tp4 --page-sizes 4k --pages 16 --paths torch)
  preset_cap=90
else
  preset_args=()
  sweep_args=(--presets llama3.1-8b-tp4)
  preset_cap=140
fi
bench() {  # bench NAME CAP ARGS...: --max-seconds leaves 40 s to write the results
  local name=$1 cap=$2
  shift 2
  local left limit plot
  left=$(remaining)
  limit=$((left - 10 < cap ? left - 10 : cap))
  step "$name" "$cap" "$work/$name.log" "$py" -m triton_offload bench --no-progress \
    --out "$work/$name" --max-seconds $((limit - 40 > 1 ? limit - 40 : 1)) "$@"
  cp "$work/$name/report.md" "$out/$name-report.md" 2>/dev/null
  # a sweep run's own plot is sweep.png (its preset plot stays in details.tar.gz)
  if [ -f "$work/$name/sweep.png" ]; then plot=sweep.png; else plot=bandwidth.png; fi
  cp "$work/$name/$plot" "$out/$name-bandwidth.png" 2>/dev/null
  pack
}
bench presets "$preset_cap" "${preset_args[@]}"
# The launch-grid sweep: its own cap, so the page sweep after it keeps a share.
if [ "$dry_run" = 1 ]; then grid_args=(--quick); grid_cap=40; else grid_args=(); grid_cap=60; fi
grid_left=$(remaining)
grid_limit=$((grid_left - 10 < grid_cap ? grid_left - 10 : grid_cap))
step grid-sweep "$grid_cap" "$work/grid-sweep.log" "$py" -m triton_offload.bench.grid_sweep \
  --out "$work/grid-sweep" --max-seconds $((grid_limit - 15 > 1 ? grid_limit - 15 : 1)) \
  "${grid_args[@]}"
if [ "$dry_run" = 1 ]; then sweep_cap=90; else sweep_cap=$(remaining); fi
bench sweep "$sweep_cap" --sweep "${sweep_args[@]}"

# --- summary --------------------------------------------------------------------------
{
  echo "--- results"
  for f in "$out/gpu-tests.log"; do
    [ -f "$f" ] || continue
    echo "$(basename "$f"): $(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* =+$' "$f" | tail -1)"
    grep -E '^(FAILED|ERROR) ' "$f" | head -20 | sed 's/^/  /'
  done
  for name in presets sweep; do
    f="$work/$name.log"
    [ -f "$f" ] || continue
    echo "bench $name: $(ls "$work/$name" 2>/dev/null | tr '\n' ' ')"
    [ -f "$work/$name/results.json" ] && timeout 30 "$py" - "$work/$name/results.json" <<'PY'
import collections, json, sys
results = json.load(open(sys.argv[1]))
rows = results["measurements"] + results["correctness"]
count = collections.Counter(m["status"] for m in rows)
print("  rows:", ", ".join(f"{n} {s}" for s, n in sorted(count.items())),
      f"| {len(results['cases'])} cases | {results['wall_s']:.0f} s")
for m in rows:
    if m["status"] == "FAILED":
        print(f"  FAILED {m['path']} {m['case']} {m['direction']}: {m['note'][:200]}")
PY
    grep -E '^(FAILED|Traceback)|^[A-Za-z_.]*(Error|Exception)(:|$)|^ +- cut: ' "$f" | head -12 |
      sed 's/^/  /'
  done
  if [ -f "$work/grid-sweep/grid-sweep.txt" ]; then
    echo "grid sweep:"
    grep -E '^(grid sweep picks|choice )' "$work/grid-sweep/grid-sweep.txt" | sed 's/^/  /'
  fi
  echo "wall $((SECONDS - start)) s of ${budget} s; exit $status"
} | tee -a "$summary"
pack
exit $status
