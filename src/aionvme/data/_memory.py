"""The loader's batch memory: page-aligned buffers (slabs) made on first need
on a worker thread, lent to the consumer with each batch, and reused only
once nothing refers to the batch any more (or, in the counted mode, once
``keep + 1`` later batches were asked for)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..memory import empty
from ._errors import DatasetError
from ._layout import ALIGN, Layout, round_up

__all__ = ["BudgetError", "BudgetWarning", "Lent", "Pool", "Slab", "Workers", "max_batch_nbytes"]


class BudgetError(DatasetError):
    """The prefetch budget cannot hold what the loader needs (a sample, or
    two batches: the one the consumer holds and the one being read)."""


class BudgetWarning(UserWarning):
    """Batches the consumer still refers to hold the whole prefetch budget: the
    loader allocates batch memory beyond it rather than reuse memory under
    them (given once per loader)."""


def _topk_sum(sizes: np.ndarray[Any, Any], k: int) -> int:
    if len(sizes) <= k:
        return int(sizes.sum())
    return int(np.partition(sizes, len(sizes) - k)[len(sizes) - k :].sum())


def max_batch_nbytes(layout: Layout, b: int) -> int:
    """Batch memory the largest possible batch of b samples needs (BatchPlan's layout)."""
    total = 0
    for f in layout.fields.values():
        if f.shape is not None:
            total += round_up(b * (int(f.nbytes[0]) if layout.n else 0))
        else:
            total += _topk_sum((f.nbytes + (ALIGN - 1)) // ALIGN * ALIGN, b)
    if layout.decoded is not None:
        total += _topk_sum((layout.decoded.nbytes + (ALIGN - 1)) // ALIGN * ALIGN, b)
    return total


def _storage_users(t: Any) -> int:
    """How many tensors share t's storage (torch's count; the probe's own reference excluded)."""
    import torch

    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class Slab:
    """One batch buffer: page-aligned host memory (maybe CUDA-pinned) or CUDA memory."""

    __slots__ = ("buf", "owner", "users")

    def __init__(self, nbytes: int, device: str, pin: bool) -> None:
        self.users = 0  # CUDA memory: tensors sharing the storage while the pool alone holds it
        if device != "cpu":
            import torch

            self.owner = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.buf: Any = self.owner
            self.users = _storage_users(self.owner)
        elif pin:
            self.owner = empty(nbytes, like="torch", pinned=True)  # keeps the pinning alive
            self.buf = self.owner.numpy()
        else:
            self.buf = self.owner = empty(nbytes)
            # Touch every page now, on the worker thread that makes the slab
            # (numpy releases the GIL for the loop): else the first io_submit
            # into it faults and zeroes the pages while the batch's reads wait,
            # on the engine's submitter thread for batches over 512 KiB and on
            # the loop thread for smaller ones (perf: clear_page_erms under
            # io_submit; bench/suites/bench_loader.py's first epoch of a new Loader
            # cost 111-119 us CPU/sample instead of ~20 on a VM whose host backs
            # fresh memory on first touch).
            self.buf[::ALIGN] = 0

    def lend(self, nbytes: int) -> tuple[Any, Lent]:
        """The memory a batch is assembled from, and what tells when the consumer let go of it.

        Host memory: a fresh array over a memoryview of the slab, so that every
        view of it, numpy's or torch's (``torch.from_numpy`` keeps the array),
        keeps this one array alive and nothing else: a weak reference to it
        dies exactly when the last view does. CUDA memory: torch's count of
        tensors sharing the slab's storage.
        """
        if isinstance(self.buf, np.ndarray):
            part = np.frombuffer(self.buf[:nbytes].data, dtype=np.uint8)
            return part, Lent(self, weakref.ref(part))
        return self.buf, Lent(self, None)


class Lent:
    """A slab handed out with a batch: free again once nothing refers to the batch."""

    __slots__ = ("ref", "slab")

    def __init__(self, slab: Slab, ref: weakref.ref[Any] | None) -> None:
        self.slab = slab
        self.ref = ref

    def in_use(self) -> bool:
        if self.ref is not None:
            return self.ref() is not None
        return _storage_users(self.slab.owner) > self.slab.users


class Workers:
    """The loader's worker threads (made on first use): slabs are made and
    checksums verified there, off the event loop."""

    def __init__(self) -> None:
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="aionvme-data")
        return self.pool

    def shutdown(self, wait: bool = True) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=wait)
            self.pool = None


class Pool:
    """At most ``limit`` slabs, made on first need (on a worker thread: see
    :class:`Slab`) and reused for the loader's life.

    Slabs lent to the consumer and still referenced when their pass ended
    wait in ``lent`` until the consumer lets go of them. :meth:`grow` makes a
    slab beyond ``limit`` (the consumer holds every slab and waits for the
    next batch); such a slab is freed, not kept, when it comes back.
    """

    def __init__(
        self,
        nbytes: int,
        limit: int,
        device: str,
        pin: bool,
        executor: Callable[[], concurrent.futures.Executor] | None = None,
    ) -> None:
        self.nbytes, self.limit, self.device, self.pin = nbytes, limit, device, pin
        self.executor = executor
        self.made = 0
        self.peak = 0
        self.grown = 0  # slabs made beyond the limit, over the pool's life
        self.free: list[Slab] = []
        self.lent: list[Lent] = []
        self.waiters: collections.deque[asyncio.Future[Slab]] = collections.deque()

    def reclaim(self) -> None:
        """Take back the lent slabs nothing refers to any more."""
        if self.lent:
            still = []
            for x in self.lent:
                if x.in_use():
                    still.append(x)
                else:
                    self.put(x.slab)
            self.lent = still

    async def get(self, on_wait: Callable[[], None] | None = None) -> Slab:
        """A free slab, a new one while fewer than ``limit`` were made, else
        wait for one (``on_wait`` is called once the wait is registered)."""
        if not self.free:
            self.reclaim()
        if self.free:
            return self.free.pop()
        if self.made < self.limit:
            return await self._make()
        fut: asyncio.Future[Slab] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        if on_wait is not None:
            on_wait()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slab, then cancelled: keep it
                self.free.append(fut.result())
            raise

    async def _make(self) -> Slab:
        self.made += 1
        self.peak = max(self.peak, self.made)
        if self.executor is None:
            return Slab(self.nbytes, self.device, self.pin)
        made = asyncio.get_running_loop().run_in_executor(
            self.executor(), Slab, self.nbytes, self.device, self.pin
        )
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            if made.cancelled() or not made.done() or made.exception() is not None:
                made.add_done_callback(self._adopt)
            else:
                self.put(made.result())
            raise
        except BaseException:
            self.made -= 1
            raise

    def grow(self) -> asyncio.Task[None]:
        """Make one slab beyond the limit for the first waiter (or the free list)."""
        self.grown += 1

        async def make() -> None:
            self.put(await self._make())

        return asyncio.get_running_loop().create_task(make())

    def _adopt(self, made: asyncio.Future[Slab]) -> None:
        # a slab whose maker was cancelled while the worker made it: keep it for the next get
        if made.cancelled() or made.exception() is not None:
            self.made -= 1
        else:
            self.put(made.result())

    def put(self, slab: Slab) -> None:
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                w.set_result(slab)
                return
        if self.made > self.limit:  # made beyond the budget: give the memory back
            self.made -= 1
            return
        self.free.append(slab)

    def give_back(self, lent: Lent, counted: bool) -> None:
        """A slab the consumer had: free now (counted mode, or nothing refers
        to it), else kept aside until nothing does."""
        if counted or not lent.in_use():
            self.put(lent.slab)
        else:
            self.lent.append(lent)

    def drop_waiters(self) -> None:
        while self.waiters:
            w = self.waiters.popleft()
            if w.done() and not w.cancelled():
                self.free.append(w.result())
            else:
                w.cancel()


def warn_over_budget(prefetch: int, nbytes: int) -> None:
    import warnings

    warnings.warn(
        BudgetWarning(
            f"the batches this loop still holds fill prefetch={prefetch}: the loader allocates "
            f"batch memory beyond it ({nbytes} bytes a batch) instead of reusing memory under "
            "them; drop references to old batches (or .clone() what you keep) to stay within it"
        ),
        stacklevel=2,
    )
