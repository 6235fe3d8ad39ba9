"""bench/gpu_check.sh on a CPU-only machine: its --dry-run runs every step (the CUDA
tests skip, the bench runs one tiny case) through the import shim, with the installed
package hidden, and leaves at most 8 files in the output folder. Its plan fits the GPU
slot (360 s by default), every CUDA test file that runs without vLLM is in it, a hung
test file is killed without taking the step with it, and the test tree collects
without vLLM."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
OUTPUTS = {
    "summary.txt",
    "gpu-tests.xml",
    "gpu-tests.log",
    "presets-report.md",
    "sweep-report.md",
    "presets-bandwidth.png",
    "sweep-bandwidth.png",
    "details.tar.gz",
}


#: Step order of the check: the answers worth most first.
STEPS = ("setup", "gpu-tests", "facts", "presets", "grid-sweep", "sweep", "summary")
#: The GPU slot: 15 minutes for the machine's start, the check and one rerun.
MAX_DEFAULT_BUDGET = 360


def _run(
    tmp_path: Path, *args: str, budget: int | None = None, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    # A python that sees the environment's packages but not their .pth files: the
    # editable install of this package is invisible, so only the shim can import it.
    wrapper = tmp_path / "python-without-site"
    site = sysconfig.get_paths()["purelib"]
    wrapper.write_text(
        "#!/bin/sh\n"
        f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}"\n'
        f'exec "{sys.executable}" -S "$@"\n'
    )
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(PYTHON=str(wrapper), TMPDIR=str(tmp_path))
    if budget is not None:
        env["GPU_CHECK_BUDGET"] = str(budget)
    env.update(env_extra or {})
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=320,
    )


def _plan(text: str, label: str) -> tuple[list[tuple[str, int]], int, int]:
    """(steps with caps, their sum, the budget) of the plan line labelled ``label``."""
    match = re.search(rf"^plan \({re.escape(label)}, budget (\d+) s\): (.*) = (\d+) s$", text, re.M)
    assert match, text
    steps = [(name, int(cap)) for name, cap in re.findall(r"([\w-]+) (\d+) s", match.group(2))]
    return steps, int(match.group(3)), int(match.group(1))


def test_default_plan_fits_the_gpu_slot(tmp_path: Path) -> None:
    done = _run(tmp_path, str(tmp_path / "out"), "--plan")
    assert done.returncode == 0, done.stderr
    steps, total, budget = _plan(done.stdout, "GPU run, default")
    assert budget <= MAX_DEFAULT_BUDGET
    assert total <= budget
    assert tuple(name for name, _ in steps) == STEPS
    assert sum(cap for _, cap in steps) == total
    dry_steps, dry_total, dry_budget = _plan(done.stdout, "dry run, default")
    assert tuple(name for name, _ in dry_steps) == STEPS and dry_total <= dry_budget
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


CUDA_MARK = re.compile(r"^(pytestmark = pytest\.mark\.cuda|\s*@pytest\.mark\.cuda)\b", re.M)


def _needs_vllm(path: Path) -> bool:
    text = path.read_text()
    return bool(re.search(r"^\s*(from|import) (vllm|triton_offload\.vllm)\b", text, re.M))


def test_every_cuda_test_file_that_runs_without_vllm_is_checked() -> None:
    listed = re.findall(r'^  "([\w/.]+\.py) \d+ \d+"$', SCRIPT.read_text(), re.M)
    marked = {
        str(path.relative_to(ROOT))
        for folder in ("tests", "bench/suites")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if CUDA_MARK.search(path.read_text()) and not _needs_vllm(path)
    }
    assert "tests/transfer/test_engine_expedited.py" in marked
    assert "tests/kernels/test_copy_blocks_specialization.py" in marked
    assert set(listed) == marked
    assert len(listed) == len(set(listed))
    # The first file is the engine's: pinned pool, streams, DMA, calibration.
    assert listed[0] == "tests/transfer/test_engine_cuda.py"


def test_script_parses_and_refuses_bad_arguments(tmp_path: Path) -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert _run(tmp_path).returncode != 0  # no output folder
    refused = _run(tmp_path, str(tmp_path / "out"), "--fast")
    assert refused.returncode == 2 and "usage" in refused.stderr


def test_dry_run_runs_every_step_through_the_shim(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(tmp_path, str(out), "--dry-run")
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "using the shim" in summary
    assert f"kernels {tmp_path}" in summary  # the kernels came from the shim's tree
    # The step order and the time budget, of the GPU run and of this dry run.
    _, gpu_total, gpu_budget = _plan(summary, "GPU run, default")
    assert gpu_total <= gpu_budget <= MAX_DEFAULT_BUDGET
    _, dry_total, dry_budget = _plan(summary, "this dry run")
    assert dry_total <= dry_budget
    positions = [summary.index(f"\n{name:<16} rc=0 ") for name in STEPS[1:-1]]
    assert positions == sorted(positions), summary  # run in the plan's order
    wall = int(re.search(r"^wall (\d+) s of (\d+) s; exit 0$", summary, re.M).group(1))
    assert wall <= dry_budget
    for file in ("tests/transfer/test_engine_cuda.py", "tests/transfer/test_engine_expedited.py"):
        assert re.search(rf"^  {re.escape(file)} rc=0 \d+ s$", summary, re.M), summary
    assert "calibration     not run: needs CUDA" in summary
    assert "kernel: not compiled: no CUDA device here" in summary
    assert re.search(
        r"^verification on cuda .*: not measured: its CUDA cases skipped \(needs a CUDA device\)$",
        summary,
        re.M,
    ), summary
    assert re.search(
        r"^keyed seals on cuda .*: not measured: its CUDA cases skipped \(needs a CUDA device\)$",
        summary,
        re.M,
    ), summary
    # The launch-grid sweep ran (interpreted) and the summary states what it would pick.
    assert "grid sweep picks num_programs=" in summary
    assert "choice per-plane vs per-job: not run (needs CUDA copy engines)" in summary
    files = {p.name for p in out.iterdir()}
    assert files == OUTPUTS and len(files) <= 8
    merged = ET.parse(out / "gpu-tests.xml").getroot()
    assert merged.tag == "testsuites"
    assert {suite.get("name") for suite in merged} >= {"test_engine_cuda", "test_engine_expedited"}
    assert int(merged.get("tests", 0)) > 0 and int(merged.get("skipped", 0)) > 0
    assert merged.get("failures") == "0" and merged.get("errors") == "0"
    assert "## " in (out / "presets-report.md").read_text()
    with tarfile.open(out / "details.tar.gz") as archive:
        names = set(archive.getnames())
        assert {"./versions.txt", "./install.log", "./nvidia-smi.txt"} <= names
        assert {"./grid-sweep/grid-sweep.json", "./grid-sweep/grid-sweep.txt"} <= names
        assert "./grid-sweep/grid-sweep.jsonl" in names  # the points, as measured
        facts = {"./facts/info-calibrate.txt", "./facts/kernel-resources.txt", "./facts/env.txt"}
        assert facts <= names
        assert "./junit/test_engine_cuda.xml" in names
        env = archive.extractfile("./facts/env.txt").read().decode()
        assert "--- pip list" in env and "ulimit -l" in env
        assert not any(name.startswith("./shim") for name in names)
        for bench in ("presets", "sweep"):
            results = json.load(archive.extractfile(f"./{bench}/results.json"))
            assert results["config"]["max_seconds"] >= 1
            assert results["measurements"]
            assert all(m["status"] != "FAILED" for m in results["measurements"])
    assert not any(p.name.startswith("gpu_check.") for p in tmp_path.iterdir())  # cleaned up


@pytest.mark.parametrize("budget", [12])
def test_spent_budget_skips_steps_and_still_reports(tmp_path: Path, budget: int) -> None:
    out = tmp_path / "out"
    done = _run(tmp_path, str(out), "--dry-run", budget=budget)
    assert done.returncode == 1
    summary = (out / "summary.txt").read_text()
    for name in STEPS[1:-1]:
        assert f"\n{name:<16} skipped " in summary, summary
    assert "budget spent" in summary
    assert (out / "details.tar.gz").stat().st_size > 0


def test_a_hung_test_file_is_killed_and_reported(tmp_path: Path) -> None:
    """A file whose process never returns (a hung synchronize looks the same from
    outside) is killed at its limit; the next file still runs, the merged XML counts
    the killed file as an error, and the step fails."""
    hung = tmp_path / "test_hung_probe.py"
    # Deaf to SIGINT, as a process inside a CUDA call is: only the KILL ends it.
    hung.write_text(
        "import signal\nimport time\n\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "time.sleep(600)\n"
    )
    files = f"{hung} 12 0;tests/transfer/test_engine_expedited.py 30 20"
    out = tmp_path / "out"
    done = _run(
        tmp_path, str(out), "--dry-run", budget=75, env_extra={"GPU_CHECK_TEST_FILES": files}
    )
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 1, summary
    assert re.search(
        rf"^  {re.escape(str(hung))} rc=137 \d+ s HUNG: no stop within 5 s of SIGINT at its "
        r"12 s cap; killed$",
        summary,
        re.M,
    ), summary
    assert re.search(r"^  tests/transfer/test_engine_expedited.py rc=0 \d+ s$", summary, re.M), (
        summary
    )
    assert "\ngpu-tests        rc=1 " in summary
    merged = ET.parse(out / "gpu-tests.xml").getroot()
    killed = [s for s in merged if s.get("name") == "test_hung_probe"]
    assert any(s.get("errors") == "1" for s in killed)
    assert int(merged.get("errors")) >= 1


def test_cuda_tests_collect_without_vllm(tmp_path: Path) -> None:
    """`pytest -m cuda` on a machine without vLLM: the vLLM test files skip with a
    reason instead of failing to collect (vLLM is hidden by a plugin here)."""
    plugin = tmp_path / "hide_vllm.py"
    plugin.write_text("import sys\n\nsys.modules['vllm'] = None  # import vllm -> ImportError\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "hide_vllm",
            "-m",
            "cuda",
            "--co",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.splitlines()[-1].lower(), done.stdout[-2000:]
    assert "tests/transfer/test_engine_cuda.py::" in done.stdout


def test_a_file_over_its_cap_is_slow_not_failed(tmp_path: Path) -> None:
    """On a loaded machine a test file can outlast its cap without anything being wrong
    (its collection alone took 13 s): stopped at the cap, it is reported SLOW and does
    not fail the check, and neither do the files its overrun left no time for. Only
    the gpu-tests step runs (GPU_CHECK_STEPS), under a cap made small (GPU_CHECK_CAPS)."""
    slow = tmp_path / "test_slow_probe.py"
    # Slow, not hung: the import sleeps, and SIGINT stops it as it stops pytest.
    slow.write_text("import time\n\ntime.sleep(600)\n")
    files = f"{slow} 12 0;tests/transfer/test_engine_expedited.py 30 20"
    out = tmp_path / "out"
    env = {"GPU_CHECK_TEST_FILES": files, "GPU_CHECK_STEPS": "gpu-tests"}
    done = _run(
        tmp_path, str(out), "--dry-run", env_extra={**env, "GPU_CHECK_CAPS": "gpu-tests=20"}
    )
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary
    assert re.search(
        rf"^  {re.escape(str(slow))} rc=124 \d+ s SLOW: exceeded its 12 s cap$", summary, re.M
    ), summary
    assert re.search(
        r"^  tests/transfer/test_engine_expedited.py not run: SLOW, the step's 20 s cap was spent$",
        summary,
        re.M,
    ), summary
    assert re.search(
        r"^gpu-tests +rc=0 +\d+ s  SLOW: step gpu-tests spent its 20 s cap \(1 file\(s\) not run",
        summary,
        re.M,
    )
    for name in ("facts", "presets", "grid-sweep", "sweep"):
        assert re.search(rf"^{name} +not selected \(GPU_CHECK_STEPS\)", summary, re.M), summary
    assert re.search(r"^slow: gpu-tests \(exceeded their caps; not failures\)$", summary, re.M)
    assert re.search(r"^wall \d+ s of \d+ s; exit 0$", summary, re.M), summary
    merged = ET.parse(out / "gpu-tests.xml").getroot()
    assert merged.get("failures") == "0" and merged.get("errors") == "0"


def test_a_failing_file_still_fails_the_check(tmp_path: Path) -> None:
    """Slowness is forgiven, a wrong result is not: a file that errors fails the step."""
    broken = tmp_path / "test_broken_probe.py"
    broken.write_text("raise RuntimeError('wrong bytes in the probe')\n")
    out = tmp_path / "out"
    env = {"GPU_CHECK_TEST_FILES": f"{broken} 30 0", "GPU_CHECK_STEPS": "gpu-tests"}
    done = _run(tmp_path, str(out), "--dry-run", env_extra=env)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 1, summary
    assert re.search(rf"^  {re.escape(str(broken))} rc=2 \d+ s$", summary, re.M), summary
    assert re.search(r"^gpu-tests +rc=1 ", summary, re.M) and "SLOW" not in summary
    assert re.search(r"^wall \d+ s of \d+ s; exit 1$", summary, re.M), summary


def test_caps_and_steps_from_the_environment_are_checked(tmp_path: Path) -> None:
    for env, named in (
        ({"GPU_CHECK_CAPS": "gpu-tests=fast"}, "GPU_CHECK_CAPS: 'gpu-tests=fast'"),
        ({"GPU_CHECK_CAPS": "warp-drive=10"}, "GPU_CHECK_CAPS: unknown step 'warp-drive'"),
        ({"GPU_CHECK_STEPS": "gpu-tests,tea"}, "GPU_CHECK_STEPS: unknown step 'tea'"),
    ):
        done = _run(tmp_path, str(tmp_path / "out"), "--dry-run", env_extra=env)
        assert done.returncode == 2 and named in done.stderr, (env, done.stderr)


# --------------------------------------------- the verification summary (bench/gpu_check.py)

#: bench_seal.py's CUDA cases: (path, direction, page KiB) of each.
SEAL_CASES = [
    (path, direction, page)
    for direction in ("store", "load")
    for page in (8, 256)
    for path in ("triton", "dma", "auto")
]


def _printed(what: str, page: int, times: dict[str, float], **extra: Any) -> str:
    """What bench_seal.py's report prints for one CUDA case of ``page`` KiB pages."""
    import contextlib
    import io
    from types import SimpleNamespace

    from triton_offload.bench.alternate import report

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report(SimpleNamespace(extra_info={}), what, page * 1024 * 256, times, **extra)
    return printed.getvalue()


