"""Workloads behind ``aionvme bench`` and the scripts in bench/.

One implementation of each measurement, used by the CLI and by the
side-by-side comparisons with fio and the other libraries. Each workload
creates (or reuses) its files, runs on the loop it is given, verifies what it
read, and returns a :class:`Result`: bytes and operations moved, wall and CPU
time, per-operation latencies, and the longest event-loop stall seen while it
ran.

Files hold a checkable pattern: every 8-byte word is its own file offset
XOR a seed, so any block can be verified without keeping a copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import defaults
from ._reactor import get_reactor
from .file import open as nvme_open
from .file import pread as nvme_pread
from .memory import empty

__all__ = [
    "GPU_WAYS",
    "WORKLOADS",
    "Result",
    "StallMonitor",
    "check_pattern",
    "fill_pattern",
    "gpu_read",
    "gpu_write",
    "make_file",
    "manyfiles",
    "randread",
    "randwrite",
    "seqread",
    "seqwrite",
]

SEED = 0x5A5A_1234_9E37_79B9


# -- data pattern -----------------------------------------------------------------


def fill_pattern(buf: np.ndarray, offset: int, seed: int = SEED) -> None:
    """Fill buf (uint8, length and offset multiples of 8) with the pattern of
    the file bytes at [offset, offset+len)."""
    words = buf.view(np.uint64)
    np.add(np.arange(len(words), dtype=np.uint64) * np.uint64(8), np.uint64(offset), out=words)
    np.bitwise_xor(words, np.uint64(seed), out=words)


def check_pattern(buf: np.ndarray, offset: int, seed: int = SEED) -> bool:
    """Whether buf holds the pattern of the file bytes at offset (8-aligned)."""
    words = buf.view(np.uint64)
    expect = np.arange(len(words), dtype=np.uint64) * np.uint64(8) + np.uint64(offset)
    np.bitwise_xor(expect, np.uint64(seed), out=expect)
    return bool(np.array_equal(words, expect))


def holds_pattern(buf: np.ndarray, offset: int, seed: int = SEED) -> bool:
    """Whether buf (uint8, any length) holds the file bytes at any offset."""
    if offset % 8 == 0 and len(buf) % 8 == 0:
        return check_pattern(buf, offset, seed)
    lo = offset - offset % 8
    expect = np.empty(-(-(offset + len(buf) - lo) // 8) * 8, np.uint8)
    fill_pattern(expect, lo, seed)
    return bool(np.array_equal(buf, expect[offset - lo : offset - lo + len(buf)]))


def make_file(
    path: str, size: int, chunk: int = 64 << 20, seed: int = SEED, *, overwrite: bool = False
) -> None:
    """Write the pattern to path (size a multiple of 8), fsynced, unless a file
    of that size with the right first and last words is already there.

    An existing file that does not start with the pattern is somebody's data:
    FileExistsError unless ``overwrite``.
    """
    if os.path.exists(path):
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(8), np.uint8).copy()
            have = os.fstat(f.fileno()).st_size
            ours = head.size == 8 and check_pattern(head, 0, seed)
            if ours and have == size and size >= 16:
                f.seek(size - 8)
                tail = np.frombuffer(f.read(8), np.uint8).copy()
                if check_pattern(tail, size - 8, seed):
                    return
        if not ours and have > 0 and not overwrite:
            raise FileExistsError(
                errno.EEXIST,
                "exists and is not an aionvme benchmark file: not overwriting it",
                path,
            )
    buf = empty(min(chunk, size))
    with nvme_open(path, "w") as f:
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            fill_pattern(buf[:n], off, seed)
            f.sync_pwrite(buf[:n], off)
        f.sync_fsync()


# -- measuring ----------------------------------------------------------------------


class StallMonitor:
    """Longest delay of a callback that should run every ``interval`` seconds.

    A callback scheduled with call_at measures how late it runs. With nothing
    else running the lateness is the loop's timer granularity (epoll and
    libuv time out in whole milliseconds, so ~1 ms); anything more is time the
    loop spent in other callbacks, ours included.
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.max_delay = 0.0
        self.samples = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + self.interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        self.max_delay = max(self.max_delay, now - self._due)
        self.samples += 1
        self._due = now + self.interval
        self._handle = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._loop = None


