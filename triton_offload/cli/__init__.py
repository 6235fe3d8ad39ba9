"""`triton-offload` console script: one module per command in this package.

Each sub-command (``bench``, ``verify``, ``plan``, ``info``, ``tier``) lives in its own module
exposing ``configure_parser(parser)`` and ``run(args) -> int``; ``args`` holds the
argument checks they share. This file only dispatches, so commands stay independent. Only
the command being run is configured: ``verify``'s flags come from modules that import
torch, and ``triton-offload plan`` (pure Python) must not pay for that.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import time
from collections.abc import Iterable, Sequence

from triton_offload.cli.args import OneLineErrorParser, UsageError

#: ``time.perf_counter()`` when the CLI was imported: in a ``triton-offload`` or
#: ``python -m triton_offload`` process, the earliest moment this program is known to run.
#: The process may be older: a shell that ran other commands can exec this one in its
#: own process (``bash -c "pip install ... && triton-offload bench"``).
CLI_IMPORTED_AT = time.perf_counter()

# sub-command -> (module, one-line help); each module has configure_parser and run.
_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("triton_offload.cli.bench", "measure transfer paths side by side"),
    "verify": ("triton_offload.cli.verify", "cold vs offload-hit equality on a hybrid model"),
    "plan": ("triton_offload.cli.plan", "print a model's offload plan as a table"),
    "info": ("triton_offload.cli.info", "versions and devices seen by this install"),
    "tier": (
        "triton_offload.cli.tier",
        "what an fs tier folder holds, every chunk's seal checked, refused files removed",
    ),
}


def _package_version() -> str:
    from triton_offload import __version__

    return __version__


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``triton-offload`` parser; ``commands``: the sub-commands whose flags are
    configured (default: all; the others still appear in ``--help``)."""
    from triton_offload.planner.presets import describe_presets

    configured = set(_COMMANDS) if commands is None else set(commands)
    parser = OneLineErrorParser(
        prog="triton-offload",
        description="KV-cache offloading backend: planner, data path, verification, benchmarks.",
        epilog="model presets (the same name means the same model in every command):\n"
        + describe_presets(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"triton-offload {_package_version()}"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in _COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name in configured:
            # Imported eagerly once asked for: a command missing from an install is a
            # packaging bug and must fail loudly, not vanish from --help.
            module = importlib.import_module(module_name)
            module.configure_parser(sub)
            sub.set_defaults(handler=module.run)
    return parser


def _requested_command(argv: Sequence[str]) -> str | None:
    """The sub-command named in ``argv`` (its first non-option word), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in _COMMANDS else None
    return None


#: Dependencies a command may find missing: how to install each. Triton is a
#: dependency of the package, but `pip install --no-deps -e .` beside an existing vLLM
#: (as the README says) installs none, and a CPU-only torch brings no triton.
_INSTALL_HINTS = {
    "triton": "pip install 'triton>=3.4' (beside vLLM: the triton release its torch pins)",
    "torch": "pip install torch==2.13.0 (or the torch your vLLM pins)",
}


def install_hint(package: str) -> str:
    """How to install ``package`` (``"triton"`` or ``"torch"``)."""
    return _INSTALL_HINTS[package]


def _missing_dependency(error: ModuleNotFoundError) -> str | None:
    """The top-level package of a missing dependency we can give a hint for, or None."""
    top = (error.name or "").split(".")[0]
    return top if top in _INSTALL_HINTS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _requested_command(argv)
    try:
        parser = build_parser(commands=[] if command is None else [command])
        args = parser.parse_args(argv)
        return int(args.handler(args))
    except UsageError as error:
        print(f"triton-offload {command}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        missing = _missing_dependency(error)
        if missing is None:
            raise
        print(
            f"triton-offload {command}: error: {command} needs {missing}, which does not "
            f"import here ({error}); install it: {_INSTALL_HINTS[missing]}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        # A Ctrl-C outside bench's and verify's own handling (parsing, plan, info):
        # nothing was written, and a traceback would only bury that line.
        prog = f"triton-offload {command}" if command else "triton-offload"
        print(f"{prog}: interrupted by SIGINT", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error of the command.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
