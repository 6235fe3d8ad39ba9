#!/usr/bin/env bash
# GPU check in one call, the answers worth most first, the whole run within
# GPU_CHECK_BUDGET seconds (default 360: a 15-minute slot keeps room for the machine's
# start and one rerun). Steps, each under its own cap (and never past the budget):
#
#   setup       nvidia-smi, install (no network) or the import shim, versions      45 s
#   gpu-tests   every CUDA test file that runs without vLLM, each in its own
#               process under `timeout` (a hung CUDA synchronize cannot hold the
#               step), pytest-timeout per test where installed                     130 s
#   facts       `triton-offload info --calibrate`, the kernel's registers and
#               spills on this device (per tile size), the environment              35 s
#   presets     one full-size preset (default llama3.1-8b-tp4, then mamba-hybrid
#               if time is left), store and load: the project's paths beside
#               batched DMA and vLLM's kernel where importable, and the ceiling     70 s
#   grid-sweep  num_programs x tile size on the hybrid presets (each point
#               written as it is measured)                                          40 s
#   sweep       page size x pages per job (sweep only)                              30 s
#   summary     results (bench_seal.py's CUDA verification rows judged by
#               bench/gpu_check.py: verified / unverified against 0.95, host CPU
#               s per verified GB), archive                                         10 s
#
# Usage: bench/gpu_check.sh OUTPUT_DIR [--dry-run | --plan]
#
#   --dry-run   the same steps sized for a CPU-only machine (the CUDA tests skip, the
#               bench runs --quick on one tiny case) and without installing anything:
#               checks this script and the import shim, not the GPU.
#   --plan      print the step order and the time each step may use, then exit.
#
# Environment: GPU_CHECK_BUDGET (seconds, default 360; 260 for --dry-run),
# GPU_CHECK_PRESETS (the preset step's presets, default llama3.1-8b-tp4,mamba-hybrid),
# GPU_CHECK_INSTALL=1 (install in a dry run too), GPU_CHECK_TEST_FILES (replaces the
# CUDA test file list: "FILE CAP PER_TEST" entries separated by ';'), GPU_CHECK_CAPS
# (step caps replaced, e.g. "gpu-tests=20,presets=40"), GPU_CHECK_STEPS (the steps to
# run, e.g. "gpu-tests,presets"; setup and summary always run, the others are logged
# "not selected"), PYTHON.
#
# Slow is not wrong: a step or a test file stopped at its cap (timeout's exit 124: it
# stopped on SIGINT) with nothing wrong in what it wrote is logged "SLOW: ..." and does
# not fail the run, nor do the test files its overrun left no time for (a loaded
# machine made a dry run exit 1 for a test file whose collection alone took 13 s). One
# that had to be killed (exit 137: it ignored SIGINT, as a hung CUDA call does) is
# HUNG and fails it, as does any other non-zero exit, a failed test, or a step that
# the budget left no time to start.
#
# Installs nothing from the network: `pip install --no-deps --no-build-isolation -e .`
# needs only the setuptools already present; if that fails, or the installed package
# cannot import triton_offload.kernels, a symlinked copy of the tree in which
# kernels/ and bench/ sit inside triton_offload/ (as setup.cfg maps them) is used
# instead. Steps run under `timeout -s INT` (then KILL): pytest still writes its junit
# XML and the bench and the grid sweep still write what they measured.
#
# OUTPUT_DIR never holds more than 8 files (a remote runner may return no more):
#   summary.txt          steps (exit code, seconds), plan, versions, nvidia-smi, install,
#                        each test file, the calibration, the kernel's registers and the
#                        verification cost on CUDA
#   gpu-tests.xml/.log   the CUDA tests (junit XML of every file merged; a file killed
#                        by its time limit appears as one error) and their -v logs
#   presets-report.md    bench report of the preset step
#   sweep-report.md      bench report of the page-size x pages-per-job sweep
#   presets-bandwidth.png, sweep-bandwidth.png   the two benches' plots
#   details.tar.gz       everything: all logs, each file's junit XML, results.json and
#                        plots of both benches, grid-sweep/ (points as measured, summary),
#                        facts/ (info-calibrate.txt, kernel-resources.txt and the
#                        kernel's cubins, env.txt)
# The summary and details.tar.gz are refreshed after every step, so a run stopped from
# outside keeps what the finished steps wrote. Exit status: 0 when every step ran and
# passed.
set -uo pipefail

