"""``aionvme demo``: the main job in one command. Writes a set of tensors to a
temp file on the local disk with O_DIRECT, reads them back concurrently,
checks every byte and prints the throughput of each direction. Memory is
bounded: the tensors stream through a small pool of reused buffers."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import time
from typing import Any

import numpy as np

from aionvme.bench import resolve_loop, run_loop, scratch_dir

from ._common import count, human_bytes, need_directory, size


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="1G", type=size(), help="total bytes to move (default 1G)")
    p.add_argument("--tensors", type=count(1), default=16, help="number of tensors (default 16)")
    p.add_argument("--dir", default=None, help="where to put the temp file (default: a local disk)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--torch", action="store_true", help="use torch tensors instead of numpy arrays")


def _how(info: Any) -> str:
    """How the file was opened, in words: the filesystem, O_DIRECT or
    buffered, and why it is buffered when it is."""
    if info.direct:
        return f"{info.fs_name}, O_DIRECT (the page cache is bypassed)"
    return f"{info.fs_name}, buffered I/O: {info.reason}"


# The data moves through a pool of DEPTH buffers of PIECE bytes, each reused
# as soon as its transfer ends: memory stays at DEPTH x PIECE whatever --size
# is (all of --size at once peaked at 2.1 GB of RSS for 1 GiB), while
# DEPTH x PIECE = 256 MiB in flight is more than the engine keeps in flight
# (queue_depth x block_size = 128 MiB by default), so the device never waits.
PIECE = 32 << 20
DEPTH = 8
_PAGE_WORDS = 4096 // 8  # the stamp: the file offset, in the first 8 bytes of every 4 KiB page


def _stamp(words: np.ndarray[Any, Any], off: int) -> None:
    """Make a piece unique to its place in the file: every page starts with its offset."""
    words[::_PAGE_WORDS] = np.arange(off, off + words.size * 8, 4096, dtype=np.uint64)


async def _demo(args: argparse.Namespace, path: str) -> int:
    import aionvme as nvme
    from aionvme.defaults import parse_size

    total = parse_size(args.size)
    n = args.tensors
    each = max(4096, total // n // 4096 * 4096)
    piece = min(each, PIECE)
    pieces = [(i * each + o, min(piece, each - o)) for i in range(n) for o in range(0, each, piece)]
    depth = min(DEPTH, len(pieces))
    like = "torch" if args.torch else "numpy"
    base = np.random.default_rng(12345).integers(0, 256, size=piece, dtype=np.uint8)
    base_words = base.view(np.uint64)
    pool = [nvme.empty(piece, like=like) for _ in range(depth)]
    views: list[np.ndarray[Any, Any]] = [t.numpy() if like == "torch" else t for t in pool]
    for v in views:
        v[:] = base  # faults the pages in: this times the I/O, not the VM's page faults
    free: asyncio.Queue[int] = asyncio.Queue()
    for k in range(depth):
        free.put_nowait(k)
    bad: set[int] = set()

    async def write(f: Any, off: int, size: int) -> None:
        k = await free.get()
        try:
            _stamp(views[k][:size].view(np.uint64), off)
            await f.pwrite(pool[k][:size], off)
        finally:
            free.put_nowait(k)

    def check(k: int, off: int, size: int) -> None:
        """Compare a piece that landed with what was written, then zero it
        (what a read that does not land leaves: never the expected bytes).
        On a worker thread: numpy's compare and fill release the GIL, so the
        check overlaps the reads still in flight."""
        got = views[k][:size]
        words = got.view(np.uint64)
        stamps = words[::_PAGE_WORDS].copy()
        _stamp(words, off)
        same = np.array_equal(words[::_PAGE_WORDS], stamps)
        words[::_PAGE_WORDS] = base_words[: words.size : _PAGE_WORDS]
        if not (same and np.array_equal(words, base_words[: words.size])):  # 8-byte words: 4x faster
            bad.add(off // each)
        got.fill(0)

    async def read(f: Any, off: int, size: int, checker: Any = None) -> None:
        k = await free.get()
        try:
            await f.pread(pool[k][:size], off)
            if checker is not None:
                await loop.run_in_executor(checker, check, k, off, size)
        finally:
            free.put_nowait(k)

    async with nvme.open(path, "w+") as f:
        t0 = time.perf_counter()
        await asyncio.gather(*(write(f, off, size) for off, size in pieces))
        await f.fsync()
        t_write = time.perf_counter() - t0
        info = f.info
        # Timed: the reads alone, as fio times them (on 2 busy cores, checking
        # as they land cost 10-20% of the figure). Then every byte is read
        # again and checked, with the same calls, untimed.
        t0 = time.perf_counter()
        await asyncio.gather(*(read(f, off, size) for off, size in pieces))
        t_read = time.perf_counter() - t0
        for v in views:
            v.fill(0)
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="aionvme-demo-check") as checker:
            await asyncio.gather(*(read(f, off, size, checker) for off, size in pieces))

    moved = n * each
    print(f"file     {path}")
    print(f"I/O      {_how(info)}")
    print(f"tensors  {n} x {human_bytes(each)} = {human_bytes(moved)} ({like}, loop={args.loop})")
    print(
        f"memory   {depth} buffers of {human_bytes(piece)}, reused: "
        f"{human_bytes(depth * piece)} in flight at most"
    )
    print(f"write    {moved / t_write / 1e9:6.2f} GB/s  ({t_write:.3f} s, fsync included)")
    print(f"read     {moved / t_read / 1e9:6.2f} GB/s  ({t_read:.3f} s)")
    if bad:
        print(f"verify   FAILED: tensors {sorted(bad)} differ")
        return 1
    print(f"verify   ok: {moved} bytes read again, each 4 KiB page holds its own offset")
    return 0


def run(args: argparse.Namespace) -> int:
    need_directory(args.parser, "--dir", args.dir)
    args.loop = resolve_loop(args.loop)
    with scratch_dir(args.dir) as d:
        path = os.path.join(d, "demo.bin")
        return run_loop(_demo(args, path), args.loop)
