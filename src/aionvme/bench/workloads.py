"""I/O workloads: each makes (or reuses) its files, runs on the running
event loop, verifies what it read and returns a :class:`~aionvme.bench.Result`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from typing import Any

import numpy as np

from .. import Handle, defaults, empty, gpu, stats
from .. import open as nvme_open
from .. import pread as nvme_pread
from .pattern import SEED, check_pattern, fill_pattern, holds_pattern, make_file, touched_buffers
from .result import Result
from .timer import Timer

__all__ = ["GPU_WAYS", "gpu_read", "gpu_write", "manyfiles", "randread", "randwrite", "seqread", "seqwrite"]


def _runtime_ready() -> None:
    """Make the running loop's runtime (engine, eventfd) before the clock
    starts, and run the full collection the set-up owes: in a process that
    imported torch (~170k objects) the interpreter's first full collection
    after the imports took 100-200 ms, once per process, and landed inside a
    timed run as its longest loop stall (``randread``'s stall figure before
    this call was made here)."""
    stats()
    gc.collect()


async def seqread(
    path: str,
    *,
    request_size: int = 64 << 20,
    block_size: int | None = None,
    parallelism: int | None = None,
    misalign: int = 0,
    buffers: list[np.ndarray] | None = None,
) -> Result:
    """Read the whole file with requests of ``request_size``, all in flight at
    once (like loading the tensors of a checkpoint), into pre-touched aligned
    buffers, or buffers and file offsets both shifted by ``misalign`` bytes
    (the bounce path). Latency: each request's completion since the start."""
    size = os.path.getsize(path) - misalign
    size -= size % 8
    n = -(-size // request_size)
    if buffers is None:
        buffers = touched_buffers(size, request_size, misalign)
    _runtime_ready()
    with nvme_open(path, block_size=block_size, parallelism=parallelism) as f:
        reqs = [(buffers[i], misalign + i * request_size) for i in range(n)]
        lat: list[float] = []
        with Timer() as t:
            t0 = time.perf_counter()

            async def one(b: np.ndarray, off: int) -> None:
                await f.pread(b, off)
                lat.append(time.perf_counter() - t0)

            await asyncio.gather(*(one(b, o) for b, o in reqs))
        direct = f.info.direct
    ok = all(holds_pattern(b, o) for b, o in reqs)
    return t.result(
        "seqread",
        size,
        n,
        ok,
        latencies_s=lat,
        params=dict(
            request_size=request_size,
            block_size=block_size or defaults.settings.block_size,
            parallelism=parallelism,
            misalign=misalign,
            direct=direct,
        ),
    )


async def seqwrite(
    path: str,
    size: int,
    *,
    request_size: int = 64 << 20,
    block_size: int | None = None,
    parallelism: int | None = None,
    fsync: bool = True,
) -> Result:
    """Write a fresh file of ``size`` bytes (requests of ``request_size``, all
    in flight), then fsync; the time includes the fsync. Latency: each
    request's completion since the start (before the fsync)."""
    size -= size % 8
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    src = touched_buffers(size, request_size)
    for i, b in enumerate(src):
        fill_pattern(b, i * request_size)
    _runtime_ready()
    lat: list[float] = []
    with nvme_open(path, "w", block_size=block_size, parallelism=parallelism) as f, Timer() as t:
        t0 = time.perf_counter()

        async def one(b: np.ndarray, off: int) -> None:
            await f.pwrite(b, off)
            lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(b, i * request_size) for i, b in enumerate(src)))
        if fsync:
            await f.fsync()
    ok = os.path.getsize(path) == size
    if ok:
        check = empty(min(size, 1 << 20))
        with nvme_open(path) as f:
            for off in (0, size - len(check)):
                await f.pread(check, off)  # on the loop: its blocking twin is refused here
                ok = ok and check_pattern(check, off)
    return t.result(
        "seqwrite",
        size,
        len(src),
        ok,
        latencies_s=lat,
        params=dict(
            request_size=request_size,
            block_size=block_size or defaults.settings.block_size,
            parallelism=parallelism,
            fsync=fsync,
        ),
    )


# The gather mode times one read in this many (each coroutine's first, then
# every LATENCY_SAMPLE-th): timing every read in Python (two clock calls and a
# store, ~1.4k instructions, 0.5 µs of CPU per read here) was charged to the
# runtime under test, and cost it ~4% of its IOPS against fio, which times its
# reads in C (the randread suite against fio io_uring: 0.933x with every read
# timed, 0.979x untimed). The sample's percentiles are the run's: it is spread
# evenly over the whole run.
LATENCY_SAMPLE = 8


def random_offsets(n: int, file_size: int, bs: int, seed: int = 1) -> np.ndarray:
    """``n`` random multiples of ``bs`` below ``file_size`` (the same for the same seed)."""
    blocks = file_size // bs
    return np.random.default_rng(seed).integers(0, blocks, size=n, dtype=np.int64) * bs


