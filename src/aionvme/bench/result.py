"""The one result type of every benchmark, and the one way to take medians."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

__all__ = ["Result", "median", "median_result", "spread"]


def median(values: Iterable[float]) -> float:
    """The median of ``values`` (0.0 for none): every median in the benchmarks is this one."""
    xs = list(values)
    return float(statistics.median(xs)) if xs else 0.0


def spread(values: Iterable[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``; (0, 0, 0) for none."""
    xs = list(values)
    return (median(xs), min(xs), max(xs)) if xs else (0.0, 0.0, 0.0)


@dataclass
class Result:
    """What one run of a workload measured.

    Attributes
    ----------
    workload : str
        The workload's name (``seqread``, ``safetensors``, ``gpu-read``, ...).
    nbytes, ops : int
        Bytes and operations moved in ``wall_s`` (``ops`` 0: not counted in operations).
    wall_s, cpu_s, user_s, sys_s : float
        Wall-clock and CPU time (user + system, of the whole process) of the timed part.
    max_stall_s : float
        The longest the event loop was late while the workload ran (see :class:`~aionvme.bench.StallMonitor`).
    verified : bool
        Whether the data read back was checked and right.
    latencies_s : list of float
        Per-operation latencies, when the workload measures them (not kept by medians).
    p50_us, p99_us : float or None
        Latency percentiles; None when not measured (shown as "n/a").
    params : dict
        How the workload ran (sizes, modes, the way a GPU transfer took...).
    figures : dict of str to float
        Further named figures (a format workload's baseline times and ratios...).
    notes : list of str
        Sentences for the reader, printed under the table.
    skipped : str or None
        Why the workload could not run here (then nothing else is meaningful).
    runs : int
        How many runs this result is the median of.
    """

    workload: str
    nbytes: int = 0
    ops: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    user_s: float = 0.0
    sys_s: float = 0.0
    max_stall_s: float = 0.0
    verified: bool = True
    latencies_s: list[float] = field(default_factory=list, repr=False)
    p50_us: float | None = None
    p99_us: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    runs: int = 1

    def __post_init__(self) -> None:
        if self.latencies_s and self.p50_us is None:
            lat = np.asarray(self.latencies_s)
            self.p50_us = float(np.quantile(lat, 0.5) * 1e6)
            self.p99_us = float(np.quantile(lat, 0.99) * 1e6)

    @classmethod
    def skip(cls, workload: str, why: str, **params: Any) -> Result:
        """A result that says why ``workload`` could not run here."""
        return cls(workload, skipped=why, params=dict(params))

    @property
    def mb_s(self) -> float:
        return self.nbytes / self.wall_s / 1e6 if self.wall_s > 0 else 0.0

    @property
    def gb_s(self) -> float:
        return self.mb_s / 1e3

    @property
    def iops(self) -> float:
        return self.ops / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_s_per_gib(self) -> float:
        return self.cpu_s / (self.nbytes / 2**30) if self.nbytes else 0.0

    @property
    def cpu_us_per_op(self) -> float:
        return self.cpu_s / self.ops * 1e6 if self.ops else 0.0

    @property
    def label(self) -> str:
        """The row name in tables: the workload and the parameter that sets it apart."""
        p = self.params
        name = self.workload
        if p.get("mode"):
            name += f" ({p['mode']})"
        if p.get("misalign"):
            name += f" (+{p['misalign']} B)"
        if p.get("op"):
            name += f" {p['op']}"
        if p.get("way"):
            name += f" {p['way']}"
        return name

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: the fields (without the latency list) and the derived figures."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "latencies_s"}
        d["params"], d["figures"], d["notes"] = dict(self.params), dict(self.figures), list(self.notes)
        d.update(
            mb_s=round(self.mb_s, 1),
            iops=round(self.iops, 1),
            cpu_s_per_gib=round(self.cpu_s_per_gib, 4),
            cpu_us_per_op=round(self.cpu_us_per_op, 2),
            max_stall_ms=round(self.max_stall_s * 1e3, 3),
        )
        for k in ("p50_us", "p99_us"):
            if d[k] is not None:
                d[k] = round(d[k], 1)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Result:
        """The result :meth:`to_dict` described (derived figures are recomputed)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_MEDIAN_FIELDS = ("nbytes", "ops", "wall_s", "cpu_s", "user_s", "sys_s")


def median_result(results: Sequence[Result]) -> Result:
    """One result for several runs of the same workload: the median of each
    figure (wall time, CPU, latency percentiles, named figures), the worst
    stall, verified only if every run was, ``runs`` counted."""
    if not results:
        raise ValueError("median_result needs at least one result")
    first = results[0]
    if len(results) == 1:
        return first
    kept = [r for r in results if r.skipped is None]
    if not kept:
        return first
    out = Result(first.workload, params=dict(first.params), notes=list(first.notes), runs=len(kept))
    for name in _MEDIAN_FIELDS:
        v = median(getattr(r, name) for r in kept)
        setattr(out, name, round(v) if name in ("nbytes", "ops") else v)
    out.max_stall_s = max(r.max_stall_s for r in kept)
    out.verified = all(r.verified for r in kept)
    for q in ("p50_us", "p99_us"):
        vals = [getattr(r, q) for r in kept]
        setattr(out, q, None if any(v is None for v in vals) else median(v for v in vals if v is not None))
    for k in first.figures:
        out.figures[k] = median(r.figures[k] for r in kept if k in r.figures)
    return out
