"""What the subcommands share besides the bench package: a progress display."""

from __future__ import annotations

import sys
from typing import Any

from aionvme.bench.render import fit, human_bytes, terminal_width

__all__ = ["Progress", "fit", "human_bytes", "terminal_width"]


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
