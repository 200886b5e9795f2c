"""The NVMe tier: one preallocated O_DIRECT slab file per directory, an extent
allocator per slab, values striped over the slabs when they are large.

An extent list describes where a value's bytes live: ``(slab, offset,
buf_offset, nbytes)`` per piece, ``buf_offset`` being the piece's place in the
value. Pieces start on 4096-byte boundaries in the file and in the value, so
page-aligned buffers move zero-copy with O_DIRECT.

A value of one piece may instead be placed at a *phase*: its bytes start
``phase`` bytes into their first page of the file, the phase that its memory
had in its page when it was written (a torch tensor sits 64 bytes past a page).
The whole pages of that memory then go to and from the file with no copy; only
the partial pages at its two ends are copied (writes: into zero-filled pages,
no read-modify-write; reads into memory the store allocates: the whole pages
at once, in memory at the same phase; reads into a caller's ``out=``: the
engine's bounce of the end blocks, none other when ``out=`` has the same
phase). Such an
extent is the allocated span ``[offset - phase, round_up(offset + nbytes))``,
see :func:`span`.

A negative slab index ``-(j + 1)`` names the j-th *source* instead: a file the
store only reads (values attached in place, see ``TieredStore.attach``). Its
pieces are never allocated, freed, moved or written, and may start anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from .. import defaults, memory
from .. import file as _file
from ._alloc import ALIGN, ExtentAllocator, round_up
from ._checksum import INLINE_MAX, PIPE_MIN, digest, digest_all, gather_all, read_hashed, xxhash_module
from ._errors import CorruptValueError, StoreCorruptError, StoreFullError
from ._lock import make_dirs
from ._values import is_cuda

__all__ = ["Extents", "NvmeTier", "Slab", "phase_of", "span"]

Extent = tuple[int, int, int, int]  # (slab index, file offset, offset in the value, nbytes)
Extents = list[Extent]

GROW_MIN = 64 << 20  # a slab grows by at least this much (fallocate), or by a quarter of itself
# Values smaller than this are placed at phase 0: a bounce of a small value
# costs little, a page of slack per value does.
PHASE_MIN = 256 << 10
PHASE_UNIT = 16  # phases are multiples of this: any dtype's alignment (malloc gives 16)


def _at_phase(ext: Extents, phase: int, nbytes: int) -> Extents:
    """The extents of a value of nbytes placed ``phase`` bytes into the one
    piece allocated for it (``nbytes + phase`` bytes), or ext for phase 0."""
    if not phase:
        return ext
    ((i, off, _, _),) = ext
    return [(i, off + phase, 0, nbytes)]


async def _all_of(futs: list[Awaitable[Any]], keep: Any) -> None:
    """Await every request of one transfer; ``keep`` (the buffers the
    requests were made of) stays referenced, as this coroutine's argument,
    until they end."""
    if len(futs) == 1:
        await futs[0]
        return
    # every batch must end before the buffers can be reused, even when one fails
    results = await asyncio.gather(*futs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def span(offset: int, nbytes: int) -> tuple[int, int]:
    """The allocated (offset, nbytes) of a piece at ``offset`` (its phase is
    ``offset % ALIGN``: 0 for every piece but a phase-placed value's)."""
    p = offset % ALIGN
    return offset - p, nbytes + p


def phase_of(ext: Extents | None) -> int:
    """The phase of a one-piece value's bytes in their first page of the file
    (a multiple of PHASE_UNIT), else 0. Memory at the same phase moves with
    no copy but the end blocks'."""
    if not ext or len(ext) != 1:
        return 0
    p = ext[0][1] % ALIGN
    return p if p % PHASE_UNIT == 0 else 0


class Slab:
    """One slab file: an aionvme File (O_DIRECT) and the allocator of its space."""

    def __init__(self, path: str, fixed: int | None, create: bool, mode: int = 0o600) -> None:
        self.path = path
        self.fixed = fixed  # preallocated size that never grows, or None (grows on demand)
        if create:  # with the store's permissions (0600 by default), not the umask's
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode))
                os.chmod(path, mode)
            except OSError as e:
                raise OSError(e.errno, e.strerror, path) from None
        self.file = _file.File(path, "r+")
        try:
            size = self.file.size()
            if fixed is not None and size < fixed:
                _fallocate(self.file.fileno(), 0, fixed, path)
                size = fixed
        except BaseException:
            self.file.close()
            if create:  # a slab made here that cannot take its size (ENOSPC) is not left behind
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        self.alloc = ExtentAllocator(size - size % ALIGN)
        self.opened_size = size  # what an index rebuilt at open may point into

    @property
    def size(self) -> int:
        return self.alloc.capacity


