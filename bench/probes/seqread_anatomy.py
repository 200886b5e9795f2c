#!/usr/bin/env python3
"""Why one sequential reader beats another: A/B of aionvme and DeepSpeed's
``aio_handle`` reading a whole file into one buffer, cold cache, each run in
a fresh process, arms alternating round after round.

    python3 bench/probes/seqread_anatomy.py --rounds 8               # the default arms
    python3 bench/probes/seqread_anatomy.py --arm "ours AIONVME_INFLIGHT_BYTES=256M" \\
        --arm "ds 1M 128 1 locked"
    python3 bench/probes/seqread_anatomy.py --strace --rounds 1      # io_submit shapes instead of speed

An arm is ``ours [buffer=thp|4k|mlock] [request=SIZE] [ENV=VALUE ...]`` (aionvme's
``pread`` of the whole file as one request, or as requests of SIZE, into a
page-aligned buffer: ``thp`` = ``aionvme.empty`` (MADV_HUGEPAGE), ``4k`` = an
anonymous mapping without it, ``mlock`` = the same mlocked, like DeepSpeed's
``new_cpu_locked_tensor``; ``AIONVME_*`` settings in the environment) or
``ds BS QD IOP locked|plain`` (DeepSpeed's own op, see aionvme.bench.peers).

For each arm: MB/s (median, min-max over rounds), and what the device saw
during the timed part (``/sys/dev/block/*/stat``: requests, KiB per request,
merges, average queue), plus each arm's per-round ratio to the first arm.
With ``--strace``: io_submit calls, iocbs per call and bytes per iocb
(strace slows the run: its speed is not reported). With ``--blk``: the
requests issued to the file's sectors and their mean size (reliable); the
in-device and waiting counts pair issue and completion events by order and
over-count when events are lost or requests split: read them as rough.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

import numpy as np

from aionvme import bench as B
from aionvme.bench import peers, render
from aionvme.defaults import parse_size

DEFAULT_ARMS = [
    "ds 1M 128 1 locked",
    "ours",
    "ours buffer=mlock",
    "ours buffer=4k",
    "ours AIONVME_INFLIGHT_BYTES=256M AIONVME_SUBMIT_BUDGET=64M",
    "ours AIONVME_BLOCK_SIZE=4M AIONVME_INFLIGHT_BYTES=256M AIONVME_SUBMIT_BUDGET=64M",
]


def _buffer(kind: str, size: int) -> tuple[np.ndarray, Any]:
    if kind == "thp":
        a = B.touched_buffers(size, size)[0]
        return a, None
    m = mmap.mmap(-1, size)
    a = np.frombuffer(m, dtype=np.uint8)
    if kind == "mlock":
        libc = ctypes.CDLL(None, use_errno=True)
        addr = ctypes.c_void_p(a.ctypes.data)
        if libc.mlock(addr, ctypes.c_size_t(size)) != 0:
            raise OSError(ctypes.get_errno(), "mlock failed")
    else:
        a[::4096] = 1
    return a, m


def child(spec: dict[str, Any]) -> None:
    """One aionvme run in this (fresh) process; prints ``RES {json}``."""
    path, size = spec["path"], os.path.getsize(spec["path"])
    buf, keep = _buffer(spec["buffer"], size)
    req = spec.get("request") or size
    bufs = [buf[o : o + req] for o in range(0, size, req)]

    async def run() -> B.Result:
        B.drop_caches()
        before = peers.disk_stats(path)
        r = await B.seqread(path, request_size=req, buffers=bufs)
        r.figures.update(peers.disk_figures(before, peers.disk_stats(path), r.wall_s))
        return r

    r = B.run_loop(run(), "uvloop")
    print("RES " + json.dumps(r.to_dict()), flush=True)
    del keep


def parse_arm(arm: str) -> dict[str, Any]:
    words = arm.split()
    if words[0] == "ds":
        bs, qd, iop, kind = words[1:5]
        return dict(kind="ds", point=(parse_size(bs), int(qd), int(iop)), buffer=kind)
    spec: dict[str, Any] = dict(kind="ours", buffer="thp", request=0, env={})
    for w in words[1:]:
        k, _, v = w.partition("=")
        if k == "buffer":
            spec["buffer"] = v
        elif k == "request":
            spec["request"] = parse_size(v)
        else:
            spec["env"][k] = v
    return spec


def run_arm(spec: dict[str, Any], path: str, strace: str | None) -> B.Result:
    wrap = ["strace", "-f", "-qq", "-s", "64", "-e", "trace=io_submit", "-o", strace] if strace else []
    if spec["kind"] == "ds":
        return peers.deepspeed_sweep(path, "read", [spec["point"]], (spec["buffer"],), wrap=wrap)[0]
    env = dict(os.environ, **spec["env"])
    cmd = [*wrap, sys.executable, __file__, "--child", json.dumps(dict(path=path, **spec))]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RES ")]
    if p.returncode or not lines:
        return B.Result.skip("seqread", f"child failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return B.Result.from_dict(json.loads(lines[-1][4:]))


def submit_shape(trace: str) -> str:
    """io_submit calls, iocbs per call and bytes per iocb from an strace log."""
    calls: Counter[int] = Counter()
    nbytes: Counter[int] = Counter()
    with open(trace) as f:
        for line in f:
            m = re.search(r"io_submit\(\w+, (\d+),", line)
            if m:
                calls[int(m.group(1))] += 1
                nbytes.update(int(x) for x in re.findall(r"aio_nbytes=(\d+)", line))
    n = sum(calls.values())
    iocbs = sum(k * v for k, v in calls.items())
    top = ", ".join(f"{k}x{v}" for k, v in calls.most_common(6))
    sizes = ", ".join(f"{render.human_bytes(k)}x{v}" for k, v in nbytes.most_common(4))
    per = iocbs / max(n, 1)
    return f"{n} io_submit calls, {iocbs} iocbs ({per:.1f}/call; nr x calls: {top}); iocb sizes: {sizes}"


# -- what reached the device: block-layer tracepoints, our file's sectors only --------------------------

TRACEFS = "/sys/kernel/tracing"


def file_extents(path: str) -> list[tuple[int, int]]:
    """[start, end) in 512-byte sectors of the file's extents (``filefrag -v``;
    a filesystem directly on the device, as here: no partition offset)."""
    out = subprocess.run(
        ["filefrag", "-v", "-b4096", path], capture_output=True, text=True, check=True
    ).stdout
    ext = []
    for m in re.finditer(r"^\s*\d+:\s+\d+\.\.\s*\d+:\s+(\d+)\.\.\s*(\d+):", out, re.M):
        ext.append((int(m.group(1)) * 8, (int(m.group(2)) + 1) * 8))
    return ext


class BlockTrace:
    """block_rq_insert/issue/complete in a private tracefs instance (root)."""

    def __init__(self) -> None:
        self.dir = os.path.join(TRACEFS, "instances", f"anatomy-{os.getpid()}")

    def __enter__(self) -> BlockTrace:
        if not os.path.isdir(os.path.join(TRACEFS, "instances")):
            subprocess.run(["mount", "-t", "tracefs", "nodev", TRACEFS], check=False)
        os.makedirs(self.dir, exist_ok=True)
        self._w("buffer_size_kb", "16384")
        for ev in ("block_rq_insert", "block_rq_issue", "block_rq_complete"):
            self._w(f"events/block/{ev}/enable", "1")
        self._w("trace", "")
        return self

    def _w(self, name: str, value: str) -> None:
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(value)

    def read(self) -> str:
        with open(os.path.join(self.dir, "trace")) as f:
            return f.read()

    def __exit__(self, *exc: object) -> None:
        with open(os.path.join(self.dir, "events/block/enable"), "w") as f:
            f.write("0")
        os.rmdir(self.dir)


def request_shape(trace: str, extents: list[tuple[int, int]]) -> dict[str, float]:
    """Requests to the file's sectors: how many, their sizes, how many were in
    the device at once (issue to complete) and how many waited in the scheduler."""
    import bisect

    starts = [a for a, _ in extents]

    def ours(sector: int) -> bool:
        i = bisect.bisect_right(starts, sector) - 1
        return i >= 0 and extents[i][0] <= sector < extents[i][1]

    pat = re.compile(r"\s(\d+\.\d+): (block_rq_\w+): \d+,\d+ (\S+)(?: \d+)? \(.*?\) (\d+) \+ (\d+)")
    events = []
    for line in trace.splitlines():
        m = pat.search(line)
        if m and "R" in m.group(3) and ours(int(m.group(4))):
            events.append((float(m.group(1)), m.group(2), int(m.group(4)), int(m.group(5))))
    issued = [e for e in events if e[1] == "block_rq_issue"]
    if not issued:
        return {}
    sizes = Counter(e[3] * 512 for e in issued)
    inflight = queued = peak = peak_q = 0
    area = 0.0
    t_prev = events[0][0]
    for t, kind, _, _ in sorted(events):
        area += inflight * (t - t_prev)
        t_prev = t
        if kind == "block_rq_insert":
            queued += 1
            peak_q = max(peak_q, queued)
        elif kind == "block_rq_issue":
            queued = max(0, queued - 1)
            inflight += 1
            peak = max(peak, inflight)
        else:
            inflight = max(0, inflight - 1)
    span = events[-1][0] - events[0][0]
    total = sum(e[3] * 512 for e in issued)
    out = {
        "requests": float(len(issued)),
        "mean_kib": total / len(issued) / 1024,
        "avg_in_device": area / span if span else 0.0,
        "peak_in_device": float(peak),
        "peak_waiting": float(peak_q),
        "inserted": float(sum(1 for e in events if e[1] == "block_rq_insert")),
    }
    for size, n in sizes.most_common(3):
        out[f"n_{size >> 10}KiB"] = float(n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--arm", action="append", default=None, help="an arm (repeatable); see above")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--strace", action="store_true", help="trace io_submit instead of timing")
    ap.add_argument(
        "--blk", action="store_true", help="also trace the block requests to the file (tracefs, root)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    arms = args.arm or DEFAULT_ARMS
    specs = [parse_arm(a) for a in arms]
    results: dict[str, list[B.Result]] = {a: [] for a in arms}
    with B.scratch_dir(args.dir) as d:
        path = os.path.join(d, "read.bin")
        B.make_file(path, parse_size(args.size))
        extents = file_extents(path) if args.blk else []
        for rnd in range(args.rounds):
            order = list(range(len(arms)))
            order = order[rnd % len(order) :] + order[: rnd % len(order)]  # rotate: no arm always first
            for i in order:
                trace = None
                if args.strace:
                    trace = tempfile.mktemp(prefix="anatomy-", suffix=".strace", dir=d)
                if args.blk:
                    with BlockTrace() as bt:
                        r = run_arm(specs[i], path, trace)
                        r.figures.update(
                            {f"blk_{k}": v for k, v in request_shape(bt.read(), extents).items()}
                        )
                else:
                    r = run_arm(specs[i], path, trace)
                results[arms[i]].append(r)
                if trace:
                    shape = submit_shape(trace) if os.path.exists(trace) else "no trace"
                    print(f"{arms[i]}: {shape}", flush=True)
                else:
                    print(
                        f"# round {rnd + 1} {arms[i]}: "
                        + (
                            r.skipped
                            or f"{r.mb_s:,.0f} MB/s "
                            + json.dumps({k: round(v, 1) for k, v in r.figures.items()})
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
    if args.strace:
        return 0
    first = results[arms[0]]
    rows = []
    for a in arms:
        rs = [r for r in results[a] if r.skipped is None]
        if not rs:
            rows.append([a, results[a][0].skipped or "?"] + [""] * 10)
            continue
        med, lo, hi = B.spread(r.mb_s for r in rs)
        ratios = [
            r.mb_s / f.mb_s
            for r, f in zip(results[a], first, strict=False)
            if r.skipped is None and f.skipped is None and f.mb_s
        ]
        rmed, rlo, rhi = B.spread(ratios)

        def fig(key: str, fmt: str, rs: list[B.Result] = rs) -> str:
            vals = [r.figures[key] for r in rs if key in r.figures]
            return format(B.median(vals), fmt) if vals else ""

        rows.append(
            [
                a,
                f"{med:,.0f} ({lo:,.0f}-{hi:,.0f})",
                f"{rmed:.2f}x ({rlo:.2f}-{rhi:.2f})",
                fig("dev_read_requests", ",.0f"),
                fig("dev_read_kib_per_request", ",.0f"),
                fig("dev_read_merges", ",.0f"),
                fig("dev_read_avg_queue", ".1f"),
                fig("blk_requests", ",.0f"),
                fig("blk_mean_kib", ",.0f"),
                fig("blk_avg_in_device", ".1f"),
                fig("blk_peak_in_device", ".0f"),
                fig("blk_peak_waiting", ".0f"),
            ]
        )
    head = (
        "arm",
        "MB/s median (min-max)",
        f"vs {arms[0]}",
        "dev requests",
        "dev KiB/req",
        "dev merges",
        "dev avg queue",
        "file requests",
        "file KiB/req",
        "avg in device",
        "peak in device",
        "peak waiting",
    )
    print(f"{args.rounds} rounds, {args.size} file, cold cache, each run a fresh process\n")
    print(render.markdown_table(head, rows, right=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({a: [r.to_dict() for r in rs] for a, rs in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
