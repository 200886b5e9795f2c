"""The one renderer of benchmark results: plain-text tables that fit a
terminal width, JSON, and PNG plots (with matplotlib, when installed)."""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from .result import Result

__all__ = [
    "fit",
    "gpu_table",
    "human_bytes",
    "markdown_table",
    "num",
    "plot",
    "results_table",
    "table",
    "terminal_width",
    "to_json",
    "tune_table",
]

NA = "n/a"


def terminal_width(default: int = 80) -> int:
    """Columns of the terminal ($COLUMNS first; ``default`` when not a terminal), at least 40."""
    return max(40, shutil.get_terminal_size((default, 24)).columns)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def num(v: float | None) -> str:
    """A figure in at most 6 characters, 3 significant digits where it matters
    (1.23, 12.3, 1234, 12.3k, 1.23M); None is 'n/a'."""
    if v is None:
        return NA
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def fit(text: str, width: int | None = None, indent: str = "") -> str:
    """``text`` wrapped to ``width`` columns (later lines indented by ``indent``)."""
    width = width or terminal_width()
    return "\n".join(
        textwrap.fill(para, width, subsequent_indent=indent, break_on_hyphens=False) if para else ""
        for para in text.split("\n")
    )


def _cut(cell: str, w: int) -> str:
    return cell if len(cell) <= w else cell[: max(0, w - 1)] + "…"


def table(
    head: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    notes: Sequence[str] = (),
    width: int | None = None,
    left: int = 1,
) -> str:
    """A plain-text table no wider than ``width`` columns.

    The first ``left`` columns are text (left-aligned; the widest of them is
    cut with '…' when the table would be too wide), the rest figures
    (right-aligned). The title and the notes under the table are wrapped.
    """
    width = width or terminal_width()
    ncol = len(head)
    cells = [list(head)] + [[str(c) for c in r] + [""] * (ncol - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(ncol)]
    sep = 2 if sum(widths) + 2 * (ncol - 1) <= width else 1
    over = sum(widths) + sep * (ncol - 1) - width
    while over > 0 and left:
        i = max(range(left), key=lambda j: widths[j])
        floor = len(head[i])
        if widths[i] <= floor:
            break
        cut = min(over, widths[i] - floor)
        widths[i] -= cut
        over -= cut
    lines = []
    if title:
        lines.append(fit(title, width, "  "))
    for r in cells:
        parts = [
            _cut(c, w).ljust(w) if i < left else _cut(c, w).rjust(w)
            for i, (c, w) in enumerate(zip(r, widths))
        ]
        lines.append((" " * sep).join(parts).rstrip())
    lines += [fit(n, width, "  ") for n in notes]
    return "\n".join(lines)


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]], *, right: int = 1) -> str:
    """A Markdown table (for bench/README.md); columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


_RESULT_HEAD = ("workload", "MB/s", "IOPS", "CPU s/GiB", "CPU µs/op", "p50 µs", "p99 µs", "stall ms", "ok")


def _ok(r: Result) -> str:
    return "yes" if r.verified else "NO"


def results_table(results: Sequence[Result], title: str | None = None, width: int | None = None) -> str:
    """The table of ``aionvme bench``: one row per result; a workload that
    reports more (the formats' baselines) adds notes under the table, one
    that could not run says why there."""
    rows: list[list[str]] = []
    notes: list[str] = []
    for r in results:
        if r.skipped is not None:
            rows.append([r.label, "-", "-", "-", "-", "-", "-", "-", "skip"])
            notes.append(f"{r.label}: skipped: {r.skipped}")
            continue
        rows.append(
            [
                r.label,
                num(r.mb_s),
                num(r.iops) if r.ops else "-",
                f"{r.cpu_s_per_gib:.3f}" if r.nbytes else "-",
                num(r.cpu_us_per_op) if r.ops else "-",
                num(r.p50_us),
                num(r.p99_us),
                num(r.max_stall_s * 1e3),
                _ok(r),
            ]
        )
        notes += [f"{r.workload}: {n}" for n in r.notes]
    return table(_RESULT_HEAD, rows, title=title, notes=notes, width=width)


def gpu_table(results: Sequence[Result], title: str | None = None, width: int | None = None) -> str:
    """The table of ``aionvme bench --gpu``: GB/s per direction and way, and
    each way's ratio to the host way (pread into host memory + copy)."""
    host = {r.workload: r.gb_s for r in results if r.params.get("way") == "host" and r.skipped is None}
    rows: list[list[str]] = []
    notes: list[str] = []
    for r in results:
        direction = "NVMe->GPU" if r.workload == "gpu-read" else "GPU->NVMe"
        way = str(r.params.get("label", r.params.get("way", "")))
        if r.skipped is not None:
            rows.append([direction, way, "-", "-", "-", "skip"])
            notes.append(f"{direction} {way}: unavailable: {r.skipped}")
            continue
        base = host.get(r.workload)
        rows.append(
            [
                direction,
                way,
                f"{r.gb_s:.2f}",
                f"{r.gb_s / base:.2f}x" if base else "-",
                str(r.params.get("used", "")),
                _ok(r),
            ]
        )
    head = ("direction", "way", "GB/s", "vs host", "path used", "ok")
    return table(head, rows, title=title, notes=notes, width=width, left=2)


def to_json(results: Sequence[Result], **extra: Any) -> str:
    """``{**extra, "results": [result.to_dict(), ...]}`` as indented JSON."""
    return json.dumps({**extra, "results": [r.to_dict() for r in results]}, indent=2, default=str)


def plot(
    path: str,
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    bars: bool = False,
) -> str | None:
    """Write a PNG of ``series`` (name -> one value per category): lines over
    the categories, or horizontal grouped bars (``bars``). Returns None, or
    why no plot was written (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plotting needs matplotlib (pip install 'aionvme[plot]'); no plot written"
    cats = list(categories)
    if bars:
        fig, ax = plt.subplots(figsize=(10, max(3.0, 0.28 * len(cats) * max(1, len(series)) / 2 + 1)))
        ys = range(len(cats))
        h = 0.8 / max(1, len(series))
        for i, (name, vals) in enumerate(series.items()):
            ax.barh([y + (i - (len(series) - 1) / 2) * h for y in ys], list(vals), height=h, label=name)
        ax.set_yticks(list(ys), cats, fontsize=7)
        ax.set_xlabel(ylabel)
        ax.set_ylabel(xlabel)
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, vals in series.items():
            ax.plot(cats, list(vals), marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


_TUNE_HEAD = ("#", "block", "qd", "ipp", "submit", "events", "read GB/s", "write GB/s", "combined", "runs")


def tune_table(
    points: Sequence[Any], title: str | None = None, width: int | None = None, limit: int = 10
) -> str:
    """The table of ``aionvme tune``: :class:`~aionvme.bench.tune.Point` s, best first."""
    from .tune import size_label

    rows = []
    for i, p in enumerate(points[:limit], 1):
        k = p.knobs
        rows.append(
            [
                str(i),
                size_label(k.block_size),
                str(k.queue_depth),
                str(k.intra_op_parallelism or "all"),
                "single" if k.single_submit else "batch",
                "overlap" if k.overlap_events else "wait",
                f"{p.read:.2f}",
                f"{p.write:.2f}",
                f"{p.combined:.2f}",
                str(p.runs),
            ]
        )
    return table(_TUNE_HEAD, rows, title=title, width=width, left=0)