def _seal_row(path: str, direction: str, page: int, plain_s: float, verified_s: float) -> str:
    """The row bench_seal.py prints for one CUDA case, printed by the bench's own report."""
    return _printed(
        f"engine cuda {path} {direction}, {page} KiB pages",
        page,
        {"unverified": plain_s, "verified": verified_s},
        host_cpu_s_per_GB=0.0123,
        algorithm="xxh3-64 (checksum kernel)",
    )


def _keyed_row(path: str, direction: str, page: int, unkeyed_s: float, keyed_s: float) -> str:
    """The row bench_seal.py's keyed CUDA case prints (``_keyed_cost``), by the same report."""
    return _printed(
        f"engine cuda {path} {direction} keyed, {page} KiB pages",
        page,
        {"unkeyed": unkeyed_s, "keyed": keyed_s},
        names=("unkeyed", "keyed"),
        algorithm="keyed_wsum64",
    )


VERIFICATION_CASE = "test_engine_verification_cost_cuda"
KEYED_CASE = "test_engine_keyed_cost_cuda"


def _seal_log(
    rows: dict[tuple[str, str, int], str],
    outcomes: dict[tuple[str, str, int], str],
    case: str = VERIFICATION_CASE,
) -> str:
    """gpu-tests.log's part for bench_seal.py's ``case`` as pytest -v -rA writes it."""
    lines = ["===== bench/suites/bench_seal.py (limit 40 s) =====", "collected 16 items"]
    for (path, direction, page), outcome in outcomes.items():
        name = f"{case}[{direction}-{page}KiB-{path}]"
        lines.append(f"bench/suites/bench_seal.py::{name} {outcome} [  8%]")
    lines.append("=" * 30 + " PASSES " + "=" * 30)
    for (path, direction, page), row in rows.items():
        lines.append(f"___ {case}[{direction}-{page}KiB-{path}] ___")
        lines.append("-" * 10 + " Captured stdout call " + "-" * 10)
        lines.append(row)
    return "\n".join(lines) + "\n"