@dataclass
class Result:
    workload: str
    nbytes: int
    ops: int
    wall_s: float
    cpu_s: float
    user_s: float
    sys_s: float
    max_stall_s: float
    verified: bool
    latencies_s: list[float] = field(default_factory=list, repr=False)
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def mb_s(self) -> float:
        return self.nbytes / self.wall_s / 1e6 if self.wall_s > 0 else 0.0

    @property
    def iops(self) -> float:
        return self.ops / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_s_per_gib(self) -> float:
        return self.cpu_s / (self.nbytes / 2**30) if self.nbytes else 0.0

    @property
    def cpu_us_per_op(self) -> float:
        return self.cpu_s / self.ops * 1e6 if self.ops else 0.0

    def latency_us(self, q: float) -> float:
        if not self.latencies_s:
            return 0.0
        return float(np.quantile(np.asarray(self.latencies_s), q) * 1e6)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("latencies_s")
        d.update(
            mb_s=round(self.mb_s, 1),
            iops=round(self.iops, 1),
            cpu_s_per_gib=round(self.cpu_s_per_gib, 4),
            cpu_us_per_op=round(self.cpu_us_per_op, 2),
            p50_us=round(self.latency_us(0.5), 1),
            p99_us=round(self.latency_us(0.99), 1),
            max_stall_ms=round(self.max_stall_s * 1e3, 3),
        )
        return d


class _Meter:
    def __init__(self) -> None:
        self.stall = StallMonitor()

    def __enter__(self) -> _Meter:
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._t = time.perf_counter()
        self.stall.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        self.stall.stop()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.user = ru.ru_utime - self._ru.ru_utime
        self.sys = ru.ru_stime - self._ru.ru_stime

    def result(self, workload: str, nbytes: int, ops: int, verified: bool, **kw: Any) -> Result:
        return Result(
            workload=workload,
            nbytes=nbytes,
            ops=ops,
            wall_s=self.wall,
            cpu_s=self.user + self.sys,
            user_s=self.user,
            sys_s=self.sys,
            max_stall_s=self.stall.max_delay,
            verified=verified,
            **kw,
        )


# -- workloads --------------------------------------------------------------------------


async def seqread(
    path: str,
    *,
    request_size: int = 64 << 20,
    block_size: int | None = None,
    parallelism: int | None = None,
    misalign: int = 0,
    buffers: list[np.ndarray] | None = None,
) -> Result:
    """Read the whole file with requests of request_size, all in flight at once
    (like loading the tensors of a checkpoint), into pre-touched aligned
    buffers (or buffers shifted by ``misalign`` bytes, with the file offsets
    shifted alike by ``misalign`` too, to exercise the bounce path)."""
    size = os.path.getsize(path) - misalign
    size -= size % 8
    n = -(-size // request_size)
    if buffers is None:
        buffers = _touched_buffers(size, request_size, misalign)
    get_reactor()  # the loop's runtime exists before the clock starts
    with nvme_open(path, block_size=block_size, parallelism=parallelism) as f:
        reqs = [(buffers[i], misalign + i * request_size) for i in range(n)]
        with _Meter() as m:
            t0 = time.perf_counter()
            lat: list[float] = []

            async def one(b: np.ndarray, off: int) -> None:
                await f.pread(b, off)
                lat.append(time.perf_counter() - t0)

            await asyncio.gather(*(one(b, o) for b, o in reqs))
    ok = all(holds_pattern(b, o) for b, o in reqs)
    return m.result(
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
            direct=f.info.direct,
        ),
    )


def _touched_buffers(size: int, request_size: int, misalign: int = 0) -> list[np.ndarray]:
    """Buffers for a whole file, pages faulted in (first-touch faults are a
    memory cost, not an I/O one: fio's buffers are touched too)."""
    base = empty(size + 2 * 4096)
    base[::4096] = 1
    shift = misalign % 4096
    out = []
    for off in range(0, size, request_size):
        n = min(request_size, size - off)
        out.append(base[shift + off : shift + off + n])
    return out


