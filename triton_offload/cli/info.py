"""``triton-offload info``: versions and devices this install sees.

With ``--calibrate`` it also builds an ``auto`` engine on a hybrid layout and prints the
crossover the start-up calibration measured (CUDA only).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform

from triton_offload.transfer.selection import CALIBRATION_PAGES


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="also run the engine's start-up calibration on a hybrid layout (CUDA) and print it",
    )


def calibration_report() -> list[str]:
    """The calibration an ``auto`` engine would run, on a hybrid layout (for ``info``).

    Layout: 8 K/V planes of 4 KiB (attention, 16-token blocks at 8 KV heads x 128
    x bf16 / TP 4) and a Mamba group with a 1,536-byte conv and a 256 KiB SSM plane;
    one line per grid point (labelled by the blocks and planes its jobs moved) with both
    copiers' device and host times. Without CUDA there is nothing to measure and the
    line says so.
    """
    import torch

    if not torch.cuda.is_available():
        return ["not run: needs CUDA (without it every job takes the CPU path)"]
    from triton_offload.planner import GroupSpec, plan_offload
    from triton_offload.transfer.engine import TransferEngine

    blocks = max(CALIBRATION_PAGES) + 8
    plan = plan_offload(
        [GroupSpec("full_attention", 16), GroupSpec("mamba", 16, mamba_cache_mode="align")],
        blocks_per_chunk=1,
    )
    kv = [torch.zeros(2, blocks, 4096, dtype=torch.uint8, device="cuda") for _ in range(4)]
    conv = torch.zeros(blocks, 1536, dtype=torch.uint8, device="cuda")
    ssm = torch.zeros(blocks, 256 << 10, dtype=torch.uint8, device="cuda")
    caches = [[(t[0], t[1]) for t in kv], [(conv, ssm)]]
    engine = TransferEngine(plan, caches, 2 * blocks, backend="auto")
    try:
        assert engine.crossover is not None  # an auto engine on CUDA calibrates
        gate = (
            f"device time only: each job's lane held by a {engine.crossover.gate_cycles}-cycle "
            "spin "
            "until the job was enqueued; host time (prepare + enqueue) in brackets"
        )
        return [*engine.crossover.describe(), gate]
    finally:
        engine.shutdown()


def _version_or_problem(name: str) -> str:
    """The imported package's version, or why it does not import and how to install it:
    ``info`` is the diagnostic, so a missing dependency is a line of its report, never
    the end of it."""
    from triton_offload.cli import install_hint

    try:
        module = importlib.import_module(name)
    except ImportError as error:
        return f"not importable ({error}); install: {install_hint(name)}"
    return str(getattr(module, "__version__", "unknown"))


def run(args: argparse.Namespace) -> int:
    from triton_offload import __version__

    print(f"triton_offload  {__version__}")
    print(f"python          {platform.python_version()}")
    torch_version = _version_or_problem("torch")
    print(f"torch           {torch_version}")
    print(f"triton          {_version_or_problem('triton')}")
    if torch_version.startswith("not importable"):
        return 1  # nothing below runs without torch (the line above says how to get it)
    import torch

    cuda = torch.cuda.is_available()
    print(f"cuda available  {cuda}")
    if cuda:
        from triton_offload.transfer.batch_copy import find_batch_copy

        print(f"gpu             {torch.cuda.get_device_name()}")
        print(f"cuda runtime    {torch.version.cuda}")
        print(f"dma path        {find_batch_copy()[1]}")
    if getattr(args, "calibrate", False):
        for line in calibration_report():
            print(f"calibration     {line}")
    # The version from the distribution's metadata: importing vllm takes seconds and
    # only triton_offload.vllm may import it.
    try:
        print(f"vllm            {importlib.metadata.version('vllm')}")
    except importlib.metadata.PackageNotFoundError:
        print("vllm            not installed")
    return 0