def _phased(raw: Any, boff: int, n: int, off: int, pages: Any) -> list[tuple[Any, int]]:
    """Write items of the n bytes raw[boff:] at file offset off (not page-
    aligned): its first and last partial pages copied into ``pages`` (two
    zeroed pages), the whole pages between straight from raw."""
    p = off % ALIGN
    base = off - p
    src = raw.numpy() if not isinstance(raw, np.ndarray) else raw  # a CPU tensor: the same bytes
    head = min(n, ALIGN - p)
    pages[p : p + head] = src[boff : boff + head]
    items = [(pages[:ALIGN], base)]
    body = (n - head) // ALIGN * ALIGN
    if body:
        items.append((raw[boff + head : boff + head + body], base + ALIGN))
    tail = n - head - body
    if tail:
        pages[ALIGN : ALIGN + tail] = src[boff + head + body : boff + n]
        items.append((pages[ALIGN:], base + ALIGN + body))
    return items


def _fallocate(fd: int, offset: int, length: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise StoreFullError(f"cannot grow the slab to {offset + length} bytes", path) from None
        raise OSError(e.errno, e.strerror, path) from None


class NvmeTier:
    """Slab files in ``dirs``; ``capacity`` bytes in all (split evenly,
    preallocated) or None to grow each slab by fallocate as needed.

    ``stripe`` is the value size from which a value is split over all slabs
    (one piece per slab, read and written in parallel).
    """

    name = "nvme"

    def __init__(
        self,
        dirs: Sequence[str],
        capacity: int | None,
        *,
        persist: bool,
        stripe: int = 4 << 20,
        basename: str = "aionvme-store",
        mode: int = 0o600,
        checksum: bool = True,
    ) -> None:
        self.dirs = [os.path.abspath(d) for d in dirs]
        # xxh3_64 of each value this tier wrote (see _checksum.py), by its
        # first piece's (slab, offset); checked on every read of it
        self.checksum = checksum
        if checksum:
            xxhash_module()  # a clear ImportError now rather than at the first write
        self.sums: dict[tuple[int, int], int] = {}
        self.capacity_limit = capacity
        self.stripe = stripe
        self.persist = persist
        self.slabs: list[Slab] = []
        self.sources: list[_file.File] = []  # read-only files of attached values
        self._source_index: dict[str, int] = {}
        per = None if capacity is None else round_up(max(capacity // len(self.dirs), ALIGN))
        tag = "" if persist else f".{os.getpid()}.{secrets.token_hex(4)}"
        try:
            for d in self.dirs:
                make_dirs(d, mode)
                path = os.path.join(d, f"{basename}{tag}.slab")
                self.slabs.append(Slab(path, per, create=not (persist and os.path.exists(path)), mode=mode))
        except BaseException:
            self.close(remove=not persist)
            raise
        self._grow_lock: asyncio.Lock | None = None
        # set by the store: moves extents to join free space, returns bytes moved
        self.compactor: Callable[[], Awaitable[int]] | None = None
        # cache mode (on_full="evict", set by the store): drops the coldest
        # values until that many bytes are free, returns the bytes freed
        self.evictor: Callable[[int], Awaitable[int]] | None = None
        self._next = 0
        self.stats: dict[str, float] = {
            "hits": 0,
            "misses": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "evictions": 0,
            "wait_s": 0.0,
            "compactions": 0,
        }

    # -- space ---------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        return sum(s.alloc.free_bytes for s in self.slabs)

    @property
    def used(self) -> int:
        return sum(s.alloc.used for s in self.slabs)

    @property
    def capacity(self) -> int:
        return sum(s.size for s in self.slabs)

    def pieces(self, nbytes: int) -> list[tuple[int, int]]:
        """(offset in the value, nbytes) of each piece of a value."""
        k = len(self.slabs)
        if k == 1 or nbytes < self.stripe:
            return [(0, nbytes)]
        part = round_up(-(-nbytes // k))
        return [(o, min(part, nbytes - o)) for o in range(0, nbytes, part)]

    def _try_alloc(self, nbytes: int) -> Extents | None:
        pieces = self.pieces(nbytes)
        k = len(self.slabs)
        out: Extents = []
        if len(pieces) == 1:
            # the slab with the most free space, round-robin among equals
            order = sorted(range(k), key=lambda i: (-self.slabs[i].alloc.free_bytes, (i - self._next) % k))
            self._next = (self._next + 1) % k
            for i in order:
                off = self.slabs[i].alloc.alloc(nbytes)
                if off is not None:
                    return [(i, off, 0, nbytes)]
            return None
        for j, (boff, n) in enumerate(pieces):
            placed = False
            for d in range(k):
                i = (j + d) % k
                off = self.slabs[i].alloc.alloc(n)
                if off is not None:
                    out.append((i, off, boff, n))
                    placed = True
                    break
            if not placed:
                self.free(out)
                return None
        return out

    async def allocate(self, nbytes: int, phase: int = 0) -> Extents:
        """Extents for a value of nbytes: from free space, else by growing a slab.

        ``phase``: where in its page the memory the value is written from
        starts (``address % 4096``); a value of PHASE_MIN bytes or more that
        fits one piece is placed at that phase (see the module's notes) in
        slabs that grow. A tier of a fixed size (``nvme=``) packs values at
        page boundaries: the page of slack a phase costs would make a tier
        sized for its values too small for them.
        Raises StoreFullError (ENOSPC) when neither works.
        """
        phase = self.placement_phase(nbytes, phase)
        return _at_phase(await self._allocate(nbytes + phase), phase, nbytes)

    def try_allocate(self, nbytes: int, phase: int = 0) -> Extents | None:
        """:meth:`allocate` from free space only, without waiting: None where
        the value needs a slab to grow (or a compaction) first."""
        phase = self.placement_phase(nbytes, phase)
        got = self._try_alloc(nbytes + phase)
        return None if got is None else _at_phase(got, phase, nbytes)

    def placement_phase(self, nbytes: int, phase: int) -> int:
        """The phase :meth:`allocate` gives a value of nbytes written from
        memory at ``phase`` (``address % 4096``): that phase, or 0."""
        phase %= ALIGN
        if (
            phase
            and phase % PHASE_UNIT == 0
            and nbytes >= PHASE_MIN
            and self.capacity_limit is None
            and len(self.pieces(nbytes + phase)) == 1
        ):
            return phase
        return 0

    async def _allocate(self, nbytes: int) -> Extents:
        ext = self._try_alloc(nbytes)
        if ext is not None:
            return ext
        if self._grow_lock is None:
            self._grow_lock = asyncio.Lock()
        async with self._grow_lock:
            ext = self._try_alloc(nbytes)
            if ext is not None:
                return ext
            if self.evictor is not None:
                return await self._evict_for(nbytes, self.evictor)
            full: StoreFullError | None = None
            try:
                await self._grow(nbytes)
            except StoreFullError as e:
                full = e
            ext = self._try_alloc(nbytes)
            if ext is not None:
                return ext
            # enough free bytes, but in pieces: move extents down to join them
            if self.compactor is not None and self.free_bytes >= round_up(max(nbytes, 1)):
                await self.compactor()
                ext = self._try_alloc(nbytes)
                if ext is not None:
                    return ext
            if full is not None:
                raise full
        raise StoreFullError(
            f"the NVMe tier has no room for {nbytes} bytes ({self.used} of {self.capacity} used, "
            f"largest free extent {max((s.alloc.largest_free() for s in self.slabs), default=0)})",
            self.slabs[0].path,
        )

    async def _evict_for(self, nbytes: int, evictor: Callable[[int], Awaitable[int]]) -> Extents:
        """Cache mode: drop the coldest values until nbytes fit (the tier has
        a fixed size); where the free bytes suffice but in pieces, compact,
        and drop more (one value at a time, the next coldest, until a hole
        fits) only if compaction did not join them. StoreFullError
        for a value larger than the tier, or when nothing is left to drop
        (everything pinned, read or written)."""
        sizes = [round_up(max(n, 1)) for _o, n in self.pieces(nbytes)]
        need = sum(sizes)
        if need > self.capacity or max(sizes) > max(s.size for s in self.slabs):  # no drop makes room
            raise StoreFullError(
                f"a value of {nbytes} bytes is larger than the NVMe tier can hold ({self.capacity} bytes "
                f"in {len(self.slabs)} slab(s) of at most {max(s.size for s in self.slabs)})",
                self.slabs[0].path,
            )
        since = -1  # bytes dropped since the last compaction (-1: none yet)
        while True:
            ext = self._try_alloc(nbytes)
            if ext is not None:
                return ext
            short = need - self.free_bytes
            if short <= 0 and (since < 0 or since >= need) and self.compactor is not None:
                since = 0
                await self.compactor()
                continue
            freed = await evictor(max(short, 1))
            if not freed:
                raise StoreFullError(
                    f"the NVMe tier has no room for {nbytes} bytes and nothing it can drop: "
                    f"its values are pinned, read or written ({self.used} of {self.capacity} used)",
                    self.slabs[0].path,
                )
            since = max(since, 0) + freed

    async def _grow(self, nbytes: int) -> None:
        """Grow slabs so that each piece of a value fits at a slab's end."""
        growable = [s for s in self.slabs if s.fixed is None]
        if not growable:
            return
        loop = asyncio.get_running_loop()
        want: dict[int, int] = {}  # id(slab) -> bytes it must have free at its end
        slabs: dict[int, Slab] = {}
        for j, (_boff, n) in enumerate(self.pieces(nbytes)):
            s = growable[j % len(growable)]
            want[id(s)] = want.get(id(s), 0) + round_up(max(n, 1))
            slabs[id(s)] = s
        for sid, need in want.items():
            s = slabs[sid]
            short = need - s.alloc.tail_free()
            if short <= 0:
                continue
            step = max(short, GROW_MIN, s.size // 4)
            try:  # never take more than half of what the filesystem has left (its journal, others)
                st = os.statvfs(os.path.dirname(s.path))
                step = min(step, st.f_bavail * st.f_frsize // 2)
            except OSError:
                pass
            step = round_up(max(step, short))
            if self.capacity_limit is None:
                try:
                    await loop.run_in_executor(None, _fallocate, s.file.fileno(), s.size, step, s.path)
                except StoreFullError:
                    step = round_up(short)  # the disk is nearly full: just what is needed
                    await loop.run_in_executor(None, _fallocate, s.file.fileno(), s.size, step, s.path)
            s.alloc.grow(s.size + step)

    def free(self, ext: Extents) -> None:
        if ext:
            self.sums.pop(ext[0][:2], None)
        for i, off, _boff, n in ext:
            if i >= 0:  # a source's bytes are the file's own
                self.slabs[i].alloc.free(*span(off, n))

    def release(self, ext: Extents, nbytes: int = 0) -> None:
        """:meth:`free`, as the tier interface names it (see _tiers.Tier)."""
        self.free(ext)

    def notify(self) -> None:
        """Nobody waits for room in this tier (allocation grows or fails)."""

    def source(self, path: str) -> tuple[int, int]:
        """The (negative) slab index of a read-only source file, opened once,
        and the file's size."""
        path = os.path.abspath(path)
        j = self._source_index.get(path)
        if j is None:
            self.sources.append(_file.File(path, "r"))
            j = self._source_index[path] = len(self.sources) - 1
        return -(j + 1), self.sources[j].size()

    def _file_of(self, i: int) -> _file.File:
        return self.slabs[i].file if i >= 0 else self.sources[-i - 1]

    def reserve(self, ext: Extents, checksum: int | None = None) -> None:
        """Mark extents used (rebuilding from a journal), with the value's
        checksum; StoreCorruptError where they are past a slab's end or
        overlap another value's."""
        for i, off, _boff, n in ext:
            s = self.slabs[i]
            if off + n > s.opened_size:
                raise StoreCorruptError(
                    f"the index puts {n} bytes at offset {off}, past the slab's end", s.path, off
                )
            off, n = span(off, n)
            if off + round_up(max(n, 1)) > s.size:
                s.alloc.grow(off + round_up(max(n, 1)))
            try:
                s.alloc.reserve(off, n)
            except ValueError:
                raise StoreCorruptError(
                    f"the index gives the {n} bytes at offset {off} to two values", s.path, off
                ) from None
        if ext and checksum is not None:
            self.sums[ext[0][:2]] = checksum

    def checksum_of(self, ext: Extents | None) -> int | None:
        """The checksum of the value at these extents (None: not taken)."""
        return self.sums.get(ext[0][:2]) if ext else None

    def moved(self, old: Extents, new: Extents) -> None:
        """A value's pieces moved (compaction): its checksum follows it."""
        c = self.sums.pop(old[0][:2], None)
        if c is not None:
            self.sums[new[0][:2]] = c

    # -- transfers ---------------------------------------------------------------------

    def _items(self, jobs: Sequence[tuple[Any, ...]], write: bool) -> dict[int, list[tuple[Any, int]]]:
        per: dict[int, list[tuple[Any, int]]] = {}
        if not write and any(len(j) > 2 for j in jobs):
            # (extents, span, True): a read into the page-aligned whole pages
            # around a one-piece value (see NvmeTier.read): one aligned transfer
            rest = []
            for j in jobs:
                ext = j[0]
                if len(j) > 2 and j[2] and len(ext) == 1 and ext[0][0] >= 0:
                    i, off, _boff, n = ext[0]
                    base, sp = span(off, n)
                    per.setdefault(i, []).append((j[1][: round_up(sp)], base))
                else:
                    rest.append(j[:2])
            jobs = rest
        phased = [(raw, x) for ext, raw in jobs for x in ext if x[0] >= 0 and x[1] % ALIGN] if write else []
        if phased:
            # the partial first and last pages of phase-placed values, zero-filled
            # around their bytes: written whole, nothing is read back first
            pages = memory.empty(2 * ALIGN * len(phased))
            for k, (raw, (i, off, boff, n)) in enumerate(phased):
                per.setdefault(i, []).extend(
                    _phased(raw, boff, n, off, pages[2 * k * ALIGN : (2 * k + 2) * ALIGN])
                )
        for ext, raw in jobs:
            size = len(raw)
            for i, off, boff, n in ext:
                if i >= 0 and off % ALIGN:
                    if not write:  # the engine bounces the end blocks only
                        per.setdefault(i, []).append((raw[boff : boff + n], off))
                    continue
                rn = round_up(n)
                # whole pages where the buffer has them (a source's length is exact: it may end the file)
                ln = rn if i >= 0 and boff + rn <= size else n
                per.setdefault(i, []).append((raw[boff : boff + ln], off))
        return per

    def _submit(self, jobs: Sequence[tuple[Any, ...]], write: bool) -> tuple[list[Awaitable[Any]], Any]:
        """Queue the requests of ``jobs`` on the running loop's engine now,
        one per slab: their transfers, and what they were made of (the
        buffers must outlive them)."""
        per = self._items(jobs, write)
        if write:
            block = defaults.bulk_write_block()
            futs = [_file.pwrite_many(items, self._file_of(i), block_size=block) for i, items in per.items()]
        else:
            # one piece on a slab: File.pread, the C path (pread_many's batch
            # is planned in Python: ~40-70 µs more CPU for a 16-64 MiB read)
            futs = [
                self._file_of(i).pread(*items[0]) if len(items) == 1 else self._file_of(i).pread_many(items)
                for i, items in per.items()
            ]
        return futs, per

    async def _run(self, jobs: Sequence[tuple[Any, ...]], write: bool) -> None:
        futs, per = self._submit(jobs, write)
        await _all_of(futs, per)

    async def write(self, jobs: Sequence[tuple[Extents, Any]]) -> None:
        """Write each (extents, flat uint8 buffer): one batched request per slab."""
        await self.start_write(jobs)

    def start_write(self, jobs: Sequence[tuple[Extents, Any]]) -> Coroutine[Any, Any, None]:
        """:meth:`write`, with its requests queued on the engine at this call
        rather than when the result is first awaited; the buffers must stay
        untouched until it ends. A result that is never awaited may be
        closed: the writes go on to their end regardless."""
        futs, per = self._submit(jobs, True)
        sums = [(ext, buf) for ext, buf in jobs if ext and ext[0][0] >= 0] if self.checksum else []
        return self._written(futs, per, sum(n for ext, _ in jobs for *_, n in ext), sums)

    async def _written(
        self,
        futs: list[Awaitable[Any]],
        keep: Any,
        nbytes: int,
        sums: list[tuple[Extents, Any]] | None = None,
    ) -> None:
        if not sums:
            await _all_of(futs, keep)
        else:
            # each value's checksum, taken while its write is in flight (its
            # buffer cannot change until the write ends): small ones here,
            # large ones on threads
            loop = asyncio.get_running_loop()
            got: list[tuple[tuple[int, int], Any]] = []
            threads = []
            for ext, buf in sums:
                n = sum(x[3] for x in ext)
                if n < INLINE_MAX and not is_cuda(buf):
                    got.append((ext[0][:2], digest(buf, n)))
                else:
                    f = loop.run_in_executor(None, digest, buf, n)
                    threads.append(f)
                    got.append((ext[0][:2], f))
            await gather_all([*futs, *threads])
            for k, d in got:
                self.sums[k] = d if isinstance(d, int) else d.result()
        self.stats["bytes_in"] += nbytes

    async def read(self, jobs: Sequence[tuple[Any, ...]], keys: Sequence[Any] | None = None) -> None:
        """Fill each flat uint8 buffer from its extents: one batched request per slab.

        A job ``(extents, span, True)`` of a one-piece value gives instead the
        page-aligned memory of the whole pages its extent spans (the value's
        bytes then start ``phase_of(extents)`` bytes into it): read whole, no
        bounce for a phase-placed value's partial end pages.

        Values whose checksum this tier took are checked (``keys``, one per
        job, name them): CorruptValueError if the bytes read differ."""
        if self.checksum and self.sums:
            await self._read_checked(jobs, keys)
        else:
            await self._run(jobs, False)
        self.stats["bytes_out"] += sum(n for ext, *_ in jobs for *_, n in ext)

    async def _read_checked(self, jobs: Sequence[tuple[Any, ...]], keys: Sequence[Any] | None) -> None:
        # every job in one batch as usual, each value with a checksum hashed
        # once its bytes are in (see _checksum.py for why not as they land),
        # but for large one-piece values: read in segments, hashed as they land
        checks: list[tuple[Any, int, int, Any, Extent]] = []  # (value bytes, n, checksum, key, first piece)
        # (read_hashed's arguments, checksum, key, first piece): coroutines made only at the gather
        piped: list[tuple[tuple[Any, ...], int, Any, Extent]] = []
        rest: list[tuple[Any, ...]] = []
        for j, job in enumerate(jobs):
            ext = job[0]
            c = self.sums.get(ext[0][:2]) if ext and ext[0][0] >= 0 else None
            if c is None:
                rest.append(job)
                continue
            first = ext[0]
            key = keys[j] if keys is not None else None
            n = sum(x[3] for x in ext)
            if n >= PIPE_MIN and len(ext) == 1:
                ((i, items),) = self._items([job], False).items()
                if len(items) == 1 and items[0][1] % ALIGN == 0 and not is_cuda(items[0][0]):
                    mem, off = items[0]
                    piped.append(((self._file_of(i), mem, off, first[1] - off, n), c, key, first))
                    continue
            view = job[1][first[1] % ALIGN :] if len(job) > 2 and job[2] else job[1]
            checks.append((view, n, c, key, first))
            rest.append(job)

        async def the_rest() -> list[int]:
            if rest:
                await self._run(rest, False)
            return await digest_all([(view, n) for view, n, *_ in checks])

        done: list[Any] = await asyncio.gather(
            the_rest(), *(read_hashed(*p[0]) for p in piped), return_exceptions=True
        )
        for r in done:
            if isinstance(r, BaseException):
                raise r
        sums, *got_piped = done
        for (_view, _n, c, key, first), got in zip(checks, sums):
            if got != c:
                self._corrupt(key, first, c, got)
        for (_read, c, key, first), got in zip(piped, got_piped):
            if got != c:
                self._corrupt(key, first, c, got)

    def _corrupt(self, key: Any, first: Extent, expected: int, got: int) -> None:
        i, off, _, _ = first
        raise CorruptValueError(key, self.slabs[i].path, off, expected, got)

    async def fsync(self) -> None:
        await asyncio.gather(*(s.file.fdatasync() for s in self.slabs))

    def close(self, remove: bool) -> None:
        for f in self.sources:
            f.close()  # never removed: the store only read them
        self.sources.clear()
        self._source_index.clear()
        for s in self.slabs:
            s.file.close()
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(s.path)