def test_verification_summary_judges_every_cuda_row() -> None:
    from triton_offload.bench.gpu_check import RATIO_GOAL, verification_summary

    # Verified time per case: every ratio from 0.90 to 1.0; the 0.949 one prints "0.95".
    ratios = {case: 0.90 + 0.1 * i / (len(SEAL_CASES) - 1) for i, case in enumerate(SEAL_CASES)}
    ratios[SEAL_CASES[3]] = 0.949
    rows = {case: _seal_row(*case, 1.0e-3, 1.0e-3 / r) for case, r in ratios.items()}
    log = _seal_log(rows, dict.fromkeys(SEAL_CASES, "PASSED"))
    lines, broken = verification_summary(log)
    text = "\n".join(lines)
    assert not broken, text
    assert lines[0].startswith("verification on cuda") and f"goal >= {RATIO_GOAL}" in lines[0]
    for (path, direction, page), ratio in ratios.items():
        verdict = "ok" if ratio >= RATIO_GOAL else "BELOW GOAL"
        pattern = (
            rf"^  {path} +{direction} +{page} KiB: ratio {ratio:.3f} \(.*\), host 0\.0123 CPU s "
            rf"per verified GB  {verdict}$"
        )
        assert re.search(pattern, text, re.M), (pattern, text)
    meeting = sum(r >= RATIO_GOAL for r in ratios.values())
    assert meeting == 6  # the cases straddle the goal; 0.949 is under it
    assert "ratio: lowest 0.900 (triton store 8 KiB), median " in text
    assert f"; {meeting} of 12 rows meet the goal" in text
    assert "host CPU s per verified GB: median 0.0123, highest 0.0123" in text


