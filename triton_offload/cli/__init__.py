"""`triton-offload` console script: one module per command in this package.

Each sub-command (``bench``, ``verify``, ``plan``, ``info``) lives in its own module
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
from collections.abc import Iterable, Sequence

from triton_offload.cli.args import OneLineErrorParser, UsageError

# sub-command -> (module, one-line help); each module has configure_parser and run.
_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("triton_offload.cli.bench", "measure transfer paths side by side"),
    "verify": ("triton_offload.cli.verify", "cold vs offload-hit equality on a hybrid model"),
    "plan": ("triton_offload.cli.plan", "print a model's offload plan as a table"),
    "info": ("triton_offload.cli.info", "versions and devices seen by this install"),
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _requested_command(argv)
    parser = build_parser(commands=[] if command is None else [command])
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except UsageError as error:
        print(f"triton-offload {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error of the command.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
