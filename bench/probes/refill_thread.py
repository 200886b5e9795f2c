"""The engine's refill thread (``defaults.refill_thread``) on and off, alternated, in the same run.

    python3 bench/probes/refill_thread.py                          # 1 GiB file, 100k reads, 5 rounds
    python3 bench/probes/refill_thread.py --rounds 10 --dir /nvme --busy-ms 1 --work-ms 5

Each round runs every workload with ``AIONVME_REFILL_THREAD=1`` and ``=0``, each in its own
process, in a random order:

- ``gather``: the ``randread`` workload's gather mode (64 tasks, one 4 KiB read each at a
  time, uvloop). Every read is wholly in flight once submitted, so its completions wake the
  loop directly with or without the thread: the ratio shows what the thread costs there.
- ``batch``: its batch mode (4 tasks, each awaiting ``pread_many`` of 256 reads through a
  ``Handle(queue_depth=64)``, uvloop): the refill between a batch's completions.
- ``batch+busy``: the same batches while another task on the loop runs ``--busy-ms`` of
  Python at a time (a training step's or a decoder's work between awaits).
- ``loader+gil``: a blocking ``aionvme.data.Loader`` epoch over 4 KiB samples (batch 1024,
  reading on the process's background loop) whose consumer holds the GIL for ``--work-ms``
  per batch, as a Python training step does; the page cache is dropped first where root.

Printed: each workload's median rate with the thread and without, and the ratio paired
within rounds (geometric mean, 95% interval, range).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

from aionvme.bench import make_file
from aionvme.defaults import parse_size

# the paired-ratio summary of the suites' tables, from its suite (this probe runs from bench/probes/)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "suites"))
from seqwrite_alternated import _summary

CHILD = r"""
import asyncio, json, sys, time
mode, path, ops, ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if mode == "loader+gil":
    from aionvme import data
    from aionvme.bench.system import drop_caches
    ds = data.Dataset(path)
    loader = data.Loader(ds, batch_size=1024, shuffle=True, seed=0, prefetch=64 << 20, tensors="numpy")
    drop_caches()
    t0, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["x"])
        t = time.perf_counter()
        while time.perf_counter() - t < ms / 1e3:  # the consumer's step: Python, holding the GIL
            pass
    wall = time.perf_counter() - t0
    if n != len(ds):
        sys.exit(f"loader: {n} samples of {len(ds)}")
    print(json.dumps({"rate": n / wall}))
    sys.exit(0)
import uvloop
import aionvme as nvme
from aionvme.bench import workloads as w
uvloop.install()
if mode in ("gather", "batch"):
    r = asyncio.run(w.randread(path, ops=ops, iodepth=64, mode=mode))
    if not r.verified:
        sys.exit("randread: data mismatch")
    print(json.dumps({"rate": r.ops / r.wall_s}))
    sys.exit(0)

async def busy_batches():
    offs = w.random_offsets(ops, __import__("os").path.getsize(path), 4096).tolist()
    batch, nw = 256, 4
    bufs = nvme.empty((nw * batch, 4096))
    stop = False

    async def busy():
        while not stop:
            t = time.perf_counter()
            while time.perf_counter() - t < ms / 1e3:
                pass
            await asyncio.sleep(0)

    with nvme.Handle(queue_depth=64) as h:
        async with nvme.open(path) as f:
            await h.pread(bufs[0], f, 0)

            async def worker(k):
                mine = bufs[k * batch : (k + 1) * batch]
                for i in range(k * batch, ops, nw * batch):
                    j = min(batch, ops - i)
                    await h.pread_many([(mine[x], offs[i + x]) for x in range(j)], f)

            other = asyncio.ensure_future(busy())
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(k) for k in range(nw)))
            wall = time.perf_counter() - t0
            stop = True
            await other
    return ops / wall

print(json.dumps({"rate": asyncio.run(busy_batches())}))
"""

WORKLOADS = ("gather", "batch", "batch+busy", "loader+gil")


def _dataset(path: str, n: int) -> None:
    import asyncio

    from aionvme import data
    from aionvme.bench.loader import sample_bytes

    try:
        if len(data.Dataset(path)) == n:
            return
    except (data.DatasetError, OSError):
        pass
    samples = ({"x": sample_bytes(i, 4096)} for i in range(n))
    asyncio.run(data.write_dataset(path, samples, shard_size=1 << 40, progress=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="the random-read file (1G)")
    ap.add_argument("--ops", type=int, default=100_000, help="4 KiB reads per run, and the loader's samples")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--busy-ms", type=float, default=1.0, help="batch+busy: Python per step of the other task"
    )
    ap.add_argument(
        "--work-ms", type=float, default=5.0, help="loader+gil: the consumer's GIL time per batch"
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    a = ap.parse_args(argv)
    names = [x for x in a.workloads.split(",") if x]
    bad = sorted(set(names) - set(WORKLOADS))
    if bad:
        ap.error(f"unknown workloads {bad}; known: {', '.join(WORKLOADS)}")
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = os.path.join(d, "refill.bin")
        make_file(path, parse_size(a.size))
        dspath = os.path.join(d, "refill-ds")
        if "loader+gil" in names:
            _dataset(dspath, a.ops)
        rates: dict[tuple[str, str], list[float]] = {}
        ratios: dict[str, list[float]] = {n: [] for n in names}
        for rnd in range(a.rounds):
            jobs = [(n, on) for n in names for on in ("1", "0")]
            random.shuffle(jobs)
            got: dict[tuple[str, str], float] = {}
            for n, on in jobs:
                target, ms = (dspath, a.work_ms) if n == "loader+gil" else (path, a.busy_ms)
                env = {**os.environ, "AIONVME_REFILL_THREAD": on}
                o = subprocess.run(
                    [sys.executable, "-c", CHILD, n, target, str(a.ops), str(ms)],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                if o.returncode:
                    print(
                        f"round {rnd}: {n} refill_thread={on} failed: {o.stderr.strip()[-800:]}",
                        file=sys.stderr,
                    )
                    continue
                got[(n, on)] = json.loads(o.stdout.strip().splitlines()[-1])["rate"]
                rates.setdefault((n, on), []).append(got[(n, on)])
            line = ", ".join(f"{n} {got.get((n, '1'), 0):,.0f}/{got.get((n, '0'), 0):,.0f}" for n in names)
            print(f"round {rnd + 1} (with/without): {line}", flush=True)
            for n in names:
                if (n, "1") in got and (n, "0") in got:
                    ratios[n].append(got[(n, "1")] / got[(n, "0")])
    print("\nworkload     with the thread  without  (median per second)  with / without, paired")
    for n in names:
        on, off = rates.get((n, "1"), [0.0]), rates.get((n, "0"), [0.0])
        print(
            f"{n:<12} {statistics.median(on):>14,.0f} {statistics.median(off):>9,.0f}  {_summary(ratios[n])}"
        )
    return 0 if all(ratios[n] for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