usage="usage: bench/gpu_check.sh OUTPUT_DIR [--dry-run | --plan]"
out=${1:?$usage}
mode=run
case "${2:-}" in
  "") ;;
  --dry-run) mode=dry ;;
  --plan) mode=plan ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
dry_run=0
[ "$mode" = dry ] && dry_run=1

# --- the plan: step order and caps (seconds) -------------------------------------------
# GPU caps: a 15-minute GPU slot holds the machine's start (1-2 min), this run and one
# rerun, so the run gets 360 s. Setup's own timeouts (nvidia-smi 2 x 5, pip 15, import
# check 8, versions 10) stay within its cap.
gpu_steps=(setup gpu-tests facts presets grid-sweep sweep summary)
gpu_caps=(45 130 35 70 40 30 10)
gpu_budget_default=360
# A CPU-only dry run: the same order, sized for an interpreter on 2 cores.
dry_caps=(30 70 30 55 40 25 10)
dry_budget_default=260
if [ "$dry_run" = 1 ]; then
  caps=("${dry_caps[@]}")
  budget=${GPU_CHECK_BUDGET:-$dry_budget_default}
else
  caps=("${gpu_caps[@]}")
  budget=${GPU_CHECK_BUDGET:-$gpu_budget_default}
fi
refuse() { echo "gpu_check: $*" >&2; exit 2; }
is_step() {  # is_step NAME: NAME is one of the steps
  local known
  for known in "${gpu_steps[@]}"; do [ "$known" = "$1" ] && return 0; done
  return 1
}
if [ -n "${GPU_CHECK_CAPS:-}" ]; then
  IFS=',' read -r -a cap_overrides <<<"$GPU_CHECK_CAPS"
  for entry in "${cap_overrides[@]}"; do
    name=${entry%%=*}
    seconds=${entry#*=}
    [[ "$entry" == *=* && "$seconds" =~ ^[1-9][0-9]*$ ]] ||
      refuse "GPU_CHECK_CAPS: '$entry' is not STEP=SECONDS (seconds a positive integer)"
    is_step "$name" || refuse "GPU_CHECK_CAPS: unknown step '$name'; steps: ${gpu_steps[*]}"
    for i in "${!gpu_steps[@]}"; do
      [ "${gpu_steps[$i]}" = "$name" ] && caps[i]=$seconds
    done
  done
fi
selected_steps=",${GPU_CHECK_STEPS:-${gpu_steps[*]}},"
selected_steps=${selected_steps// /,}
IFS=',' read -r -a wanted <<<"${GPU_CHECK_STEPS:-}"
for name in "${wanted[@]}"; do
  is_step "$name" || refuse "GPU_CHECK_STEPS: unknown step '$name'; steps: ${gpu_steps[*]}"
done
selected() {  # selected STEP: the step runs (GPU_CHECK_STEPS)
  [[ "$selected_steps" == *",$1,"* ]]
}
cap_of() {  # cap_of STEP: this run's cap of a step
  local i
  for i in "${!gpu_steps[@]}"; do
    [ "${gpu_steps[$i]}" = "$1" ] && { echo "${caps[$i]}"; return; }
  done
  echo 0
}
plan_line() {  # plan_line LABEL BUDGET CAPS...: the step order with caps and their sum
  local label=$1 plan_budget=$2 total=0 text="" i
  shift 2
  local values=("$@")
  for i in "${!gpu_steps[@]}"; do
    text+="${text:+, }${gpu_steps[$i]} ${values[$i]} s"
    total=$((total + values[i]))
  done
  echo "plan ($label, budget $plan_budget s): $text = $total s"
}
gpu_plan=$(plan_line "GPU run, default" "$gpu_budget_default" "${gpu_caps[@]}")
this_plan=$(plan_line "this $([ "$dry_run" = 1 ] && echo 'dry run' || echo run)" "$budget" "${caps[@]}")
if [ "$mode" = plan ]; then
  echo "$gpu_plan"
  echo "$(plan_line "dry run, default" "$dry_budget_default" "${dry_caps[@]}")"
  exit 0
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$work" "$work.tgz"' EXIT
summary="$out/summary.txt"
start=$SECONDS
status=0
reserve=$(cap_of summary)

export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PIP_NO_INPUT=1
export MPLBACKEND=Agg
if [ "$dry_run" = 0 ]; then unset TRITON_INTERPRET; fi

log() { printf '%s\n' "$*" | tee -a "$summary"; }
remaining() { echo $((budget - (SECONDS - start))); }
limit_for() {  # limit_for CAP: min(CAP, budget left - the summary's reserve)
  local left
  left=$(($(remaining) - reserve))
  echo $((left < $1 ? left : $1))
}

pack() {  # everything written so far, in one archive next to the summary
  cp "$summary" "$work/summary.txt" 2>/dev/null
  tar -czf "$work.tgz" --exclude=./shim -C "$work" . 2>/dev/null &&
    mv -f "$work.tgz" "$out/details.tar.gz"
}

slow_steps=""  # steps that exceeded their caps without anything wrong: not failures
not_selected() {  # not_selected STEP: true (and logged) when GPU_CHECK_STEPS leaves it out
  selected "$1" && return 1
  log "$(printf '%-16s %s' "$1" "not selected (GPU_CHECK_STEPS)")"
  return 0
}
# wrong_in LOG [RESULTS_DIR]: what a step stopped at its cap wrote shows a failure (a
# bench's partial results: a FAILED row of this project's paths, as the bench judges).
wrong_in() {
  local f
  grep -qE '^(FAILED|Traceback)|WRONG BYTES|not byte-exact' "$1" 2>/dev/null && return 0
  for f in "${2:-/nonexistent}"/results*.json; do
    [ -f "$f" ] || continue
    timeout 10 "$py" -c 'import json, sys
r = json.load(open(sys.argv[1]))
sys.exit(any(m["status"] == "FAILED" and m["role"] == "project"
             for m in r["measurements"] + r["correctness"]))' "$f" || return 0
  done
  return 1
}
# judge_stop NAME RC LIMIT LOG [RESULTS_DIR]: the note of a step that ended with RC;
# sets status=1 unless it succeeded or was only slow.
judge_stop() {
  local name=$1 rc=$2 limit=$3 logfile=$4 dir=${5:-}
  case "$rc" in
    0) note="" ;;
    124)
      if wrong_in "$logfile" "$dir"; then
        note="TIMED OUT after $limit s, and what it wrote has failures"
        status=1
      else
        note="SLOW: step $name exceeded its $limit s cap (stopped there; nothing wrong in what it wrote)"
        slow_steps+="${slow_steps:+, }$name"
      fi
      ;;
    137)
      note="HUNG: step $name did not stop on SIGINT at its $limit s cap; killed"
      status=1
      ;;
    *) note="" status=1 ;;
  esac
}