@pytest.mark.parametrize(
    "fault, named",
    [
        (
            "missing",
            "case test_engine_verification_cost_cuda[load-8KiB-dma] passed but printed no row",
        ),
        ("unpassed", "row dma load 8 KiB has no passed case"),
        ("nan", "row dma load 8 KiB: verified GB/s nan"),
        ("disagrees", "row dma load 8 KiB: ratio 0.5 disagrees with its GB/s"),
        ("twice", "row dma load 8 KiB printed twice"),
    ],
)
def test_a_broken_verification_report_is_named(fault: str, named: str) -> None:
    from triton_offload.bench.gpu_check import verification_summary

    broken_case = ("dma", "load", 8)
    rows = {case: _seal_row(*case, 1.0e-3, 1.02e-3) for case in SEAL_CASES}
    outcomes = dict.fromkeys(SEAL_CASES, "PASSED")
    if fault == "missing":
        del rows[broken_case]
    elif fault == "unpassed":
        outcomes[broken_case] = "FAILED"
    elif fault == "nan":
        rows[broken_case] = re.sub(
            r"unverified, [0-9.]+ GB/s", "unverified, nan GB/s", rows[broken_case]
        )
    elif fault == "disagrees":
        rows[broken_case] = re.sub(r"ratio [0-9.]+", "ratio 0.50", rows[broken_case])
    elif fault == "twice":
        rows[broken_case] += rows[broken_case]
    lines, broken = verification_summary(_seal_log(rows, outcomes))
    text = "\n".join(lines)
    assert broken, text
    assert f"  REPORT BROKEN: {named}" in text, text


