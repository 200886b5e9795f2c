"""``aionvme demo``: the main job in one command. Writes a set of tensors to a
temp file on the local disk with O_DIRECT, reads them back concurrently,
checks every byte and prints the throughput of each direction."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import time
from typing import Any

import numpy as np

from aionvme.bench import resolve_loop, run_loop, scratch_dir

from ._common import human_bytes


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="1G", help="total bytes to move (default 1G)")
    p.add_argument("--tensors", type=int, default=16, help="number of tensors (default 16)")
    p.add_argument("--dir", default=None, help="where to put the temp file (default: a local disk)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--torch", action="store_true", help="use torch tensors instead of numpy arrays")


def _how(info: Any) -> str:
    """How the file was opened, in words: the filesystem, O_DIRECT or
    buffered, and why it is buffered when it is."""
    if info.direct:
        return f"{info.fs_name}, O_DIRECT (the page cache is bypassed)"
    return f"{info.fs_name}, buffered I/O: {info.reason}"


async def _demo(args: argparse.Namespace, path: str) -> int:
    import aionvme as nvme
    from aionvme.defaults import parse_size

    total = parse_size(args.size)
    n = max(1, args.tensors)
    each = max(4096, total // n // 4096 * 4096)
    like = "torch" if args.torch else "numpy"
    rng = np.random.default_rng(12345)
    src = [nvme.empty(each, like=like) for _ in range(n)]
    for t in src:
        view = t.numpy() if like == "torch" else t
        view[:] = rng.integers(0, 256, size=each, dtype=np.uint8)
    digests = [hashlib.blake2b(memoryview(t.numpy() if like == "torch" else t)).digest() for t in src]

    async with nvme.open(path, "w+") as f:
        t0 = time.perf_counter()
        await asyncio.gather(*(f.pwrite(t, i * each) for i, t in enumerate(src)))
        await f.fsync()
        t_write = time.perf_counter() - t0
        info = f.info

        dst = [nvme.empty(each, like=like) for _ in range(n)]
        for t in dst:  # fault the pages in first: this times the I/O, not the VM's page faults
            (t.numpy() if like == "torch" else t)[::4096] = 1
        t0 = time.perf_counter()
        await asyncio.gather(*(f.pread(t, i * each) for i, t in enumerate(dst)))
        t_read = time.perf_counter() - t0

    bad = [
        i
        for i, t in enumerate(dst)
        if hashlib.blake2b(memoryview(t.numpy() if like == "torch" else t)).digest() != digests[i]
    ]
    moved = n * each
    print(f"file     {path}")
    print(f"I/O      {_how(info)}")
    print(f"tensors  {n} x {human_bytes(each)} = {human_bytes(moved)} ({like}, loop={args.loop})")
    print(f"write    {moved / t_write / 1e9:6.2f} GB/s  ({t_write:.3f} s, fsync included)")
    print(f"read     {moved / t_read / 1e9:6.2f} GB/s  ({t_read:.3f} s)")
    if bad:
        print(f"verify   FAILED: tensors {bad} differ")
        return 1
    print(f"verify   ok: all {moved} bytes match (blake2b per tensor)")
    return 0


def run(args: argparse.Namespace) -> int:
    args.loop = resolve_loop(args.loop)
    with scratch_dir(args.dir) as d:
        path = os.path.join(d, "demo.bin")
        return run_loop(_demo(args, path), args.loop)