# step NAME CAP LOG COMMAND...: run under limit_for(CAP) seconds; skipped under 15 s.
step() {
  local name=$1 cap=$2 logfile=$3
  shift 3
  local limit began rc note=""
  not_selected "$name" && return 0
  limit=$(limit_for "$cap")
  if [ "$limit" -lt 15 ]; then
    log "$(printf '%-16s %-8s %5s s  %s' "$name" skipped 0 "budget spent ($(remaining) s left)")"
    status=1
    return 0
  fi
  began=$SECONDS
  (cd "$run_dir" && timeout -s INT -k 10 "$limit" "$@") >"$logfile" 2>&1
  rc=$?
  judge_stop "$name" "$rc" "$limit" "$logfile" "$work/$name"
  log "$(printf '%-16s rc=%-5s %5s s  %s' "$name" "$rc" $((SECONDS - began)) "$note")"
  pack
  return 0
}

: >"$summary"
log "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) budget ${budget} s$([ "$dry_run" = 1 ] && echo ' (dry run)')"
log "repo $repo ($(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
log "$gpu_plan"
[ "$dry_run" = 1 ] && log "$this_plan"
run_dir=$repo

# --- setup: the GPU as the driver sees it -------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 5 nvidia-smi --format=csv --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,clocks.max.sm \
    >"$work/nvidia-smi.csv" 2>&1
  sed 's/^/nvidia-smi: /' "$work/nvidia-smi.csv" | tee -a "$summary"
  { timeout 5 nvidia-smi; timeout 5 nvidia-smi topo -m; } >"$work/nvidia-smi.txt" 2>&1