def test_verification_not_measured_is_said_and_not_broken() -> None:
    from triton_offload.bench.gpu_check import verification_summary

    skipped = _seal_log({}, dict.fromkeys(SEAL_CASES, "SKIPPED"))
    skipped += "SKIPPED [12] bench/suites/bench_seal.py:156: needs a CUDA device\n"
    lines, broken = verification_summary(skipped)
    assert not broken and len(lines) == 1
    assert lines[0].endswith("not measured: its CUDA cases skipped (needs a CUDA device)")
    lines, broken = verification_summary("===== tests/transfer/test_engine_cuda.py =====\n")
    assert not broken and lines[0].endswith("not measured: its CUDA cases did not run")


def test_the_case_ids_of_bench_seal_map_to_its_rows() -> None:
    """The ids pytest gives bench_seal.py's CUDA cases name one (path, direction, page)
    each, the ones its rows print."""
    from triton_offload.bench.gpu_check import case_key

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--co",
            "-q",
            "-m",
            "cuda",
            "-p",
            "no:cacheprovider",
            "bench/suites/bench_seal.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ids = re.findall(r"::test_engine_verification_cost_cuda\[([^\]]+)\]$", done.stdout, re.M)
    assert sorted(case_key(i) for i in ids) == sorted(SEAL_CASES), done.stdout[-2000:]
    keyed = re.findall(r"::test_engine_keyed_cost_cuda\[([^\]]+)\]$", done.stdout, re.M)
    assert sorted(case_key(i) for i in keyed) == sorted(SEAL_CASES), done.stdout[-2000:]


