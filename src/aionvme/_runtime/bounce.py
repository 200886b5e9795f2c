"""The bounce pipeline for CUDA tensors without cuFile: kernel AIO into
pinned host slots while earlier slots are copied to (or from) the GPU."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .._engine import Engine, FileHandle
from ..exceptions import ShortReadError
from . import cuda
from .blocking import run as drive_request
from .cuda import Params, flat_bytes, helper, stream, through, wait_all, wait_event
from .pinned import PinnedPool, Slot, pool
from .reactor import Reactor

# -- planning the bounce pipeline -------------------------------------------------------------


class _Piece:
    """One slot's worth of an item: ``n`` of its bytes starting ``upos`` into
    it, at file offset ``fpos + skip``. ``fpos`` is aligned; the slot holds
    the bytes at ``[skip, skip + n)``, so slot addresses and file offsets
    agree modulo the alignment and the engine moves them zero-copy (a read
    fills ``[0, skip + n)`` from ``fpos``: the head bytes it reads on the way
    are not copied)."""

    __slots__ = ("fpos", "item", "n", "skip", "upos")

    def __init__(self, item: int, fpos: int, skip: int, n: int, upos: int) -> None:
        self.item = item
        self.fpos = fpos
        self.skip = skip
        self.n = n
        self.upos = upos


def plan_pieces(items: Sequence[tuple[int, int]], slot: int, align: int) -> list[_Piece]:
    """Cut (nbytes, file offset) items into pieces of one slot each, at
    aligned file boundaries: only an item's first piece starts unaligned
    (``skip`` > 0) and only its last ends unaligned."""
    out = []
    for i, (n, off) in enumerate(items):
        if n <= 0:
            continue
        end = off + n
        pos = off - off % align
        while pos < end:
            stop = min(pos + slot, end)
            first = max(pos, off)
            out.append(_Piece(i, pos, first - pos, stop - first, first - off))
            pos = stop
    return out


# -- the transfers ------------------------------------------------------------------------------


class _Job:
    """One request of the GPU path: its items and what went wrong."""

    def __init__(self, fh: FileHandle, write: bool, items: list[tuple[Any, int]]) -> None:
        self.fh = fh
        self.write = write
        self.items = items
        self.errors: list[tuple[int, BaseException]] = []  # (item, error)
        self.stop = False

    def setup(
        self, torch: Any
    ) -> tuple[PinnedPool, list[Any], list[int], list[int], dict[Any, Any], list[_Piece]]:
        """(pool, flat uint8 views of the tensors, file offsets, sizes, copy
        stream per device, pieces) for a bounce transfer; the copy streams
        are ordered after the work queued so far on the tensors' current streams."""
        p = pool()
        flats = [flat_bytes(t, "pwrite" if self.write else "pread") for t, _ in self.items]
        offsets = [int(off) for _, off in self.items]
        sizes = [int(f.numel()) for f in flats]
        streams = {d: stream(torch, d) for d in {f.device for f in flats}}
        for d, s in streams.items():
            s.wait_stream(torch.cuda.current_stream(d))
        pieces = plan_pieces(list(zip(sizes, offsets)), p.slot_size, max(self.fh.align, 1))
        return p, flats, offsets, sizes, streams, pieces

    def fail(self, item: int, exc: BaseException) -> None:
        self.errors.append((item, exc))
        self.stop = True

    def finish(self, offsets: Sequence[int], sizes: Sequence[int]) -> int:
        """The byte count of a bounce request that ended, or its error."""
        self.raise_errors(offsets, sizes, range(len(self.items)))
        total = sum(sizes)
        cuda.stats["bounce_requests"] += 1
        cuda.stats["bounce_bytes"] += total
        return total

    def raise_errors(self, offsets: Sequence[int], sizes: Sequence[int], index: Sequence[int]) -> None:
        """Raise the first error: a short read as ShortReadError of the item
        (bytes contiguous from its offset), anything else as it came."""
        if not self.errors:
            return
        shorts = [(i, e) for i, e in self.errors if isinstance(e, ShortReadError)]
        if len(shorts) < len(self.errors):
            raise next(e for _, e in self.errors if not isinstance(e, ShortReadError))
        best: tuple[int, int] | None = None
        for i, e in shorts:
            got = max(0, e.offset + e.received - offsets[i])
            if best is None or (i, got) < best:
                best = (i, got)
        if best is not None:
            i, got = best
            seg = index[i] if len(self.items) > 1 else None
            raise ShortReadError(self.fh.path, offsets[i], sizes[i], got, segment=seg)


