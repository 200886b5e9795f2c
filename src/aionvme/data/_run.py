"""One pass of a :class:`~aionvme.data.Loader` over an epoch: the read-ahead
(a producer task planning batches and reading them into batch memory), the
consumer's side (the next batch, handed out once), and closing it, also when
the consumer just drops its iterator (``break``)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from .._runtime.background import cancel_at_exit, current
from ._batch import BatchPlan
from ._elastic import Phases
from ._layout import FileCache, Layout
from ._memory import Lent, Pool, Slab, warn_over_budget

__all__ = ["AsyncIter", "Run", "Stats", "clone", "close_run"]


class Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.samples = 0
        self.batches = 0
        self.bytes = 0
        self.consumer_wait = 0.0
        self.io_wait = 0.0
        self.memory_wait = 0.0
        self.started: float | None = None


class Loader(Protocol):
    """What a pass uses of its :class:`~aionvme.data.Loader` (named here, not
    imported: the loader's module imports this one)."""

    layout: Layout
    batch_size: int
    drop_last: bool
    copy: bool
    verify: bool
    prefetch: int
    slab_nbytes: int
    transform: Callable[[dict[str, Any]], Any] | None
    _epoch: int
    _position: int
    _resumed: Phases
    _generation: int
    _active: Run | None
    _stats: Stats
    _pool: Pool
    _files: FileCache
    _keep: int | None
    _read_ahead: int
    _slow_assembly: bool
    _warned: bool

    def _prepare(self, epoch: int, resumed: Phases) -> np.ndarray[Any, Any]: ...
    def _executor(self) -> concurrent.futures.ThreadPoolExecutor: ...
    def _deliver(self, plan: BatchPlan, slab: Slab) -> tuple[dict[str, Any], Lent]: ...


class Run:
    """One pass over this rank's samples of the current epoch, from the current position."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.epoch = loader._epoch
        self.start = loader._position
        self.resumed = loader._resumed  # the epoch's earlier phases (elastic resume)
        self.gen = loader._generation
        self.ready: asyncio.Queue[tuple[asyncio.Task[BatchPlan], Slab, int] | BaseException | None] | None = (
            None
        )
        self.producer: asyncio.Task[None] | None = None
        self.inflight: list[tuple[asyncio.Task[BatchPlan], Slab]] = []
        self.held: collections.deque[Lent] = collections.deque()  # handed out, maybe still in use
        self.waiting: tuple[asyncio.Task[BatchPlan], Slab, int] | None = None  # taken from ready, being read
        self.undelivered: tuple[BatchPlan, Slab, int] | None = None  # read, not yet committed
        self.reading = 0  # batches whose reads are in flight
        self.read_done = asyncio.Event()  # set when a batch's reads end
        self.producer_waiting = False
        self.consumer_waiting = False
        self.growing = False
        self.idle_since: float | None = None  # no read in flight, the producer waiting for memory
        self.closed = False
        self.ended = False  # the producer's end-of-epoch mark was taken from the queue
        self.closing: asyncio.Task[None] | None = None
        self.t0 = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None

    async def _begin(self) -> None:
        ld = self.loader
        old = ld._active
        self.loop = asyncio.get_running_loop()
        if old is not None and old is not self:
            if old.loop is not self.loop:
                raise RuntimeError(
                    "an iteration of this loader is still open on another event loop: "
                    "close it first (await loader.aclose() there, or let the for loop end)"
                )
            await old.aclose()
        ld._active = self
        self.t0 = time.perf_counter()
        if ld._stats.started is None:
            ld._stats.started = self.t0
        # off the loop: a permutation of 10M ids, a stat of every file (changed since the open?)
        part = await asyncio.to_thread(ld._prepare, self.epoch, self.resumed)
        self.ready = asyncio.Queue()
        self.producer = asyncio.get_running_loop().create_task(self._produce(part))
        # it may wait for the consumer forever: exit must not wait for it
        cancel_at_exit(self.producer)

    def _unstick(self) -> None:
        """The consumer waits for a batch, the producer for memory, nothing is
        being read: every slab holds a batch the consumer still refers to.
        Rather than wait forever (or reuse memory under those batches), make
        one more slab beyond the budget (warned about once, by the consumer)."""
        ld = self.loader
        if (
            ld._keep is None
            and self.consumer_waiting
            and self.producer_waiting
            and self.reading == 0
            and not self.growing
            and self.ready is not None
            and self.ready.empty()
        ):
            ld._pool.reclaim()  # (hands what it frees to the producer)
            if any(not w.done() for w in ld._pool.waiters):
                self.growing = True
                task = ld._pool.grow()
                task.add_done_callback(self._grown)

    def _grown(self, task: asyncio.Task[None]) -> None:
        self.growing = False
        if not task.cancelled() and task.exception() is not None and self.ready is not None:
            self.ready.put_nowait(task.exception())  # the consumer gets it instead of waiting forever

    async def _produce(self, part: np.ndarray[Any, Any]) -> None:
        ld = self.loader
        ready = self.ready
        if ready is None:  # pragma: no cover - set by _begin
            return
        try:
            pos, b = self.start, ld.batch_size
            while pos < len(part):
                idx = part[pos : pos + b]
                if len(idx) < b and ld.drop_last:
                    break
                while self.reading >= ld._read_ahead:
                    # enough batches are being read to keep the engine's bytes in
                    # flight full: more would only queue, in batch memory that a
                    # consumer faster than the disk never needs (slabs are made
                    # on first need, so the pool stays small when I/O-bound)
                    self.read_done.clear()
                    await self.read_done.wait()
                t = time.perf_counter()
                self.producer_waiting = True
                if self.reading == 0:
                    self.idle_since = t
                try:
                    slab = await ld._pool.get(self._unstick)
                finally:
                    self.producer_waiting = False
                    now = time.perf_counter()
                    ld._stats.memory_wait += now - t
                    if self.idle_since is not None:
                        ld._stats.io_wait += now - self.idle_since
                        self.idle_since = None
                try:
                    plan = BatchPlan(ld.layout, idx)
                except BaseException:
                    ld._pool.put(slab)
                    raise
                self.reading += 1
                task = asyncio.get_running_loop().create_task(self._read(plan, slab))
                self.inflight.append((task, slab))
                pos += len(idx)
                ready.put_nowait((task, slab, pos))
                await asyncio.sleep(0)  # let the batch's reads go out before planning the next
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the consumer gets it instead of waiting forever
            ready.put_nowait(e)
            return
        ready.put_nowait(None)

    async def _read(self, plan: BatchPlan, slab: Slab) -> BatchPlan:
        ld = self.loader
        try:
            await plan.read(ld.layout, ld._files, slab.buf)
        finally:
            self.reading -= 1
            self.read_done.set()
            if self.reading == 0 and self.producer_waiting and self.idle_since is None:
                self.idle_since = time.perf_counter()  # nothing to read until the consumer frees memory
        if ld.verify:
            await asyncio.get_running_loop().run_in_executor(ld._executor(), plan.verify, ld.layout, slab.buf)
        return plan

    def _release(self) -> None:
        """Give back the memory of batches handed out that the consumer is done with.

        By reference (``keep=None``): every batch nothing refers to any more.
        Counted (``keep=k``): all but the last k, referenced or not."""
        ld = self.loader
        keep = ld._keep
        if keep is None:
            if self.held:
                still: collections.deque[Lent] = collections.deque()
                for x in self.held:
                    if x.in_use():
                        still.append(x)
                    else:
                        ld._pool.put(x.slab)
                self.held = still
            ld._pool.reclaim()
        else:
            while len(self.held) > keep:
                ld._pool.put(self.held.popleft().slab)

    async def next(self) -> tuple[BatchPlan, Slab] | None:
        """The next batch's plan and memory (read and checked), or None at the end of the epoch.

        Asking for a new batch frees the memory of the batches handed out
        that the consumer no longer refers to (counted mode: all but the last
        ``keep``). A batch counts as handed out at :meth:`commit`; until then
        (the consumer was cancelled while it waited, or while the batch was
        being assembled) the same batch is given again."""
        ld = self.loader
        if self.undelivered is not None:
            return self.undelivered[:2]
        if self.ended:
            self._end()
            return None
        if self.closed:
            return None
        if self.ready is None:
            await self._begin()
        ready = self.ready
        if ready is None:  # pragma: no cover
            return None
        self._release()
        t = time.perf_counter()
        if self.waiting is None:
            self.consumer_waiting = True
            try:
                self._unstick()
                item = await ready.get()  # cancelled here: the item stays in the queue
            finally:
                self.consumer_waiting = False
            if isinstance(item, BaseException):
                await self.aclose()
                raise item
            if item is None:
                # The epoch ends for the consumer when it is told so: a consumer cancelled
                # while the pass closes is told at its next call (or a new pass finds
                # nothing left of the epoch), never handed the next epoch instead.
                self.ended = True
                await self.aclose()
                self._end()
                return None
            self.waiting = item
        task, slab, pos = self.waiting
        try:
            # shield: a consumer cancelled here leaves the read running; the next call awaits it again
            plan = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            self.waiting = None
            await self.aclose()
            raise
        except BaseException:
            self.waiting = None
            await self.aclose()
            raise
        self.waiting = None
        self.inflight = [x for x in self.inflight if x[0] is not task]
        ld._stats.consumer_wait += time.perf_counter() - t
        self.undelivered = (plan, slab, pos)
        return plan, slab

    def _end(self) -> None:
        """The end of the epoch reached the consumer: the loader moves to the next one
        (once: a second call finds the generation moved on)."""
        ld = self.loader
        if ld._generation == self.gen:
            ld._epoch += 1
            ld._position = 0
            ld._resumed = ()
            ld._generation += 1

    def commit(self, lent: Lent) -> None:
        """The batch from :meth:`next` reached the consumer: it counts as handed out."""
        got = self.undelivered
        if got is None:  # pragma: no cover
            return
        plan, _slab, pos = got
        self.undelivered = None
        ld = self.loader
        self.held.append(lent)
        if ld._generation == self.gen:
            ld._position = pos
        st = ld._stats
        st.batches += 1
        st.samples += len(plan.idx)
        st.bytes += plan.data_nbytes
        if ld._pool.grown and not ld._warned:
            ld._warned = True
            warn_over_budget(ld.prefetch, ld.slab_nbytes)

    async def aclose(self) -> None:
        """Stop: no new reads; wait for those in flight (their memory stays
        untouched by the kernel after this returns); give the slabs back (a
        slab whose batch the consumer still refers to: once it no longer
        does). Callers at the same time all wait for the one closing."""
        if self.closing is None:
            if self.closed:
                return
            self.closed = True
            self.closing = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self.closing)

    async def _close(self) -> None:
        ld = self.loader
        if self.producer is not None and not self.producer.done():
            self.producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.producer
        ld._pool.drop_waiters()
        for task, slab in self.inflight:
            with contextlib.suppress(BaseException):  # raised to the consumer already, or unwanted
                await asyncio.shield(task)
            ld._pool.put(slab)
        self.inflight.clear()
        counted = ld._keep is not None
        while self.held:
            ld._pool.give_back(self.held.popleft(), counted)
        if self.undelivered is not None:
            ld._pool.put(self.undelivered[1])
            self.undelivered = None
        self.waiting = None
        if ld._active is self:
            ld._active = None


def clone(batch: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, list):
            out[k] = [
                x.clone() if hasattr(x, "clone") else (x.copy() if hasattr(x, "copy") else x) for x in v
            ]
        else:
            out[k] = v.clone() if hasattr(v, "clone") else v.copy()
    return out


def close_run(run: Run) -> None:
    """Close a plain-``for`` pass on the background loop: wait for it, or (when
    the pass is finalised on the loop's own thread, by the garbage collector)
    schedule it there."""
    if run.closed:
        return
    if run.loop is None:  # never began: nothing runs
        run.closed = True
        return
    bg = current()
    if bg is None or run.loop is not bg.loop:
        # begun in the parent process (fork), or the loop was stopped at
        # interpreter exit (which cancelled the read-ahead): nothing to wait for
        return
    if threading.current_thread() is bg.thread:
        _keep_until_done(bg.loop.create_task(run.aclose()))
    else:
        bg.run(run.aclose())


_closing: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks


def _keep_until_done(task: asyncio.Task[None]) -> None:
    _closing.add(task)
    task.add_done_callback(_closing.discard)


def _close_later(run: Run) -> None:
    """Schedule closing a pass whose iterator was dropped (``break`` out of
    ``async for``), on the pass's own loop, from whatever thread drops it."""
    loop = run.loop
    if run.closed or loop is None or loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        _keep_until_done(loop.create_task(run.aclose()))
    else:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: its tasks went with it
            loop.call_soon_threadsafe(lambda: _keep_until_done(loop.create_task(run.aclose())))


class AsyncIter:
    """``async for`` over one pass: closing it (or the epoch's end) stops reading ahead.

    ``break`` drops the iterator without closing it: then its finalizer
    schedules the close on the loop (the read-ahead stops, its memory comes
    back), as the loop's hooks do for an async generator. (Not an async
    generator itself: a consumer cancelled while it waits keeps its
    iterator, and the same batch comes next.)"""

    def __init__(self, loader: Loader, run: Run) -> None:
        self.loader = loader
        self.run = run

    def __aiter__(self) -> AsyncIter:
        return self

    async def __anext__(self) -> dict[str, Any]:
        got = await self.run.next()
        if got is None:
            raise StopAsyncIteration
        ld = self.loader
        if ld.copy or ld._slow_assembly:  # decoding, copying, many views: off the loop
            batch, lent = await asyncio.to_thread(ld._deliver, *got)
        else:
            batch, lent = ld._deliver(*got)
        self.run.commit(lent)
        tf = self.loader.transform
        return tf(batch) if tf is not None else batch

    async def aclose(self) -> None:
        await self.run.aclose()

    def __del__(self) -> None:
        run = getattr(self, "run", None)
        if run is not None and not run.closed:
            _close_later(run)
