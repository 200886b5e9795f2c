"""The optimizer's streaming pipeline: reads run ahead of the step as far as
the budget allows, writes run behind it, and both go into and out of the very
buffers the optimizer's math updates.

Everything here runs on the background loop's thread; the optimizer's
``step()`` (on the caller's thread) hands it work through
:class:`~aionvme.offload._loop.LoopThread` and waits on
``concurrent.futures.Future`` objects.

Buffers are page-aligned uint8 tensors, allocated once and reused from step to
step (a fresh anonymous mapping costs a page fault and a zeroed page per 4 KiB
on its first DMA: ``aionvme bench -w safetensors``' ``fresh_memory_s``, 0.3-1.9 s
per GB on 2 vCPUs). Every byte of them is
counted in the optimizer's ledger, with the chunks it keeps resident: a buffer
is allocated only while the ledger stays within the budget.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from dataclasses import dataclass

import torch

from ..memory import empty
from ._planner import Ledger
from ._state import BlobStore

__all__ = ["Job", "Pipeline"]

_KEYS = itertools.count(1)  # ledger keys of buffers: negative, apart from the chunks' id()s


@dataclass
class Job:
    """One streamed chunk of a step, in the order the step computes them.

    ``key`` None: nothing to read (its state does not exist yet, or its
    layout is unknown); the reader then waits until the step has passed it,
    so that the buffer the step takes for it never waits behind reads ahead.
    """

    pos: int  # its place in the step's order
    key: str | None
    nbytes: int
    done: concurrent.futures.Future[torch.Tensor]  # the buffer, filled


class Pipeline:
    """Buffers under a byte budget, and the reader that keeps them filled."""

    def __init__(self, store: BlobStore, ledger: Ledger, lock: threading.Lock, budget: int) -> None:
        self.store = store
        self.ledger = ledger
        self.lock = lock  # the ledger's (the caller's thread reserves resident chunks in it)
        self.budget = budget
        self.free: list[torch.Tensor] = []  # allocated, counted in the ledger, unused
        self.keys: dict[int, int] = {}  # id(buffer) -> its ledger key
        self.busy = 0  # buffers handed out (being read, computed on or written)
        self.writing = 0
        self.overdrafts = 0  # buffers allocated past the budget (a chunk larger than the room)
        self.allocations = 0  # buffers allocated in all (reused from step to step)
        self.max_reads = 0  # most reads in flight at once
        self.reading = 0
        self.passed = -1  # the step's position: chunks up to it are done with
        self._change: asyncio.Future[None] | None = None
        self._reads: dict[int, asyncio.Task[None]] = {}
        self._writes: set[asyncio.Task[None]] = set()
        self._feeder: asyncio.Task[None] | None = None
        self._jobs: dict[int, Job] = {}

    # -- buffers -----------------------------------------------------------------------

    def _changed(self) -> None:
        w, self._change = self._change, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait_change(self) -> None:
        if self._change is None or self._change.done():
            self._change = asyncio.get_running_loop().create_future()
        # shielded: a waiter cancelled (the step's end cancels the reader) must not cancel
        # the future the other waiters share
        await asyncio.shield(self._change)

    def _new(self, n: int) -> torch.Tensor:
        buf: torch.Tensor = empty(n, "uint8", like="torch")
        self.allocations += 1
        key = -next(_KEYS)
        with self.lock:
            self.ledger.reserve(key, n)
        self.keys[id(buf)] = key
        return buf

    def _drop(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.ledger.release(self.keys.pop(id(buf)))

    async def acquire(self, n: int, *, step: bool) -> torch.Tensor:
        """A buffer of at least ``n`` bytes. Waits while the budget is full and
        buffers in use will come back: any (the reader), or only those being
        written (``step``: the step's own chunk, which the reader's buffers
        wait for). With nothing to wait for, allocates past the budget and
        counts an overdraft: a chunk must be whole in memory to be stepped."""
        while True:
            fits = [j for j, b in enumerate(self.free) if b.numel() >= n]
            best = min(fits, key=lambda j: self.free[j].numel(), default=None)  # the smallest that fits
            with self.lock:
                room = self.ledger.used + n <= self.budget
            # a free buffer much larger than n is taken only when no new one fits: with chunks
            # of mixed sizes, small chunks would otherwise hold the large buffers, and every
            # large chunk would free small ones and allocate again, step after step
            if best is not None and (not room or self.free[best].numel() <= 2 * n):
                buf = self.free.pop(best)
                self.busy += 1
                return buf
            if room:
                buf = self._new(n)
                self.busy += 1
                return buf
            if self.free:  # smaller than n: give their bytes back, then try again
                self._drop(self.free.pop(0))
                continue
            if (self.writing if step else self.busy) > 0:
                await self._wait_change()
                continue
            self.overdrafts += 1
            buf = self._new(n)
            self.busy += 1
            return buf

    def release(self, buf: torch.Tensor) -> None:
        """A buffer back to the free list."""
        self.busy -= 1
        self.free.append(buf)
        self._changed()

    async def keep(self, buf: torch.Tensor, unit: int) -> None:
        """The buffer leaves the pool as a resident chunk's memory, ledger key ``unit``."""
        self.busy -= 1
        key = self.keys.pop(id(buf))
        with self.lock:
            self.ledger.release(key)
            self.ledger.reserve(unit, buf.numel())
        self._changed()

    async def trim(self) -> None:
        """Free the unused buffers (chunks changed size, or the optimizer closes)."""
        while self.free:
            self._drop(self.free.pop())
        self._changed()

    # -- the step's I/O -------------------------------------------------------------------

    async def start(self, jobs: list[Job]) -> None:
        """Begin a step: read every job's state ahead, in order, as buffers allow."""
        self.passed = -1
        self._jobs = {j.pos: j for j in jobs}
        self._feeder = asyncio.get_running_loop().create_task(self._feed(jobs))

    def advance(self, pos: int) -> None:
        """The step has finished with its chunk at ``pos`` (called thread-safely)."""
        self.passed = max(self.passed, pos)
        self._changed()

    async def _feed(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.key is None:
                while self.passed < job.pos:
                    await self._wait_change()
                continue
            buf = await self.acquire(job.nbytes, step=False)
            self.reading += 1
            self.max_reads = max(self.max_reads, self.reading)
            self._reads[job.pos] = asyncio.get_running_loop().create_task(self._read(job, buf))

    async def _read(self, job: Job, buf: torch.Tensor) -> None:
        try:
            await self.store.read_into(job.key, buf[: job.nbytes])  # type: ignore[arg-type]
        except BaseException as e:
            self.reading -= 1
            self.release(buf)
            job.done.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        self.reading -= 1
        job.done.set_result(buf)  # the step takes it from here (or finish() gives it back)

    async def write(self, key: str, buf: torch.Tensor, nbytes: int) -> None:
        """Write ``buf[:nbytes]`` as ``key``; the buffer comes back to the pool
        once written (or failed)."""
        self.writing += 1
        task = asyncio.get_running_loop().create_task(self.store.write(key, buf[:nbytes]))
        self._writes.add(task)
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._end_write(task, buf)
            else:  # the caller was cancelled: the write goes on, its buffer comes back when it ends
                task.add_done_callback(lambda t: self._end_write(t, buf))

    def _end_write(self, task: asyncio.Task[None], buf: torch.Tensor) -> None:
        if task in self._writes:
            self._writes.discard(task)
            self.writing -= 1
            self.release(buf)

    async def finish(self, held: list[torch.Tensor], taken: set[int]) -> None:
        """End the step: stop reading ahead, wait for every read and write, and
        take back the buffers the step still holds (``held``) and those of
        reads it never collected (positions not in ``taken``). Nothing is in
        flight when this returns."""
        if self._feeder is not None:
            self._feeder.cancel()
            await asyncio.gather(self._feeder, return_exceptions=True)
            self._feeder = None
        while True:
            pending = [t for t in [*self._reads.values(), *self._writes] if not t.done()]
            if not pending:
                break
            await asyncio.wait(pending)
        for pos in self._reads:
            job = self._jobs[pos]
            if pos in taken or not job.done.done() or job.done.cancelled():
                continue
            if job.done.exception() is None:
                self.release(job.done.result())
        self._reads.clear()
        self._jobs = {}
        for buf in held:
            self.release(buf)

    async def close(self) -> None:
        await self.trim()
