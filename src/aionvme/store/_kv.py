"""What a KV-cache tier of a serving engine asks of the store: pins across
calls from any thread (:class:`PinTable`), cache mode (:class:`Evictor`:
a full NVMe tier drops its coldest values instead of refusing a put) and
jobs submitted from foreign threads (:class:`Jobs`: a
``concurrent.futures.Future`` each and an eventfd the caller polls).

Pins and evictions cross threads: an engine pins a block on its scheduler
thread while the store's loop evicts. Both take one lock (``Mover.pin_lock``)
around the two facts that decide it, ``Entry.pins`` and ``Entry.dead``: a
pin takes a live entry, an eviction (or a delete, or a put replacing the
value) marks an unpinned one dead, never both. A dead entry's copies are
freed when its last reader and its last pin are gone (``Mover.settle``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import os
import threading
import types
from collections.abc import Callable, Coroutine, Hashable, Iterable
from typing import Any

from ._alloc import ALIGN, round_up
from ._errors import StoreClosedError, StorePinError
from ._mover import Mover
from ._nvme import span
from ._policy import Admission
from ._tiers import Entry

__all__ = ["Evictor", "Jobs", "PinTable", "cache_capacity", "key_list"]


# Part of each slab kept for the filesystem's own blocks of the file, which
# st_blocks counts: ext4's extent tree grows as writes split the
# preallocated (unwritten) extents, one 4 KiB block per 340 extents, at worst
# one extent per 4 KiB page (a 1 GiB slab takes one such block at once;
# 2000 random 4 KiB writes into a 256 MiB one took 13).
FS_RESERVE = 256  # 1/256 of the slab (at least a page)


def cache_capacity(on_full: str, given: object, nvme: int | None, ndirs: int) -> int | None:
    """The NVMe tier's capacity for ``on_full`` (checked). In cache mode
    ``nvme=`` is required and bounds what the slab files take on disk: each
    slab gets its share, less FS_RESERVE for the filesystem's blocks of it,
    in whole pages."""
    if on_full not in ("raise", "evict"):
        raise ValueError(f"on_full must be 'raise' or 'evict', got {on_full!r}")
    if on_full == "raise":
        return nvme
    if nvme is None:
        raise ValueError("on_full='evict' needs the NVMe tier's capacity (nvme=)")
    per = nvme // ndirs
    per -= max(ALIGN, round_up(per // FS_RESERVE))
    per -= per % ALIGN
    if per <= 0:
        raise ValueError(f"nvme={given!r} is less than two pages per directory")
    return per * ndirs


def key_list(keys: Iterable[Hashable], what: str) -> list[Hashable]:
    """The keys of a call that takes a list of them; a lone str, bytes or int
    (which would iterate as its characters or fail) is a TypeError."""
    if isinstance(keys, (str, bytes, int)):
        raise TypeError(f"{what} takes a list of keys, got a single {type(keys).__name__}: pass [key]")
    return list(keys)


class PinTable:
    """``store.pin`` / ``store.unpin``: per key, the entries its pins hold
    (oldest first; a put moves them to the key's new value, a delete leaves
    them on the deleted one, whose bytes stay until they go), and the keys
    cache-mode eviction dropped since ``drain``."""

    def __init__(
        self,
        mover: Mover,
        index: dict[Hashable, Entry],
        loop: Callable[[], asyncio.AbstractEventLoop | None],
        evicted_max: int | None = None,
    ) -> None:
        if evicted_max is not None and (not isinstance(evicted_max, int) or evicted_max < 0):
            raise ValueError(f"evicted_max must be an int >= 0 or None, got {evicted_max!r}")
        self.mover = mover
        self.lock = mover.pin_lock
        self.index = index
        self.loop = loop
        self.by_key: dict[Hashable, list[Entry]] = {}
        # the keys eviction dropped, to drain: the newest evicted_max (the
        # oldest go first, counted in evicted_lost)
        self.evicted: collections.deque[Hashable] = collections.deque(maxlen=evicted_max)
        self.evicted_lost = 0
        mover.handover = self.handover

    def handover(self, old: Entry, new: Entry) -> None:
        """A put replaced a key's value: its pins now hold the new value (a
        load of a pinned key after the put finds it), and the old one is
        freed once its readers are done."""
        with self.lock:
            held = self.by_key.get(old.key)
            if not held:
                return
            n = 0
            for i, e in enumerate(held):
                if e is old:
                    held[i] = new
                    n += 1
            old.pins -= n
            new.pins += n

    def pin(self, keys: list[Hashable]) -> list[bool]:
        out: list[bool] = []
        with self.lock:
            for k in keys:
                e = self.index.get(k)
                if e is None or e.dead:
                    out.append(False)
                    continue
                e.pins += 1
                self.by_key.setdefault(k, []).append(e)
                out.append(True)
        return out

    def unpin(self, keys: list[Hashable]) -> None:
        """Give back one pin per key (all or none: StorePinError if a key has
        fewer pins than it is named)."""
        released: list[Entry] = []
        with self.lock:
            for k, n in collections.Counter(keys).items():
                have = len(self.by_key.get(k, ()))
                if have < n:
                    why = f"it has {have} pin(s)" if have else "it is not pinned"
                    raise StorePinError(f"unpin of {k!r} {n} time(s): {why}")
            for k in keys:
                held = self.by_key[k]
                e = held.pop(0)
                if not held:
                    del self.by_key[k]
                e.pins -= 1
                if e.pins == 0 and e.dead:
                    released.append(e)
        self._settle(released)

    def hold(self, entries: list[Entry]) -> list[Entry]:
        """Pin entries for one call on the loop's thread (a get_many that must
        not see its values evicted midway); the live ones, to :meth:`release`."""
        got: list[Entry] = []
        with self.lock:
            for e in entries:
                if not e.dead:
                    e.pins += 1
                    got.append(e)
        return got

    def release(self, entries: list[Entry]) -> None:
        released: list[Entry] = []
        with self.lock:
            for e in entries:
                e.pins -= 1
                if e.pins == 0 and e.dead:
                    released.append(e)
        self._settle(released)

    def _settle(self, entries: list[Entry]) -> None:
        """Free the copies of dead entries whose last pin went (on the loop's thread)."""
        if not entries:
            return
        loop = self.loop()
        if loop is None or loop.is_closed():
            return  # never ran, or closed: its files are closed, nothing to free
        for e in entries:
            loop.call_soon_threadsafe(self.mover.settle, e)

    def note_evicted(self, keys: list[Hashable]) -> None:
        with self.lock:
            cap = self.evicted.maxlen
            if cap is not None:
                self.evicted_lost += max(0, len(self.evicted) + len(keys) - cap)
            self.evicted.extend(keys)

    def drain(self) -> list[Hashable]:
        with self.lock:
            out = list(self.evicted)
            self.evicted.clear()
        return out


class Evictor:
    """Cache mode (``on_full="evict"``): when the NVMe tier has no room, drop
    the coldest values that have an NVMe copy and that nobody pins, reads,
    holds, writes or moves, from every tier (the NVMe tier calls it, see
    ``NvmeTier.evictor``). ``lru`` orders the keys by their last put or get.
    With a journal each drop is journaled as a delete, durable before the
    space is reused (a crash never gives back a key whose bytes were
    overwritten)."""

    def __init__(
        self,
        mover: Mover,
        index: dict[Hashable, Entry],
        queues: dict[Hashable, Any],
        journal: Any,
        pins: PinTable,
        admission: Admission,
    ) -> None:
        self.mover = mover
        self.index = index
        self.queues = queues
        self.journal = journal
        self.pins = pins
        self.forget = admission.forget
        # a reopened store's keys, coldest first as the journal had them
        self.lru: collections.OrderedDict[Hashable, None] = collections.OrderedDict.fromkeys(index)
        mover.nvme.evictor = self

    def touch(self, keys: Iterable[Hashable]) -> None:
        lru = self.lru
        for k in keys:
            try:
                lru.move_to_end(k)
            except KeyError:
                lru[k] = None

    def _victims(self, need: int) -> tuple[list[Entry], int]:
        """The coldest droppable entries that free ``need`` bytes (fewer if
        there are not that many), marked dead under the pin lock: no pin
        can take them from here on."""
        victims: list[Entry] = []
        freed = 0
        gone: list[Hashable] = []
        journaled = self.journal is not None
        with self.pins.lock:
            for k in self.lru:
                e = self.index.get(k)
                if e is None:
                    gone.append(k)
                    continue
                ext = e.disk
                if (
                    ext is None
                    or e.busy()
                    or e.replaced is not None
                    # a put or delete of it is under way: its journal record
                    # could precede the delete's (a scratch store has none)
                    or (journaled and k in self.queues)
                    or any(x[0] < 0 for x in ext)  # attached: its file is not the tier's space
                ):
                    continue
                e.dead = True
                victims.append(e)
                freed += sum(round_up(span(off, n)[1]) for _i, off, _b, n in ext)
                if freed >= need:
                    break
        for k in gone:
            del self.lru[k]
        return victims, freed

    async def __call__(self, need: int) -> int:
        """Drop values until ``need`` bytes are free in the NVMe tier (as far
        as there are values to drop); the bytes freed."""
        victims, freed = self._victims(need)
        if not victims:
            return 0
        keys = [e.key for e in victims]
        for e in victims:
            del self.index[e.key]
            del self.lru[e.key]
        if self.journal is not None:
            try:
                await self.journal.append([{"op": "del", "k": k} for k in keys])
            except BaseException:
                # not durably gone: keep what nobody replaced meanwhile, as it was
                with self.pins.lock:
                    for e in victims:
                        if e.key not in self.index:
                            e.dead = False
                            self.index[e.key] = e
                            self.lru[e.key] = None
                            self.lru.move_to_end(e.key, last=False)
                for e in victims:
                    if e.dead:
                        self.mover.retire(e)
                raise
        for e in victims:
            self.mover.retire(e)
            self.forget(e.key)
        self.mover.nvme.stats["evictions"] += len(victims)
        self.pins.note_evicted(keys)
        return freed


class Jobs:
    """Calls submitted from other threads (``submit_put_many``,
    ``submit_get_many``): each completes a ``concurrent.futures.Future``
    on the store's loop; then 1 is added to the eventfd of :meth:`fd` (made
    on first use), so a caller polls one fd and collects its finished futures.

    A submit appends ``(future, fn, args)`` to a list and, when the list was
    empty, wakes the loop once: one wake-up (and one callback, :meth:`_drain`)
    serves every job submitted until it runs. There ``fn(*args)`` either
    returns the job's result (a hit in host memory, copied on the loop's
    thread, no coroutine) or a coroutine, run as a task that completes the
    future itself: no ``run_coroutine_threadsafe`` chain, no extra loop
    iteration between the job's end and its future.

    Cancelling a future before its job starts skips the job; while it runs,
    cancels its task. :meth:`close` (at the store's close) refuses new jobs
    and waits for those submitted: they finish, or fail with
    StoreClosedError where they had not started. Each job, whatever its end,
    adds 1 to the eventfd once, after its future is done."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False
        self.futures: set[concurrent.futures.Future[Any]] = set()  # submitted, not done
        self.queue: list[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]] = []
        self._fd = -1
        self.pid = os.getpid()  # a forked child's jobs would wait for a loop that is not there

    def fd(self) -> int:
        with self.lock:
            if self.closed:
                raise StoreClosedError("the store is closed")
            if self._fd < 0:
                self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            return self._fd

    def submit(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any
    ) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` on ``loop`` (a result, or a coroutine whose
        result it is); its outcome arrives on the returned future."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.lock:
            if self.closed or loop.is_closed() or os.getpid() != self.pid:
                why = "the store is closed" if self.closed else "the store's event loop is closed"
                if os.getpid() != self.pid:
                    why = "the store belongs to the parent process (fork)"
                raise StoreClosedError(why)
            if not self.queue:
                try:
                    loop.call_soon_threadsafe(self._drain, loop)
                except RuntimeError as e:  # closed since the check above
                    raise StoreClosedError("the store's event loop is closed") from e
            self.queue.append((fut, fn, args))
            self.futures.add(fut)
        return fut

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start every job submitted since the last drain (on the loop's thread)."""
        with self.lock:
            jobs, self.queue = self.queue, []
            closed = self.closed
        for i, (fut, fn, args) in enumerate(jobs):
            if fut.cancelled():
                self._finish(fut, None, None)
                continue
            if closed:
                self._finish(fut, None, StoreClosedError("the store was closed before this job started"))
                continue
            try:
                r = fn(*args)
            except BaseException as e:  # the job's own error: on its future
                self._finish(fut, None, e)
                if isinstance(e, Exception):
                    continue
                # KeyboardInterrupt, SystemExit: the loop's to raise; the jobs
                # after this one run at the next drain
                with self.lock:
                    if not self.queue:
                        loop.call_soon(self._drain, loop)
                    self.queue[:0] = jobs[i + 1 :]
                raise
            if type(r) is not types.CoroutineType:
                self._finish(fut, r, None)
                continue
            task = loop.create_task(self._run(fut, r))
            fut.add_done_callback(functools.partial(_cancel_from, loop, task))

    async def _run(self, fut: concurrent.futures.Future[Any], coro: Coroutine[Any, Any, Any]) -> None:
        try:
            r = await coro
        except asyncio.CancelledError:
            fut.cancel()
            self._finish(fut, None, None)
            raise
        except BaseException as e:
            self._finish(fut, None, e)
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt, SystemExit: the loop's too
        else:
            self._finish(fut, r, None)

    def _finish(self, fut: concurrent.futures.Future[Any], result: Any, err: BaseException | None) -> None:
        """The job's outcome on its future (unless cancelled), then 1 on the eventfd."""
        if not fut.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
                if err is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(err)
        with self.lock:
            self.futures.discard(fut)
            if self._fd >= 0:
                os.eventfd_write(self._fd, 1)

    async def close(self) -> None:
        with self.lock:
            self.closed = True
            futs = list(self.futures)
        if futs:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futs), return_exceptions=True)

    def close_fd(self) -> None:
        with self.lock:
            self.closed = True
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _cancel_from(
    loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], fut: concurrent.futures.Future[Any]
) -> None:
    """A job's future was cancelled while its task runs: cancel the task (on its loop)."""
    if fut.cancelled() and not task.done():
        with contextlib.suppress(RuntimeError):  # the loop is closed: the task is gone with it
            loop.call_soon_threadsafe(task.cancel)
