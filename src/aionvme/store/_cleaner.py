"""Write-behind (``persist=False``): the host tier's coldest values that have
no NVMe copy are written out in the background while the tier is nearly
full, so a put that needs room later drops them at once instead of waiting
for their write."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Coroutine
from typing import Any

from .._runtime.reactor import get_reactor
from ._alloc import round_up
from ._mover import Mover
from ._tiers import HOST, Entry, WriteOut

__all__ = ["Cleaner"]


class Cleaner:
    """The write-behind of one store's host tier (see :meth:`kick`).

    ``batch`` is the bytes per batch (several in flight); ``in_flight`` the
    bytes the batches in flight write. Each batch's marks and references
    belong to its :class:`WriteOut`, given back when the batch's task ends,
    however it ends (even cancelled before it ran).
    """

    def __init__(self, mover: Mover, enabled: bool) -> None:
        self.mover = mover
        self.batch = 4 << 20
        self.in_flight = 0
        self.stopped = not enabled  # a persistent store writes through: nothing is dirty

    @property
    def batches(self) -> set[asyncio.Task[None]]:
        return self.mover.cleaning

    def add_dirty(self, e: Entry) -> None:
        """A value was put into the host tier with no other copy."""
        self.mover.dirty[e] = None

    def kick(self) -> None:
        """While the host tier is at least three quarters full, write its
        coldest values that have no NVMe copy yet, in batches of up to
        ``batch`` bytes (and at most half the in-flight budget, so two batches
        overlap), with up to a quarter of the tier in flight, and always at
        least two batches of one value each (a small tier whose every put
        evicts keeps the device busy with the next value while the previous
        one is written). They stay in memory, now clean, so the put that needs
        room later drops them at once instead of waiting for a write:
        evictions overlap with the puts (and copies) that cause them, and the
        device always has the next batch queued. Each batch that ends starts
        the next."""
        m = self.mover
        h = m.host
        if self.stopped:
            return
        budget = max(h.capacity // 4, 1)
        if h.used * 4 < h.capacity * 3:
            return
        if self.in_flight >= budget and len(m.cleaning) >= 2:
            return
        dirty_now = self._candidates(budget - self.in_flight + 2 * self.batch)
        per_batch = min(self.batch, max(budget // 2, 1))
        loop = asyncio.get_running_loop()
        started = False
        i = 0
        while i < len(dirty_now) and (self.in_flight < budget or len(m.cleaning) < 2):
            room = min(max(budget - self.in_flight, 0), per_batch)
            batch: list[Entry] = []
            total = 0
            while i < len(dirty_now):
                n = round_up(dirty_now[i].nbytes)
                if total + n > room and batch:
                    break  # the next batch starts with it
                batch.append(dirty_now[i])
                total += n
                i += 1
                if total >= room:
                    break
            w = WriteOut(batch, m.unref)
            self.in_flight += total
            # Where free space takes the batch, its write is queued here and
            # handed to the kernel before returning: a caller that puts again
            # without suspending (a host tier with clean values to drop) would
            # otherwise leave the device idle until its next suspension.
            exts = m.try_allocate(w)
            pending = None
            if exts is not None:
                pending = m.nvme.start_write(m.write_jobs(w, exts))
                started = True
            task = loop.create_task(m.write_out(w.entries, w, exts, pending))
            m.cleaning.add(task)
            m.tasks.add(task)
            task.add_done_callback(
                lambda t, total=total, w=w, p=pending: self._cleaned(t, total, w, p)  # type: ignore[misc]
            )
        if started:
            get_reactor(loop).flush_now()

    def _candidates(self, want: int) -> list[Entry]:
        """Dirty host values that can be written now, oldest put first, about
        ``want`` bytes of them; entries no longer dirty leave the list."""
        m = self.mover
        h = m.host
        got: list[Entry] = []
        gone: list[Entry] = []
        n = 0
        for e in m.dirty:
            if e.disk is not None or e.gpu is not None or e.host is None or e.dead or e not in h.entries:
                gone.append(e)  # written, copied elsewhere, or out of the tier
                continue
            c = e.copies[HOST]
            if c.refs or c.claims or c.loading is not None or e.moving:
                continue  # read, held, loading or written now: a later kick takes it
            got.append(e)
            n += round_up(e.nbytes)
            if n >= want:
                break
        for e in gone:
            del m.dirty[e]
        return got

    def _cleaned(
        self,
        t: asyncio.Task[None],
        nbytes: int,
        w: WriteOut,
        pending: Coroutine[Any, Any, None] | None,
    ) -> None:
        m = self.mover
        m.tasks.discard(t)
        m.cleaning.discard(t)
        self.in_flight -= nbytes
        if t.cancelled():
            if pending is not None and inspect.getcoroutinestate(pending) == inspect.CORO_CREATED:
                # cancelled before it ran (a loop shutting down): the write goes
                # on unawaited, so its extents stay allocated (it may still land
                # there) and the values stay dirty, but they are no longer pinned
                pending.close()
            w.release()  # given back already unless the task never ran
            m.host.notify()
            return
        if t.exception() is not None:
            m.note_error(t.exception())  # type: ignore[arg-type]
            return  # no retry from here (a full disk would spin): the next put or eviction tries
        self.kick()