async def randread(
    path: str,
    *,
    ops: int = 100_000,
    bs: int = 4096,
    iodepth: int = 64,
    mode: str = "gather",
    batch: int = 256,
) -> Result:
    """Random aligned reads of ``bs`` bytes, ``iodepth`` in flight.

    mode='gather': ``iodepth`` coroutines, each awaiting one pread after
    another (what an asyncio application does). mode='batch': a few
    coroutines, each awaiting pread_many of ``batch`` reads (one future per
    batch) through a :class:`~aionvme.Handle` of ``queue_depth=iodepth``:
    the batches share one window of ``iodepth`` reads (fio's iodepth counts
    all of a job's reads alike), so a batch's tail does not leave the device
    below ``iodepth`` (a read's latency is its whole batch's). mode='rows':
    the same batches as ``pread_rows`` (each batch's rows of one array, its
    offsets as an int64 array: no Python object per read).

    Latency percentiles: the gather mode times one read in
    ``LATENCY_SAMPLE`` (spread evenly over the run), the batch modes every
    batch. The longest loop stall is the longest of aionvme's loop callbacks
    (``Timer(stalls="reactor")``): a timer watching the loop would wake it
    every millisecond, which fio is spared.
    """
    if mode not in ("gather", "batch", "rows"):
        raise ValueError(f"mode must be 'gather', 'batch' or 'rows', got {mode!r}")
    size = os.path.getsize(path)
    offs = random_offsets(ops, size, bs).tolist()
    nworkers = max(1, min(4, iodepth))
    bufs = empty((iodepth, bs)) if mode == "gather" else empty((nworkers * batch, bs))
    bufs[:, ::4096] = 1
    # a list, not an ndarray: numpy's item assignment costs ~0.7k instructions
    # per read, charged to the runtime under test (a list's is ~30)
    lat: list[float] = [] if mode == "gather" else [0.0] * ops
    last: dict[int, int] = {}
    _runtime_ready()
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(nvme_open(path))
        if mode != "gather":
            h = stack.enter_context(Handle(queue_depth=iodepth))
            await h.pread(bufs[0], f, 0)  # its engine made before the clock starts
        t = stack.enter_context(Timer(stalls="reactor"))
        if mode == "gather":
            # Worker k reads offs[k], offs[k + iodepth], ...; it times the first
            # of every LATENCY_SAMPLE of them (the others run untimed).
            stride = iodepth * LATENCY_SAMPLE

            async def worker(k: int) -> None:
                b = bufs[k]
                clock = time.perf_counter
                for base in range(k, ops, stride):
                    t1 = clock()
                    await f.pread(b, offs[base])
                    lat.append(clock() - t1)
                    for i in range(base + iodepth, min(base + stride, ops), iodepth):
                        await f.pread(b, offs[i])
                last[k] = k + (ops - 1 - k) // iodepth * iodepth

            await asyncio.gather(*(worker(k) for k in range(min(iodepth, ops))))
        else:
            if mode == "batch":

                def read(mine: np.ndarray, i: int, j: int) -> Any:
                    return h.pread_many([(mine[x], offs[i + x]) for x in range(j)], f)

            else:
                offs64 = np.asarray(offs, dtype=np.int64)

                def read(mine: np.ndarray, i: int, j: int) -> Any:
                    return h.pread_rows(mine[:j], offs64[i : i + j], f)

            async def bworker(k: int) -> None:
                clock = time.perf_counter
                mine = bufs[k * batch : (k + 1) * batch]
                i = j = 0
                for i in range(k * batch, ops, nworkers * batch):
                    j = min(batch, ops - i)
                    t1 = clock()
                    await read(mine, i, j)
                    lat[i : i + j] = [clock() - t1] * j
                # which read each slot saw last, for the check (out of the loop's way)
                for x in range(j):
                    last[k * batch + x] = i + x

            await asyncio.gather(*(bworker(k) for k in range(nworkers)))
    ok = all(check_pattern(bufs[slot], offs[i]) for slot, i in last.items())
    return t.result(
        "randread",
        ops * bs,
        ops,
        ok,
        latencies_s=lat,
        params=dict(bs=bs, iodepth=iodepth, mode=mode, batch=None if mode == "gather" else batch),
    )


async def randwrite(path: str, *, ops: int = 50_000, bs: int = 4096, iodepth: int = 64) -> Result:
    """Random aligned writes of ``bs`` bytes into an existing file, ``iodepth``
    coroutines in flight; each writes the pattern of its offset."""
    size = os.path.getsize(path)
    offs = random_offsets(ops, size, bs, seed=2).tolist()
    bufs = empty((iodepth, bs))
    lat = [0.0] * ops  # a list: see randread
    _runtime_ready()
    with nvme_open(path, "r+") as f, Timer() as t:

        async def worker(k: int) -> None:
            b = bufs[k]
            clock = time.perf_counter
            for i in range(k, ops, iodepth):
                fill_pattern(b, offs[i])
                t1 = clock()
                await f.pwrite(b, offs[i])
                lat[i] = clock() - t1

        await asyncio.gather(*(worker(k) for k in range(min(iodepth, ops))))
    check = empty(bs)
    ok = True
    with nvme_open(path) as f:
        for o in offs[:: max(1, ops // 200)]:
            await f.pread(check, o)  # on the loop: its blocking twin is refused here
            ok = ok and check_pattern(check, o)
    return t.result("randwrite", ops * bs, ops, ok, latencies_s=lat, params=dict(bs=bs, iodepth=iodepth))


async def manyfiles(directory: str, *, nfiles: int = 1000, file_size: int = 1 << 20) -> Result:
    """Read ``nfiles`` separate files by path (open, read, close each) with one gather."""
    paths = [os.path.join(directory, f"t{i:05d}.bin") for i in range(nfiles)]
    for p in paths:
        make_file(p, file_size)
    bufs = touched_buffers(nfiles * file_size, file_size)
    lat: list[float] = []
    _runtime_ready()
    with Timer() as t:
        t0 = time.perf_counter()

        async def one(b: np.ndarray, p: str) -> None:
            await nvme_pread(b, p)
            lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(b, p) for b, p in zip(bufs, paths)))
    ok = all(check_pattern(b, 0) for b in bufs)
    return t.result(
        "manyfiles",
        nfiles * file_size,
        nfiles,
        ok,
        latencies_s=lat,
        params=dict(nfiles=nfiles, file_size=file_size),
    )