def test_the_check_fails_on_a_broken_verification_report(tmp_path: Path) -> None:
    """Through the script: CUDA rows in gpu-tests.log are judged in the summary (one under
    the goal: reported, not failed); a passed case that printed no row fails the check."""
    probe = tmp_path / "test_seal_probe.py"
    good = _seal_row("triton", "store", 8, 1.0e-3, 1.01e-3)
    low = _seal_row("dma", "load", 256, 1.0e-3, 1.25e-3)
    probe.write_text(
        "import pytest\n\n"
        "CASES = ['store-8KiB-triton', 'load-256KiB-dma', 'load-8KiB-auto']\n\n\n"
        "@pytest.mark.cuda\n"
        "@pytest.mark.parametrize('case', CASES)\n"
        "def test_engine_verification_cost_cuda(case):\n"
        f"    rows = {{'store-8KiB-triton': {good!r}, 'load-256KiB-dma': {low!r}}}\n"
        "    print(rows.get(case, ''))\n"
    )
    out = tmp_path / "out"
    env = {"GPU_CHECK_TEST_FILES": f"{probe} 30 0", "GPU_CHECK_STEPS": "gpu-tests"}
    done = _run(tmp_path, str(out), "--dry-run", env_extra=env)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 1, summary
    assert re.search(r"^gpu-tests +rc=0 ", summary, re.M), summary  # the tests passed
    assert re.search(r"^  triton store +8 KiB: ratio 0\.990 .*  ok$", summary, re.M), summary
    assert re.search(r"^  dma +load +256 KiB: ratio 0\.800 .*  BELOW GOAL$", summary, re.M)
    assert (
        "  REPORT BROKEN: case test_engine_verification_cost_cuda[load-8KiB-auto] passed but "
        "printed no row" in summary
    )
    assert re.search(
        r"^keyed seals on cuda .*: not measured: its CUDA cases did not run$", summary, re.M
    ), summary
    assert re.search(r"^wall \d+ s of \d+ s; exit 1$", summary, re.M), summary


# ------------------------------------------------ the keyed seals section (bench/gpu_check.py)


def test_the_row_patterns_exclude_each_other() -> None:
    """A verification row is never read as a keyed row, nor the other way round (the
    rows as the bench's own report prints them)."""
    from triton_offload.bench.gpu_check import KEYED_ROW, ROW

    for case in SEAL_CASES:
        plain = _seal_row(*case, 1.0e-3, 1.02e-3).strip()
        keyed = _keyed_row(*case, 1.0e-3, 1.02e-3).strip()
        assert ROW.match(plain) and not KEYED_ROW.match(plain), plain
        assert KEYED_ROW.match(keyed) and not ROW.match(keyed), keyed