async def seqwrite(
    path: str,
    size: int,
    *,
    request_size: int = 64 << 20,
    block_size: int | None = None,
    parallelism: int | None = None,
    fsync: bool = True,
) -> Result:
    """Write a fresh file of size bytes (requests of request_size, all in
    flight), then fsync; the time includes the fsync."""
    size -= size % 8
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    src = _touched_buffers(size, request_size)
    for i, b in enumerate(src):
        fill_pattern(b, i * request_size)
    get_reactor()  # the loop's runtime exists before the clock starts
    with nvme_open(path, "w", block_size=block_size, parallelism=parallelism) as f, _Meter() as m:
        await asyncio.gather(*(f.pwrite(b, i * request_size) for i, b in enumerate(src)))
        if fsync:
            await f.fsync()
    ok = os.path.getsize(path) == size
    if ok:
        check = empty(min(size, 1 << 20))
        with nvme_open(path) as f:
            for off in (0, size - len(check)):
                f.sync_pread(check, off)
                ok = ok and check_pattern(check, off)
    return m.result(
        "seqwrite",
        size,
        len(src),
        ok,
        params=dict(
            request_size=request_size,
            block_size=block_size or defaults.settings.block_size,
            parallelism=parallelism,
            fsync=fsync,
        ),
    )


