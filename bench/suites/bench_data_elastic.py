#!/usr/bin/env python3
"""aionvme.data.Loader after an elastic resume, against fio random read at 128 KiB.

    python3 bench/suites/bench_data_elastic.py                     # 1 GiB of 128 KiB samples
    python3 bench/suites/bench_data_elastic.py --size 64M --repeat 1   # a smoke run
    python3 bench/suites/bench_data_elastic.py --json elastic.json --markdown elastic.md

The set-up (not timed): a dataset of 128 KiB samples in one shard (bench_loader.py's),
then --from-world ranks (4) of a shuffled epoch, batch 64, each stopping after its own
number of batches (rank r after (r + 1) / (2 * A) of its part: ranks progress unevenly),
their states merged by aionvme.data.merge_states. Timed: rank 0 of --to-world (1: it
reads the whole rest of the epoch) loads the merged state and reads to the epoch's end,
with ``async for`` (uvloop) and plain ``for``; and fio randread bs=128k QD 64 over the
shard, the page cache dropped before every run, each tool once per round in turn
(medians of --repeat rounds). Every sample handed out is checked: each begins with its
index; the resumed pass must hand out exactly the samples no rank consumed (its part of
them when --to-world > 1).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aionvme as nvme
import bench_loader as bl
from aionvme.bench import drop_caches
from aionvme.defaults import parse_size

S = 128 << 10
BATCH = 64


def stop_ranks(path: str, n: int, world: int, prefetch: str) -> tuple[dict[str, Any], np.ndarray]:
    """``world`` ranks each hand out their share of batches; their merged state and the ids consumed."""
    states, consumed = [], []
    for r in range(world):
        ld = nvme.data.Loader(
            path, batch_size=BATCH, shuffle=True, seed=0, rank=r, world_size=world, prefetch=prefetch
        )
        stop = max(1, len(ld) * (r + 1) // (2 * world))
        for k, b in enumerate(ld, 1):
            consumed += bl.ids_of(b["x"])
            if k == stop:
                break
        states.append(ld.state_dict())
        ld.close()
    return nvme.data.merge_states(states), np.array(consumed, dtype=np.int64)


def resumed_pass(
    path: str, n: int, state: dict[str, Any], world: int, prefetch: str, mode: str, want: np.ndarray
) -> dict[str, Any]:
    seen = np.zeros(n, dtype=np.int32)
    drop_caches()
    loader = nvme.data.Loader(
        path, batch_size=BATCH, shuffle=True, seed=0, rank=0, world_size=world, prefetch=prefetch
    )
    loader.load_state_dict(state)
    gc.collect()
    c0, t0 = bl.cpu_s(), time.perf_counter()
    if mode == "async":

        async def main() -> None:
            async for b in loader:
                np.add.at(seen, bl.ids_of(b["x"]), 1)
            await loader.aclose()

        try:
            import uvloop

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())
    else:
        for b in loader:
            np.add.at(seen, bl.ids_of(b["x"]), 1)
        loader.close()
    wall = time.perf_counter() - t0
    cpu = bl.cpu_s() - c0
    st = loader.stats()
    got = int(seen.sum())
    return {
        "wall_s": wall,
        "MB_s": st["bytes"] / wall / 1e6,
        "samples_s": got / wall,
        "cpu_us_per_sample": cpu / max(got, 1) * 1e6,
        "samples": got,
        # exactly the samples wanted, each once (rank 0 of a larger world: its part of them)
        "ok": bool(np.array_equal(seen, want)),
    }


def expected(n: int, consumed: np.ndarray, state: dict[str, Any], world: int) -> np.ndarray:
    """How often each sample should arrive in rank 0's resumed pass, from the ids
    consumed (not from the merged state): the rest in the epoch's order, rank 0's part."""
    order = nvme.data.epoch_order(n, 0, int(state["epoch"]), True)
    rest = order[~np.isin(order, consumed)]
    part = nvme.data.rank_part(rest, 0, world, False)
    want = np.zeros(n, dtype=np.int32)
    np.add.at(want, part, 1)
    return want


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--size", default="1G", help="bytes of 128 KiB samples")
    ap.add_argument("--prefetch", default="256M", help="the loader's prefetch budget")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (medians)")
    ap.add_argument("--from-world", type=int, default=4, help="ranks that stop unevenly")
    ap.add_argument("--to-world", type=int, default=1, help="the world size resumed at (rank 0 is timed)")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed")
    size = parse_size(args.size)
    root = tempfile.mkdtemp(prefix="aionvme-elastic-", dir=args.dir)
    try:
        n = size // S
        path = os.path.join(root, "ds128k")
        nvme.data.sync_write_dataset(path, ({"x": bl.sample(i, S)} for i in range(n)), shard_size=size * 2)
        shard = os.path.join(path, "shard-00000.bin")
        state, consumed = stop_ranks(path, n, args.from_world, args.prefetch)
        want = expected(n, consumed, state, args.to_world)
        if not want.any():
            raise SystemExit(f"--size {args.size}: the ranks consumed the whole epoch; give more samples")
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.repeat):
            drop_caches()
            f = bl.fio(shard, "128k", 64, os.path.getsize(shard))
            runs.setdefault("fio", []).append({"MB_s": f["MB_s"], "samples_s": f["iops"], "ok": True})
            for mode in ("async", "sync"):
                r = resumed_pass(path, n, state, args.to_world, args.prefetch, mode, want)
                runs.setdefault(mode, []).append(r)
        med = {k: bl.median_run(v) for k, v in runs.items()}
        ref = med["fio"]["MB_s"]
        rows = [
            dict(med["fio"], tool="fio randread bs=128k QD 64", vs_fio=1.0),
            dict(
                med["async"], tool="aionvme Loader async (uvloop), resumed", vs_fio=med["async"]["MB_s"] / ref
            ),
            dict(med["sync"], tool="aionvme Loader sync for, resumed", vs_fio=med["sync"]["MB_s"] / ref),
        ]
        head = (
            f"{time.strftime('%Y-%m-%d')}, {platform.node()}: {os.cpu_count()} CPUs, "
            f"kernel {platform.release()}, "
            f"{size >> 20} MiB of 128 KiB samples, batch {BATCH}, prefetch {args.prefetch}; "
            f"{args.from_world} ranks stopped unevenly ({len(consumed)} of {n} samples consumed), "
            f"resumed at world size {args.to_world} (rank 0 timed); medians of {args.repeat} rounds"
        )
        lines = [
            head,
            "",
            "| reader | MB/s | samples/s | vs fio | CPU µs/sample | ok |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            cpu = f"{r['cpu_us_per_sample']:.1f}" if "cpu_us_per_sample" in r else ""
            lines.append(
                f"| {r['tool']} | {r['MB_s']:,.0f} | {r['samples_s']:,.0f} | "
                f"{r['vs_fio']:.2f}x | {cpu} | {r['ok']} |"
            )
        text = "\n".join(lines)
        print(text)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write(text + "\n")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        if not all(r["ok"] for r in rows):
            raise SystemExit("a resumed pass did not hand out exactly the rest of the epoch")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