def test_keyed_summary_judges_every_cuda_row() -> None:
    from triton_offload.bench.gpu_check import KEYED_RATIO_GOAL, keyed_summary

    assert KEYED_RATIO_GOAL == 0.9
    # Keyed time per case: every ratio from 0.85 to 1.0; the 0.899 one prints "0.90"
    # (256 KiB pages: 67 GB/s, whose three decimals keep the ratio's third).
    ratios = {case: 0.85 + 0.15 * i / (len(SEAL_CASES) - 1) for i, case in enumerate(SEAL_CASES)}
    ratios[("dma", "store", 256)] = 0.899
    rows = {case: _keyed_row(*case, 1.0e-3, 1.0e-3 / r) for case, r in ratios.items()}
    assert "ratio 0.90," in rows[("dma", "store", 256)]
    lines, broken = keyed_summary(_seal_log(rows, dict.fromkeys(SEAL_CASES, "PASSED"), KEYED_CASE))
    text = "\n".join(lines)
    assert not broken, text
    assert lines[0] == (
        "keyed seals on cuda (bench_seal.py: keyed / unkeyed verified speed, goal >= 0.9):"
    )
    for (path, direction, page), ratio in ratios.items():
        verdict = "ok" if ratio >= KEYED_RATIO_GOAL else "BELOW GOAL"
        pattern = rf"^  {path} +{direction} +{page} KiB: ratio ([0-9.]+) \(.*\)  {verdict}$"
        found = re.search(pattern, text, re.M)
        # The ratio comes from GB/s rounded to three decimals: within 0.001 at 8 KiB pages.
        assert found and abs(float(found.group(1)) - ratio) < 1e-3, (pattern, text)
    meeting = sum(r >= KEYED_RATIO_GOAL for r in ratios.values())
    assert meeting == 7  # the cases straddle the goal; 0.899 is under it
    assert lines[-1].startswith("  ratio: lowest 0.850 (triton store 8 KiB), median ")
    assert lines[-1].endswith(f"; {meeting} of 12 rows meet the goal")
    assert "CPU s" not in text  # keyed rows print no host CPU cost
    assert len(lines) == 1 + len(SEAL_CASES) + 1


@pytest.mark.parametrize(
    "fault, named",
    [
        ("missing", "case test_engine_keyed_cost_cuda[load-8KiB-dma] passed but printed no row"),
        ("unpassed", "row dma load 8 KiB has no passed case"),
        ("nan", "row dma load 8 KiB: keyed GB/s nan"),
        ("disagrees", "row dma load 8 KiB: ratio 0.5 disagrees with its GB/s"),
    ],
)
def test_a_broken_keyed_report_is_named(fault: str, named: str) -> None:
    from triton_offload.bench.gpu_check import keyed_summary

    broken_case = ("dma", "load", 8)
    rows = {case: _keyed_row(*case, 1.0e-3, 1.05e-3) for case in SEAL_CASES}
    outcomes = dict.fromkeys(SEAL_CASES, "PASSED")
    if fault == "missing":
        del rows[broken_case]
    elif fault == "unpassed":
        outcomes[broken_case] = "FAILED"
    elif fault == "nan":
        rows[broken_case] = re.sub(r"unkeyed, [0-9.]+ GB/s", "unkeyed, nan GB/s", rows[broken_case])
    elif fault == "disagrees":
        rows[broken_case] = re.sub(r"ratio [0-9.]+", "ratio 0.50", rows[broken_case])
    lines, broken = keyed_summary(_seal_log(rows, outcomes, KEYED_CASE))
    text = "\n".join(lines)
    assert broken, text
    assert f"  REPORT BROKEN: {named}" in text, text


