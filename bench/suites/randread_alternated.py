"""4 KiB random reads, gather, batch and rows on both loops, each round between two fio runs.

    python3 bench/suites/randread_alternated.py                      # 1 GiB file, 100k reads, 5 rounds
    python3 bench/suites/randread_alternated.py --rounds 3 --ops 50000 --dir /nvme
    python3 bench/suites/randread_alternated.py --fio-engine io_uring          # issue 17's reference

fio's IOPS on the VM of bench/README.md move 70-85k between runs minutes apart,
so a ratio against one fio run taken elsewhere in a long comparison is noisy.
Here every round runs fio (libaio, or --fio-engine io_uring; 4 KiB, QD 64, O_DIRECT), then aionvme's
``randread`` workload in each mode and loop (each in its own process, as a user
would run it), then fio again; each of ours is divided by the mean of the two
fio runs around it. Printed: median ratio (and range), median CPU per read (all
threads of the process, over the timed reads; user + system) next to fio's own, worst
loop stall (the longest of aionvme's loop callbacks, with the tasks they wake: the
workload's `Timer(stalls="reactor")`, which does not wake the loop as a 1 ms timer would).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from aionvme.bench import make_file
from aionvme.bench.peers import fio, fio_unavailable
from aionvme.defaults import parse_size

CHILD = r"""
import asyncio, json, sys
from aionvme.bench import workloads as w
if sys.argv[2] == "uvloop":
    import uvloop
    uvloop.install()
r = asyncio.run(w.randread(sys.argv[1], ops=int(sys.argv[4]), iodepth=64, mode=sys.argv[3]))
user, system = r.user_s / r.ops * 1e6, r.sys_s / r.ops * 1e6  # the timed reads only, all threads
print(json.dumps({"iops": r.ops / r.wall_s, "cpu_us": user + system, "user_us": user, "sys_us": system,
                  "stall_ms": (r.max_stall_s or 0.0) * 1e3}))
"""

MODES = [(lp, m) for lp in ("uvloop", "asyncio") for m in ("gather", "batch", "rows")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the test file goes (default: a local temp dir)")
    ap.add_argument("--fio-engine", default="libaio", choices=("libaio", "io_uring"), help="fio's ioengine")
    a = ap.parse_args(argv)
    why = fio_unavailable()
    if why is not None:
        print(f"fio is needed: {why}")
        return 1
    size = parse_size(a.size)
    d = tempfile.mkdtemp(prefix="aionvme-randread-", dir=a.dir)
    path = os.path.join(d, "randread.bin")
    make_file(path, size)
    res: dict[str, list[dict[str, float]]] = {f"{lp} {m}": [] for lp, m in MODES}
    fios: list[tuple[float, float]] = []  # fio's (user, sys) µs per read
    try:
        for _ in range(a.rounds):
            fb = fio(path, "randread", "4k", 64, a.fio_engine, size, number_ios=a.ops, norandommap=1)
            before = fb.iops
            ours = {}
            for lp, m in MODES:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, path, lp, m, str(a.ops)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                ours[f"{lp} {m}"] = json.loads(out.strip().splitlines()[-1])
            fa = fio(path, "randread", "4k", 64, a.fio_engine, size, number_ios=a.ops, norandommap=1)
            after = fa.iops
            fios += [(r.user_s / r.ops * 1e6, r.sys_s / r.ops * 1e6) for r in (fb, fa)]
            ref = (before + after) / 2
            for k, r in ours.items():
                res[k].append({**r, "ratio": r["iops"] / ref})
            print(
                f"fio {before:,.0f} / {after:,.0f} IOPS; "
                + "; ".join(f"{k} {r['iops'] / ref:.2f}x" for k, r in ours.items())
            )
    finally:
        os.unlink(path)
        os.rmdir(d)
    print(
        f"\n| {a.rounds} rounds | IOPS vs fio {a.fio_engine} (median, range) "
        "| CPU per read (user + sys) | worst loop stall |"
    )
    print("|---|---:|---:|---:|")
    for k, rs in res.items():
        ratios = [r["ratio"] for r in rs]
        cpu = statistics.median(r["cpu_us"] for r in rs)
        user = statistics.median(r["user_us"] for r in rs)
        system = statistics.median(r["sys_us"] for r in rs)
        stall = max(r["stall_ms"] for r in rs)
        print(
            f"| {k} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {cpu:.1f} µs ({user:.1f} + {system:.1f}) | {stall:.1f} ms |"
        )
    fu = statistics.median(u for u, _ in fios)
    fs = statistics.median(x for _, x in fios)
    n = len(fios)
    print(f"| fio {a.fio_engine} (its {n} runs) | 1.00x | {fu + fs:.1f} µs ({fu:.1f} + {fs:.1f}) | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