else
  echo "nvidia-smi: not found" >"$work/nvidia-smi.txt"
fi

# --- setup: install (no network), else the import shim -------------------------------------
import_check='import triton_offload, triton_offload.kernels.copy_blocks, triton_offload.bench.harness
print("triton_offload from", triton_offload.__file__)
print("kernels from", triton_offload.kernels.copy_blocks.__file__)'
installed=0
if [ "$dry_run" = 0 ] || [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  if (cd "$repo" && timeout 15 "$py" -m pip install -q --no-deps --no-build-isolation -e .) \
    >"$work/install.log" 2>&1 && (cd "$work" && timeout 8 "$py" -c "$import_check") \
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
  if (cd "$work" && timeout 20 "$py" -c "$import_check") >>"$work/install.log" 2>&1; then
    log "install: using the shim $shim (PYTHONPATH)"
  else
    log "install: the shim does not import either (see install.log)"
    status=1
  fi
fi

# --- setup: versions -------------------------------------------------------------------------
(cd "$work" && timeout 10 "$py" - >"$work/versions.txt" 2>&1) <<'PY'
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
log "--- steps (setup took $((SECONDS - start)) s; budget left $(remaining) s)"
pack

# --- 1. the CUDA tests: one process per file ---------------------------------------------
# Every test file with CUDA tests that run without vLLM (tests/bench/test_gpu_check.py keeps
# this list complete), the most telling first, with the most seconds its process may
# take and pytest-timeout's limit per test (0: the file's own limit less 5 s, for a file
# that is one long test). pytest-timeout's thread method ends a hung process after
# printing every thread's stack, even inside a CUDA call no signal interrupts; the
# process's `timeout` is the backstop when the plugin is absent.
cuda_test_files=(
  "tests/transfer/test_engine_cuda.py 45 30"
  "tests/kernels/test_copy_blocks_cuda.py 25 20"
  "tests/transfer/test_engine_expedited.py 20 15"
  "tests/kernels/test_copy_blocks_specialization.py 25 20"
  "tests/bench/test_harness_cuda.py 40 0"
  "bench/suites/bench_kernel_tables.py 20 15"
  "bench/suites/bench_seal.py 70 30"
  "bench/suites/bench_layerwise.py 30 25"
)
if [ -n "${GPU_CHECK_TEST_FILES:-}" ]; then
  # Entries "FILE CAP PER_TEST" separated by ';' (tests/bench/test_gpu_check.py hangs one).
  IFS=';' read -r -a cuda_test_files <<<"$GPU_CHECK_TEST_FILES"
fi
pytest_opts=(-p no:cacheprovider -o addopts= -rA -v -m cuda)
if "$py" -c 'import pytest_benchmark' >/dev/null 2>&1; then
  pytest_opts+=(--benchmark-disable)
  have_benchmark=1
else
  have_benchmark=0  # bench_kernel_tables.py needs the benchmark fixture
fi
have_timeout=0
"$py" -c 'import pytest_timeout' >/dev/null 2>&1 && have_timeout=1

gpu_tests() {
  local began=$SECONDS step_limit entry file cap per_test limit name rc t0 note
  not_selected gpu-tests && return 0
  step_limit=$(limit_for "$(cap_of gpu-tests)")
  if [ "$step_limit" -lt 15 ]; then
    log "$(printf '%-16s %-8s %5s s  %s' gpu-tests skipped 0 "budget spent ($(remaining) s left)")"
    status=1
    return 0
  fi
  mkdir -p "$work/junit"
  : >"$out/gpu-tests.log"
  : >"$work/gpu-tests-files.txt"
  local failed=0 slow_files=0 unrun=0 file_log
  for entry in "${cuda_test_files[@]}"; do
    read -r file cap per_test <<<"$entry"
    name=$(basename "$file" .py)
    limit=$((step_limit - (SECONDS - began)))
    limit=$((limit < cap ? limit : cap))
    if [ "$file" = bench/suites/bench_kernel_tables.py ] && [ "$have_benchmark" = 0 ]; then
      echo "$file skipped: pytest-benchmark is not installed" >>"$work/gpu-tests-files.txt"
      continue
    fi
    if [ "$limit" -lt 10 ]; then
      # What the files before it took, not anything it did: slow, not a failure.
      echo "$file not run: SLOW, the step's $step_limit s cap was spent" >>"$work/gpu-tests-files.txt"
      unrun=$((unrun + 1))
      continue
    fi
    local opts=("${pytest_opts[@]}" --junitxml="$work/junit/$name.xml")
    if [ "$have_timeout" = 1 ]; then
      [ "$per_test" = 0 ] || [ "$per_test" -gt $((limit - 5)) ] && per_test=$((limit - 5))
      opts+=(--timeout "$per_test" --timeout-method thread)
    fi
    t0=$SECONDS
    printf '===== %s (limit %s s) =====\n' "$file" "$limit" >>"$out/gpu-tests.log"
    file_log="$work/junit/$name.log"
    (cd "$run_dir" && timeout -s INT -k 5 "$limit" "$py" -m pytest "${opts[@]}" "$file") \
      >"$file_log" 2>&1
    rc=$?
    cat "$file_log" >>"$out/gpu-tests.log"
    note=""
    if [ "$rc" = 124 ] && [ -f "$work/junit/$name.xml" ] && ! grep -qE '^(FAILED|ERROR) ' "$file_log" &&
      ! grep -qE '<testsuite [^>]*(errors|failures)="[1-9]' "$work/junit/$name.xml"; then
      # Stopped by SIGINT at its cap, pytest wrote what ran, and nothing failed: slow.
      note=" SLOW: exceeded its $limit s cap"
      echo "$limit" >"$work/junit/$name.slow"
      slow_files=$((slow_files + 1))
    else
      case "$rc" in
        124) note=" TIMED OUT after $limit s" ;;
        137) note=" HUNG: no stop within 5 s of SIGINT at its $limit s cap; killed" ;;
      esac
      # Killed at its limit (or no XML at all): one error in the merged XML says so.
      if [ -n "$note" ] || [ ! -f "$work/junit/$name.xml" ]; then
        echo "$limit" >"$work/junit/$name.killed"
      fi
      [ "$rc" = 0 ] || failed=1
    fi
    echo "$file rc=$rc $((SECONDS - t0)) s$note" >>"$work/gpu-tests-files.txt"
  done
  timeout 20 "$py" - "$work/junit" "$out/gpu-tests.xml" >>"$work/gpu-tests-files.txt" 2>&1 <<'PY'