# -- GPU ------------------------------------------------------------------------------------------

GPU_WAYS = ("gds", "bounce", "host")


def _gpu_pattern(torch: Any, n: int, offset: int, device: Any) -> Any:
    """The file pattern of bytes [offset, offset + n) as int64 words on the GPU."""
    words = torch.arange(0, n, 8, dtype=torch.int64, device=device) + offset
    return torch.bitwise_xor(words, torch.tensor(SEED, dtype=torch.int64, device=device))


def _way_used(before: dict[str, Any], after: dict[str, Any]) -> str:
    gds = after["gds_requests"] - before["gds_requests"]
    bounce = after["bounce_requests"] - before["bounce_requests"]
    return "gds" if gds and not bounce else "bounce" if bounce and not gds else f"gds {gds}, bounce {bounce}"


def _check_way(way: str) -> None:
    if way not in GPU_WAYS:
        raise ValueError(f"way must be one of {', '.join(GPU_WAYS)}, got {way!r}")


async def gpu_read(path: str, *, way: str, request_size: int = 256 << 20, device: str = "cuda") -> Result:
    """Read the whole file into one CUDA tensor. ``way``: 'gds' or 'bounce'
    (aionvme's GPU paths, forced with ``gpu_path``), or 'host' (what code
    without them does: pread into page-aligned host memory, then ``.copy_``)."""
    import torch

    _check_way(way)
    size = os.path.getsize(path)
    size -= size % 8
    dev = torch.device(device)
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    host = empty(size) if way == "host" else None
    if host is not None:
        host[::4096] = 1  # faulted in before the clock starts, like fio's buffers
    offs = list(range(0, size, request_size))
    _runtime_ready()
    before = gpu.stats()
    with defaults.set(gpu_path=way if way != "host" else "auto"), nvme_open(path) as f, Timer() as t:
        if host is None:
            await asyncio.gather(*(f.pread(dst[o : o + request_size], o) for o in offs))
        else:
            await asyncio.gather(*(f.pread(host[o : o + request_size], o) for o in offs))
            dst.copy_(torch.from_numpy(host))
        torch.cuda.synchronize(dev)
    ok = bool(torch.equal(dst.view(torch.int64), _gpu_pattern(torch, size, 0, dev)))
    used = "host" if host is not None else _way_used(before, gpu.stats())
    return t.result(
        "gpu-read",
        size,
        len(offs),
        ok,
        params=dict(way=way, used=used, request_size=request_size, device=device),
    )


async def gpu_write(
    path: str, size: int, *, way: str, request_size: int = 256 << 20, device: str = "cuda"
) -> Result:
    """Write a CUDA tensor to a fresh file, then fsync (the time includes it).
    ``way`` as for :func:`gpu_read` ('host': ``.cpu()``, then pwrite)."""
    import torch

    _check_way(way)
    size -= size % 8
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    dev = torch.device(device)
    src = _gpu_pattern(torch, size, 0, dev).view(torch.uint8)
    torch.cuda.synchronize(dev)
    offs = list(range(0, size, request_size))
    _runtime_ready()
    before = gpu.stats()
    with defaults.set(gpu_path=way if way != "host" else "auto"), nvme_open(path, "w") as f, Timer() as t:
        if way == "host":
            host = src.cpu().numpy()
            await asyncio.gather(*(f.pwrite(host[o : o + request_size], o) for o in offs))
        else:
            await asyncio.gather(*(f.pwrite(src[o : o + request_size], o) for o in offs))
        await f.fsync()
    ok = os.path.getsize(path) == size
    if ok:
        check = empty(min(size, 1 << 20))
        with nvme_open(path) as f:
            for off in (0, size // 2 - size // 2 % 8, size - len(check)):
                await f.pread(check, off)  # on the loop: its blocking twin is refused here
                ok = ok and check_pattern(check, off)
    used = "host" if way == "host" else _way_used(before, gpu.stats())
    return t.result(
        "gpu-write",
        size,
        len(offs),
        ok,
        params=dict(way=way, used=used, request_size=request_size, device=device),
    )
