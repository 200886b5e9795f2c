"""What the subcommands share besides the bench package: a progress
display, and the checks of their arguments (made before any work: a bad
value is one line on stderr and exit status 2, argparse's way)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from aionvme.bench.render import fit, human_bytes, terminal_width

__all__ = [
    "Progress",
    "count",
    "fit",
    "human_bytes",
    "need_directory",
    "need_matplotlib",
    "size",
    "terminal_width",
]


def size(minimum: int = 1) -> Callable[[str], str]:
    """An argparse ``type`` for a size (``4096``, ``64K``, ``1G``) of at
    least ``minimum`` bytes; the text is kept as given."""

    def check(text: str) -> str:
        from aionvme.defaults import parse_size

        try:
            n = parse_size(text)
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a size (like 4096, 64K, 1G)") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {minimum} byte(s)")
        return text

    return check


def count(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer of at least ``minimum``."""

    def check(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {minimum}")
        return n

    return check


def need_directory(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """parser.error unless path (when given) is an existing directory."""
    if path is not None and not os.path.isdir(path):
        why = "does not exist" if not os.path.exists(path) else "is not a directory"
        parser.error(f"{option} {path}: {why}")


def need_matplotlib(parser: argparse.ArgumentParser) -> None:
    """parser.error if --plot cannot be drawn: said before the sweep, not after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("--plot needs matplotlib (pip install 'aionvme[plot]')")


class Progress:
    """Progress of staged runs on stderr: rich or tqdm bars when installed,
    else one line per finished run. ``quiet``: nothing at all."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self._rich: Any = None
        self._tqdm: Any = None
        self._bar: Any = None
        self._task: Any = None
        self._n = self._total = 0
        if quiet:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._rich = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TextColumn("{task.fields[last]}"),
                console=Console(stderr=True),
                transient=True,
            )
        except ImportError:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm
            except ImportError:
                pass

    def __enter__(self) -> Progress:
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
        if self._bar is not None:
            self._bar.close()

    def stage(self, title: str, total: int, announce: bool = True) -> None:
        """A new stage of ``total`` runs (``announce``: its title printed to stdout too)."""
        self._n, self._total = 0, total
        if announce and not self.quiet:
            print(fit(title, terminal_width()), flush=True)
        if self._rich is not None:
            self._task = self._rich.add_task("", total=total, last="")
        elif self._tqdm is not None:
            if self._bar is not None:
                self._bar.close()
            self._bar = self._tqdm(total=total, leave=False, file=sys.stderr)

    def advance(self, msg: str) -> None:
        """One run finished; ``msg`` says what it measured."""
        self._n += 1
        if self.quiet:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=1, last=msg)
        elif self._bar is not None:
            self._bar.set_postfix_str(msg)
            self._bar.update(1)
        else:
            print(
                fit(f"  [{self._n}/{self._total}] {msg}", terminal_width(), "    "),
                file=sys.stderr,
                flush=True,
            )