"""Merge each file's junit XML; a killed file (with or without XML) adds one error."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

folder, target = Path(sys.argv[1]), Path(sys.argv[2])
merged = ET.Element("testsuites")
for path in sorted(folder.iterdir()):
    if path.suffix == ".xml":
        root = ET.parse(path).getroot()
        for suite in [root] if root.tag == "testsuite" else list(root):
            suite.set("name", path.stem)
            merged.append(suite)
    elif path.suffix == ".slow":
        limit = path.read_text().strip()
        suite = ET.SubElement(merged, "testsuite", name=f"{path.stem} (slow)", tests="1",
                              errors="0", failures="0", skipped="1")
        case = ET.SubElement(suite, "testcase", classname=path.stem, name="(rest of the file)")
        ET.SubElement(case, "skipped", message=f"stopped at its {limit} s cap: slow, not "
                      "failed (what ran before is in its own suite)")
    elif path.suffix == ".killed":
        limit = path.read_text().strip()
        suite = ET.SubElement(merged, "testsuite", name=path.stem, tests="1", errors="1",
                              failures="0", skipped="0")
        case = ET.SubElement(suite, "testcase", classname=path.stem, name="(whole file)")
        ET.SubElement(case, "error", message=f"no result within {limit} s: the process was "
                      "killed (a hang; gpu-tests.log has its last output)")
for key in ("tests", "failures", "errors", "skipped"):
    merged.set(key, str(sum(int(s.get(key, 0)) for s in merged)))
ET.ElementTree(merged).write(target, encoding="utf-8", xml_declaration=True)
print("merged:", ", ".join(f"{k} {merged.get(k)}" for k in ("tests", "failures", "errors", "skipped")))
PY
  cp "$out/gpu-tests.log" "$out/gpu-tests.xml" "$work/" 2>/dev/null
  [ "$failed" = 0 ] || status=1
  note=""
  if [ "$unrun" -gt 0 ]; then
    note="SLOW: step gpu-tests spent its $step_limit s cap ($unrun file(s) not run: under 10 s left)"
  elif [ "$slow_files" -gt 0 ]; then
    note="SLOW: $slow_files file(s) exceeded their caps"
  fi
  [ -n "$note" ] && slow_steps+="${slow_steps:+, }gpu-tests"
  log "$(printf '%-16s rc=%-5s %5s s  %s' gpu-tests "$failed" $((SECONDS - began)) "$note")"
  sed 's/^/  /' "$work/gpu-tests-files.txt" | tee -a "$summary"
  pack
}
gpu_tests

# --- 2. facts: the calibration, the kernel's registers on this device, the environment ----
facts() {
  local limit began rc=0 info_limit resources_limit note="" rcs=() one
  not_selected facts && return 0
  limit=$(limit_for "$(cap_of facts)")
  if [ "$limit" -lt 15 ]; then
    log "$(printf '%-16s %-8s %5s s  %s' facts skipped 0 "budget spent ($(remaining) s left)")"
    status=1
    return 0
  fi
  began=$SECONDS
  mkdir -p "$work/facts"
  # What is left after the environment (pip list: 5 s) and two 2-second kill margins,
  # in halves: the calibration (a process start, an auto engine, ~100 timed jobs of
  # about a millisecond) and the kernel compiles (a process start, one compile of
  # ~1-2 s per tile size not yet in Triton's cache).
  info_limit=$(((limit - 9) / 2))
  resources_limit=$(((limit - 9) / 2))
  (cd "$run_dir" && timeout -s INT -k 2 "$info_limit" "$py" -m triton_offload info --calibrate) \
    >"$work/facts/info-calibrate.txt" 2>&1
  rcs+=($?)
  (cd "$run_dir" && timeout -s INT -k 2 "$resources_limit" "$py" \
    -m triton_offload.bench.kernel_resources --out "$work/facts") \
    >"$work/facts/kernel-resources.log" 2>&1
  rcs+=($?)
  # The first failure's exit status, else 124 if one was stopped at its limit.
  for one in "${rcs[@]}"; do
    if [ "$one" != 0 ] && [ "$one" != 124 ]; then rc=$one; break; fi
    [ "$one" = 124 ] && rc=124
  done
  {
    echo "--- uname"; uname -a
    echo "--- nproc $(nproc 2>/dev/null)"
    echo "--- ulimit -l (locked memory, KiB) $(ulimit -l)"
    echo "--- meminfo"; head -5 /proc/meminfo 2>/dev/null
    echo "--- environment (CUDA, NVIDIA, TRITON, TORCH, PYTHON, LD_LIBRARY_PATH, PATH)"
    env | grep -E '^(CUDA|NVIDIA|TRITON|TORCH|PYTHON|LD_LIBRARY_PATH|PATH)' | sort
    echo "--- pip list"; timeout 5 "$py" -m pip list 2>&1
  } >"$work/facts/env.txt" 2>&1
  cat "$work/facts/info-calibrate.txt" "$work/facts/kernel-resources.log" >"$work/facts.log" 2>/dev/null
  judge_stop facts "$rc" "$((info_limit + resources_limit))" "$work/facts.log"
  log "$(printf '%-16s rc=%-5s %5s s  %s' facts "$rc" $((SECONDS - began)) "$note")"
  grep -E '^(calibration|dma path|gpu) ' "$work/facts/info-calibrate.txt" 2>/dev/null |
    sed 's/^/  /' | tee -a "$summary"
  sed 's/^/  kernel: /' "$work/facts/kernel-resources.txt" 2>/dev/null | tee -a "$summary"
  pack
}
facts

# --- 3. the preset, 4. the grid sweep, 5. the page sweep -------------------------------------
presets=${GPU_CHECK_PRESETS:-llama3.1-8b-tp4,mamba-hybrid}
if [ "$dry_run" = 1 ]; then
  preset_args=(--quick --presets llama3.1-8b-tp4 --paths torch,triton,per-page-copy)
  sweep_args=(--quick --page-sizes 4k --pages 16 --paths torch)
  grid_args=(--quick)
else
  # The project's paths beside batched DMA (cuda-python) and vLLM's swap_blocks kernel
  # (unavailable where vLLM is not importable); the ceiling is always measured.
  preset_args=(--presets "$presets" --paths triton,dma,auto,batched-dma,vllm-swap-blocks)
  sweep_args=(--paths triton,dma,batched-dma --pages 1024,16384)
  grid_args=()
fi
bench() {  # bench NAME ARGS...: --max-seconds leaves 15 s to finish a path and write
  local name=$1 limit plot
  shift
  limit=$(limit_for "$(cap_of "$name")")
  step "$name" "$(cap_of "$name")" "$work/$name.log" "$py" -m triton_offload bench --no-progress \
    --out "$work/$name" --max-seconds $((limit - 15 > 1 ? limit - 15 : 1)) "$@"
  cp "$work/$name/report.md" "$out/$name-report.md" 2>/dev/null
  # a sweep run's own plot is sweep.png
  if [ -f "$work/$name/sweep.png" ]; then plot=sweep.png; else plot=bandwidth.png; fi
  cp "$work/$name/$plot" "$out/$name-bandwidth.png" 2>/dev/null
  pack
}
bench presets "${preset_args[@]}"
grid_limit=$(limit_for "$(cap_of grid-sweep)")
step grid-sweep "$(cap_of grid-sweep)" "$work/grid-sweep.log" "$py" -m triton_offload.bench.grid_sweep \
  --out "$work/grid-sweep" --max-seconds $((grid_limit - 15 > 1 ? grid_limit - 15 : 1)) \
  "${grid_args[@]}"
bench sweep --sweep-only "${sweep_args[@]}"

# --- summary -------------------------------------------------------------------------------
# bench_seal.py's CUDA rows judged by bench/gpu_check.py, one section each: verified /
# unverified speed against its goal and host CPU seconds per verified GB; keyed / unkeyed
# verified speed against its own (under a goal: reported, not failed). A passed case
# without its row, or a row that does not parse, fails the check.
verification=""
if [ -f "$out/gpu-tests.log" ]; then
  verification=$(cd "$run_dir" && timeout 10 "$py" -m triton_offload.bench.gpu_check \
    verification "$out/gpu-tests.log" 2>&1)
  verification_rc=$?
  if [ "$verification_rc" != 0 ]; then
    status=1
    verification+=$'\n'"  (bench/gpu_check.py verification exited $verification_rc)"
  fi
fi
{
  echo "--- results"
  f="$out/gpu-tests.log"
  if [ -f "$f" ]; then
    echo "gpu-tests:"
    grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* =+$' "$f" | sed 's/^/  /'
    grep -E '^(FAILED|ERROR) |Timeout' "$f" | head -20 | sed 's/^/  /'
    [ -n "$verification" ] && printf '%s\n' "$verification"
    # bench_layerwise.py: time to first token of a sync-loaded hit, whole-job vs layer-wise.
    grep -E '^layer-wise cuda:' "$f" | sed 's/^/  /'
  fi
  for name in presets sweep; do
    f="$work/$name.log"
    [ -f "$f" ] || continue
    echo "bench $name: $(ls "$work/$name" 2>/dev/null | tr '\n' ' ')"
    [ -f "$work/$name/results.json" ] && timeout 5 "$py" - "$work/$name/results.json" <<'PY'
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
    grep -E '^(grid sweep picks|grid sweep error|choice )|WRONG BYTES' \
      "$work/grid-sweep/grid-sweep.txt" | sed 's/^/  /'
  elif [ -f "$work/grid-sweep/grid-sweep.jsonl" ]; then
    echo "grid sweep: $(wc -l <"$work/grid-sweep/grid-sweep.jsonl") points measured (no summary)"
  fi
  [ -n "$slow_steps" ] && echo "slow: $slow_steps (exceeded their caps; not failures)"
  echo "wall $((SECONDS - start)) s of ${budget} s; exit $status"
} | tee -a "$summary"
pack
exit $status