def _random_offsets(n: int, file_size: int, bs: int, seed: int = 1) -> np.ndarray:
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
    """Random aligned reads of bs bytes, iodepth in flight.

    mode='gather': iodepth coroutines, each awaiting one pread after another
    (what an asyncio application does). mode='batch': a few coroutines, each
    awaiting pread_many of ``batch`` reads (one future per batch), the file
    opened with parallelism iodepth / coroutines, so that at most iodepth
    reads are in flight and each batch's window slides as reads complete.
    """
    if mode not in ("gather", "batch"):
        raise ValueError(f"mode must be 'gather' or 'batch', got {mode!r}")
    size = os.path.getsize(path)
    offs = _random_offsets(ops, size, bs).tolist()
    nworkers = max(1, min(4, iodepth))
    bufs = empty((iodepth, bs)) if mode == "gather" else empty((nworkers * batch, bs))
    bufs[:, ::4096] = 1
    lat = np.zeros(ops)
    last: dict[int, int] = {}
    get_reactor()  # the loop's runtime exists before the clock starts
    parallelism = None if mode == "gather" else max(1, iodepth // nworkers)
    with nvme_open(path, parallelism=parallelism) as f, _Meter() as m:
        if mode == "gather":

            async def worker(k: int) -> None:
                b = bufs[k]
                clock = time.perf_counter
                for i in range(k, ops, iodepth):
                    t = clock()
                    await f.pread(b, offs[i])
                    lat[i] = clock() - t
                last[k] = i

            await asyncio.gather(*(worker(k) for k in range(min(iodepth, ops))))
        else:

            async def bworker(k: int) -> None:
                clock = time.perf_counter
                mine = bufs[k * batch : (k + 1) * batch]
                for i in range(k * batch, ops, nworkers * batch):
                    j = min(batch, ops - i)
                    t = clock()
                    await f.pread_many([(mine[x], offs[i + x]) for x in range(j)])
                    lat[i : i + j] = clock() - t
                    for x in range(j):
                        last[k * batch + x] = i + x

            await asyncio.gather(*(bworker(k) for k in range(nworkers)))
    ok = all(check_pattern(bufs[slot], offs[i]) for slot, i in last.items())
    return m.result(
        "randread",
        ops * bs,
        ops,
        ok,
        latencies_s=lat.tolist(),
        params=dict(bs=bs, iodepth=iodepth, mode=mode, batch=batch if mode == "batch" else None),
    )


async def randwrite(
    path: str,
    *,
    ops: int = 50_000,
    bs: int = 4096,
    iodepth: int = 64,
) -> Result:
    """Random aligned writes of bs bytes into an existing file, iodepth
    coroutines in flight; each writes the pattern of its offset."""
    size = os.path.getsize(path)
    offs = _random_offsets(ops, size, bs, seed=2).tolist()
    bufs = empty((iodepth, bs))
    lat = np.zeros(ops)
    get_reactor()  # the loop's runtime exists before the clock starts
    with nvme_open(path, "r+") as f, _Meter() as m:

        async def worker(k: int) -> None:
            b = bufs[k]
            clock = time.perf_counter
            for i in range(k, ops, iodepth):
                fill_pattern(b, offs[i])
                t = clock()
                await f.pwrite(b, offs[i])
                lat[i] = clock() - t

        await asyncio.gather(*(worker(k) for k in range(iodepth)))
    check = empty(bs)
    with nvme_open(path) as f:
        ok = True
        for o in offs[:: max(1, ops // 200)]:
            f.sync_pread(check, o)
            ok = ok and check_pattern(check, o)
    return m.result(
        "randwrite", ops * bs, ops, ok, latencies_s=lat.tolist(), params=dict(bs=bs, iodepth=iodepth)
    )


async def manyfiles(directory: str, *, nfiles: int = 1000, file_size: int = 1 << 20) -> Result:
    """Read nfiles separate files (by path: open, read, close each) with one gather."""
    paths = [os.path.join(directory, f"t{i:05d}.bin") for i in range(nfiles)]
    for p in paths:
        make_file(p, file_size)
    bufs = _touched_buffers(nfiles * file_size, file_size)
    lat: list[float] = []
    get_reactor()  # the loop's runtime exists before the clock starts
    with _Meter() as m:
        t0 = time.perf_counter()

        async def one(b: np.ndarray, p: str) -> None:
            await nvme_pread(b, p)
            lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(b, p) for b, p in zip(bufs, paths)))
    ok = all(check_pattern(b, 0) for b in bufs)
    return m.result(
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
    """The file pattern of bytes [offset, offset+n) as int64 words on the GPU."""
    words = torch.arange(0, n, 8, dtype=torch.int64, device=device) + offset
    return torch.bitwise_xor(words, torch.tensor(SEED, dtype=torch.int64, device=device))


def _way_used(before: dict[str, Any], after: dict[str, Any]) -> str:
    gds = after["gds_requests"] - before["gds_requests"]
    bounce = after["bounce_requests"] - before["bounce_requests"]
    return "gds" if gds and not bounce else "bounce" if bounce and not gds else f"gds {gds}, bounce {bounce}"


async def gpu_read(path: str, *, way: str, request_size: int = 256 << 20, device: str = "cuda") -> Result:
    """Read the whole file into one CUDA tensor. way: 'gds' or 'bounce' (aionvme's
    GPU paths, forced with ``gpu_path``), or 'host' (what code without them
    does: pread into page-aligned host memory, then ``.cuda()``)."""
    import torch

    from . import gpu

    size = os.path.getsize(path)
    size -= size % 8
    dev = torch.device(device)
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    host = empty(size) if way == "host" else None
    if host is not None:
        host[::4096] = 1  # faulted in before the clock starts, like fio's buffers
    offs = list(range(0, size, request_size))
    get_reactor()
    before = gpu.stats()
    with defaults.set(gpu_path=way if way != "host" else "auto"), nvme_open(path) as f, _Meter() as m:
        if host is None:
            await asyncio.gather(*(f.pread(dst[o : o + request_size], o) for o in offs))
        else:
            await asyncio.gather(*(f.pread(host[o : o + request_size], o) for o in offs))
            dst.copy_(torch.from_numpy(host))
        torch.cuda.synchronize(dev)
    ok = bool(torch.equal(dst.view(torch.int64), _gpu_pattern(torch, size, 0, dev)))
    used = "host" if host is not None else _way_used(before, gpu.stats())
    return m.result(
        "gpu-read",
        size,
        len(offs),
        ok,
        params=dict(way=way, used=used, request_size=request_size, device=device),
    )


async def gpu_write(
    path: str, size: int, *, way: str, request_size: int = 256 << 20, device: str = "cuda"
) -> Result:
    """Write a CUDA tensor to a fresh file (then fsync; the time includes it).
    way as for :func:`gpu_read` ('host': ``.cpu()``, then pwrite)."""
    import torch

    from . import gpu

    size -= size % 8
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    dev = torch.device(device)
    src = _gpu_pattern(torch, size, 0, dev).view(torch.uint8)
    torch.cuda.synchronize(dev)
    offs = list(range(0, size, request_size))
    get_reactor()
    before = gpu.stats()
    with defaults.set(gpu_path=way if way != "host" else "auto"), nvme_open(path, "w") as f, _Meter() as m:
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
                f.sync_pread(check, off)
                ok = ok and check_pattern(check, off)
    used = "host" if way == "host" else _way_used(before, gpu.stats())
    return m.result(
        "gpu-write",
        size,
        len(offs),
        ok,
        params=dict(way=way, used=used, request_size=request_size, device=device),
    )


WORKLOADS: dict[str, Callable[..., Any]] = {
    "seqread": seqread,
    "seqwrite": seqwrite,
    "randread": randread,
    "randwrite": randwrite,
    "manyfiles": manyfiles,
}