def test_keyed_not_measured_is_said_and_not_broken() -> None:
    from triton_offload.bench.gpu_check import keyed_summary, verification_summary

    # Both kinds skipped, with pytest -rA's folded skip lines (one per test function).
    skipped = _seal_log({}, dict.fromkeys(SEAL_CASES, "SKIPPED"))
    skipped += _seal_log({}, dict.fromkeys(SEAL_CASES, "SKIPPED"), KEYED_CASE)
    skipped += "SKIPPED [12] bench/suites/bench_seal.py:167: needs a CUDA device\n"
    skipped += "SKIPPED [12] bench/suites/bench_seal.py:210: needs a CUDA device\n"
    for summary in (verification_summary, keyed_summary):
        lines, broken = summary(skipped)
        assert not broken and len(lines) == 1, lines
        assert lines[0].endswith("not measured: its CUDA cases skipped (needs a CUDA device)")
    lines, broken = keyed_summary(skipped.replace("::test_engine_verification", "::elsewhere"))
    assert not broken and lines[0].endswith("skipped (needs a CUDA device)")
    # A log of the verification cases only (bench_seal.py before its keyed cases).
    passed = {case: _seal_row(*case, 1.0e-3, 1.02e-3) for case in SEAL_CASES}
    only = _seal_log(passed, dict.fromkeys(SEAL_CASES, "PASSED"))
    lines, broken = keyed_summary(only)
    assert not broken and lines == [
        "keyed seals on cuda (bench_seal.py: keyed / unkeyed verified speed, goal >= 0.9): "
        "not measured: its CUDA cases did not run"
    ]


def _both_logs(
    *, keyed_without: tuple[str, str, int] | None = None, failed: tuple[str, str, int] | None = None
) -> tuple[str, str, str]:
    """(verification part, keyed part, the two together) of one gpu-tests.log: every
    case passed, one keyed row under its goal; or the keyed case ``keyed_without``
    printed no row, or the verification case ``failed`` failed (and printed its row)."""
    plain = {case: _seal_row(*case, 1.0e-3, 1.02e-3) for case in SEAL_CASES}
    keyed = {case: _keyed_row(*case, 1.0e-3, 1.05e-3) for case in SEAL_CASES}
    keyed[("auto", "load", 256)] = _keyed_row("auto", "load", 256, 1.0e-3, 1.25e-3)
    if keyed_without is not None:
        del keyed[keyed_without]
    outcomes = dict.fromkeys(SEAL_CASES, "PASSED")
    verification_log = _seal_log(plain, {**outcomes, **({failed: "FAILED"} if failed else {})})
    keyed_log = _seal_log(keyed, outcomes, KEYED_CASE)
    return verification_log, keyed_log, verification_log + keyed_log


def test_a_log_with_both_kinds_gives_both_sections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each section reads only its own cases and rows: with both in the log, each says
    what it says with its own alone; the command prints both, verification first."""
    from triton_offload.bench.gpu_check import keyed_summary, main, verification_summary

    verification_log, keyed_log, both = _both_logs()
    verification, broken = verification_summary(both)
    assert not broken and verification == verification_summary(verification_log)[0]
    assert "; 12 of 12 rows meet the goal" in verification[-2]
    keyed, broken = keyed_summary(both)
    assert not broken and keyed == keyed_summary(keyed_log)[0]
    assert re.search(
        r"^  auto +load +256 KiB: ratio 0\.800 .*  BELOW GOAL$", "\n".join(keyed), re.M
    )
    assert keyed[-1].startswith("  ratio: lowest 0.800 (auto load 256 KiB), median 0.952; ")
    assert keyed[-1].endswith("; 11 of 12 rows meet the goal")
    log = tmp_path / "gpu-tests.log"
    log.write_text(both)
    assert main(["verification", str(log)]) == 0
    assert capsys.readouterr().out.splitlines() == verification + keyed


def test_a_broken_keyed_report_fails_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A passed keyed case without its row fails the command even when the verification
    section is sound (and the other way round)."""
    from triton_offload.bench.gpu_check import main

    log = tmp_path / "gpu-tests.log"
    log.write_text(_both_logs(keyed_without=("dma", "load", 8))[2])
    assert main(["verification", str(log)]) == 1
    out = capsys.readouterr().out
    assert (
        "REPORT BROKEN: case test_engine_keyed_cost_cuda[load-8KiB-dma] passed but printed" in out
    )
    assert out.count("REPORT BROKEN") == 1
    log.write_text(_both_logs(failed=("dma", "load", 8))[2])
    assert main(["verification", str(log)]) == 1
    out = capsys.readouterr().out
    assert "REPORT BROKEN: row dma load 8 KiB has no passed case" in out
    assert out.count("REPORT BROKEN") == 1