async def bounce(
    r: Reactor, fh: FileHandle, write: bool, items: list[tuple[Any, int]], params: Params
) -> int:
    """The pinned bounce pipeline for CUDA tensors (async)."""
    import torch

    job = _Job(fh, write, items)
    p, flats, offsets, sizes, streams, pieces = job.setup(torch)
    block, maxinf, mode = params
    it = iter(pieces)

    async def copy(dst: Any, src: Any, stream: Any) -> None:
        if p.pinned:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            ev.record(stream)
            await through(wait_event(ev))
        else:

            def run() -> None:
                with torch.cuda.stream(stream):
                    dst.copy_(src)
                stream.synchronize()

            await through(asyncio.get_running_loop().run_in_executor(helper(), run))

    async def worker() -> None:
        for pc in it:
            if job.stop:
                return
            slot = await p.acquire()
            try:
                flat = flats[pc.item]
                user = flat[pc.upos : pc.upos + pc.n]
                held = slot.array[pc.skip : pc.skip + pc.n]
                if write:
                    await copy(slot.tensor[pc.skip : pc.skip + pc.n], user, streams[flat.device])
                    await r.submit(r.engine.write(fh, held, pc.fpos + pc.skip, block, maxinf, mode))
                else:
                    span = slot.array[: pc.skip + pc.n]
                    await r.submit(r.engine.read(fh, span, pc.fpos, block, maxinf, mode))
                    await copy(user, slot.tensor[pc.skip : pc.skip + pc.n], streams[flat.device])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # kept for the request's error, raised below
                job.fail(pc.item, e)
            finally:
                p.release(slot)

    await workers(min(len(pieces), p.nslots), worker)
    return job.finish(offsets, sizes)


async def all_done(futs: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every one of futs is done. If the waiting task is cancelled,
    cancel them all and still wait for all of them (each finishes what it has
    in flight), then raise the cancellation."""
    try:
        await wait_all(futs)
    except asyncio.CancelledError:
        for f in futs:
            f.cancel()
        while not all(f.done() for f in futs):
            with contextlib.suppress(asyncio.CancelledError):
                await wait_all(futs)
        raise


async def _call(worker: Callable[[], Awaitable[None]]) -> None:
    await worker()


async def workers(n: int, worker: Callable[[], Awaitable[None]]) -> None:
    """Run n copies of worker; on cancellation cancel them all and wait for
    them (each finishes what is in flight) before raising."""
    if n <= 1:
        await worker()
        return
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = [loop.create_task(_call(worker)) for _ in range(n)]
    await all_done(tasks)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


def bounce_sync(
    eng: Engine, fh: FileHandle, write: bool, items: list[tuple[Any, int]], params: Params
) -> int:
    import torch

    job = _Job(fh, write, items)
    p, flats, offsets, sizes, streams, pieces = job.setup(torch)
    block, maxinf, mode = params
    pending: collections.deque[tuple[Slot, Any]] = collections.deque()  # read copies in flight
    depth = min(2, p.nslots)
    try:
        for pc in pieces:
            if job.stop:
                break
            while len(pending) >= depth:
                s, ev = pending.popleft()
                ev.synchronize()
                p.release(s)
            slot = p.acquire_blocking()
            flat = flats[pc.item]
            stream = streams[flat.device]
            user = flat[pc.upos : pc.upos + pc.n]
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            try:
                if write:
                    with torch.cuda.stream(stream):
                        slot.tensor[pc.skip : pc.skip + pc.n].copy_(user, non_blocking=p.pinned)
                    ev.record(stream)
                    ev.synchronize()
                    held = slot.array[pc.skip : pc.skip + pc.n]
                    drive_request(eng.write(fh, held, pc.fpos + pc.skip, block, maxinf, mode), eng)
                    p.release(slot)
                else:
                    span = slot.array[: pc.skip + pc.n]
                    drive_request(eng.read(fh, span, pc.fpos, block, maxinf, mode), eng)
                    with torch.cuda.stream(stream):
                        user.copy_(slot.tensor[pc.skip : pc.skip + pc.n], non_blocking=p.pinned)
                    ev.record(stream)
                    pending.append((slot, ev))
            except Exception as e:  # kept for the request's error, raised below
                job.fail(pc.item, e)
                p.release(slot)
    finally:
        while pending:
            s, ev = pending.popleft()
            ev.synchronize()
            p.release(s)
    return job.finish(offsets, sizes)
