"""The memory tiers: host (one page-aligned arena, pinned where CUDA is
available, carved by an extent allocator) and GPU (CUDA tensors, counted
against a byte budget). Each has its policy, its resident entries, a FIFO lock
for making room and a list of waiters woken when room may have appeared."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import memory
from ._alloc import ALIGN, ExtentAllocator, round_up
from ._errors import StoreTimeoutError
from ._policy import EvictionPolicy

__all__ = ["GpuTier", "HostTier", "MemTier"]


class MemTier:
    """Bookkeeping shared by the host and GPU tiers."""

    name = "mem"

    def __init__(self, capacity: int, policy: Callable[[], EvictionPolicy]) -> None:
        self.capacity = capacity
        self.policy = policy()
        # the entries with a copy here (an Entry is its own handle: several
        # versions of one key may coexist while a put is in progress)
        self.entries: dict[Any, None] = {}
        self._lock: asyncio.Lock | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self.stats: dict[str, float] = {
            "hits": 0,
            "misses": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "evictions": 0,
            "wait_s": 0.0,
        }

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    @property
    def used(self) -> int:
        raise NotImplementedError

    def notify(self) -> None:
        """Room may have appeared (bytes freed, an entry released): wake the waiters."""
        ws, self._waiters = self._waiters, []
        for w in ws:
            if not w.done():
                w.set_result(None)

    async def wait_change(self, deadline: float | None, what: str) -> None:
        """Wait for notify(); StoreTimeoutError past the deadline."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        t0 = loop.time()
        try:
            if deadline is None:
                await fut
            else:
                remaining = deadline - t0
                if remaining <= 0:
                    raise StoreTimeoutError(f"timed out waiting for room in the {self.name} tier for {what}")
                try:
                    await asyncio.wait_for(fut, remaining)
                except asyncio.TimeoutError:
                    raise StoreTimeoutError(
                        f"timed out waiting for room in the {self.name} tier for {what} "
                        f"({self.used} of {self.capacity} bytes used, all of it held or in flight)"
                    ) from None
        finally:
            self.stats["wait_s"] += loop.time() - t0
            if fut in self._waiters:
                self._waiters.remove(fut)

    def add(self, entry: Any) -> None:
        if entry not in self.entries:
            self.entries[entry] = None
            self.policy.insert(entry, entry.nbytes)
            self.stats["bytes_in"] += entry.nbytes
            # a new candidate for eviction: a waiter that found nothing to evict
            # while this entry was being filled must look again
            self.notify()

    def discard(self, entry: Any) -> None:
        if entry in self.entries:
            del self.entries[entry]
            self.policy.remove(entry)

    def touch(self, entry: Any) -> None:
        if entry in self.entries:
            self.policy.touch(entry)


class HostTier(MemTier):
    """Host memory: one arena of ``capacity`` bytes, page-aligned (O_DIRECT
    zero-copy), pinned for CUDA when ``pinned``. Values occupy aligned extents."""

    name = "host"

    def __init__(self, capacity: int, policy: Callable[[], EvictionPolicy], pinned: bool) -> None:
        capacity = capacity - capacity % ALIGN
        super().__init__(capacity, policy)
        self.pinned = pinned
        if capacity == 0:
            self.arena: Any = np.empty(0, np.uint8)
        elif pinned:
            t = memory.empty(capacity, "uint8", like="torch", pinned=True)
            self.arena = t.numpy()  # same memory; the tensor's storage keeps the pin alive
            self._pinned_tensor = t
        else:
            self.arena = memory.empty(capacity, "uint8")
        self.alloc = ExtentAllocator(capacity)

    @property
    def used(self) -> int:
        return self.alloc.used

    def try_alloc(self, nbytes: int, phase: int = 0) -> int | None:
        """The arena offset of nbytes, ``phase`` bytes into its first page (the
        phase of the value's extent on NVMe: reads and writes of it are then
        zero-copy but for the end blocks), or None when there is no room."""
        off = self.alloc.alloc(nbytes + phase)
        return None if off is None else off + phase

    def free(self, off: int, nbytes: int) -> None:
        p = off % ALIGN
        self.alloc.free(off - p, nbytes + p)
        self.notify()

    release = free  # the tier interface (see _tiers.Tier)

    def view(self, off: int, nbytes: int, whole_pages: bool = False) -> Any:
        """The arena's bytes of a value (1-D uint8), page-rounded if whole_pages."""
        n = round_up(nbytes) if whole_pages else nbytes
        return self.arena[off : off + n]


class GpuTier(MemTier):
    """CUDA memory: each value is its own uint8 CUDA tensor; ``capacity`` bounds the sum."""

    name = "gpu"

    def __init__(self, capacity: int, policy: Callable[[], EvictionPolicy], device: str) -> None:
        super().__init__(capacity, policy)
        self.device = device
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    def try_alloc(self, nbytes: int, phase: int = 0) -> Any | None:
        if self._used + round_up(nbytes) > self.capacity:
            return None
        import torch

        t = torch.empty(round_up(nbytes), dtype=torch.uint8, device=self.device)
        self._used += round_up(nbytes)
        return t

    def free(self, t: Any, nbytes: int) -> None:
        del t
        self._used -= round_up(nbytes)
        self.notify()

    release = free  # the tier interface (see _tiers.Tier)

    def view(self, t: Any, nbytes: int, whole_pages: bool = False) -> Any:
        """A value's bytes in its tensor (1-D uint8), page-rounded if whole_pages."""
        return t[: round_up(nbytes) if whole_pages else nbytes]
