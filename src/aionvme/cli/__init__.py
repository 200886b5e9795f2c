"""The ``aionvme`` command: ``demo``, ``info``, ``bench``, ``tune``.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and
``run(args) -> int``; this module only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

__all__ = ["main"]

_COMMANDS = {
    "demo": "write tensors to a temp file, read them back, verify, print GB/s",
    "info": "what this machine offers: kernel AIO, O_DIRECT alignment, cuFile, limits",
    "bench": "run benchmark workloads by name (seq/rand reads and writes, many files, formats, GPU)",
    "tune": "sweep block size, queue depth and submit modes; write a config",
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, exit status 2
    (argparse's own print the whole usage first: 20 lines for ``bench``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _module(name: str) -> object:
    return importlib.import_module(f"aionvme.cli.{name}")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="aionvme", description="asyncio-native NVMe I/O for tensors")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    available = {}
    for name, help_text in _COMMANDS.items():
        try:
            mod = _module(name)
        except ModuleNotFoundError as e:
            if e.name != f"aionvme.cli.{name}":
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_parser(p)  # type: ignore[attr-defined]
        p.set_defaults(parser=p)  # run() checks what argparse cannot, with p.error, before any work
        available[name] = mod
    args = parser.parse_args(argv)
    if args.version:
        from aionvme import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        rc: int = available[args.command].run(args)  # type: ignore[attr-defined]
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
