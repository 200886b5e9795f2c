"""Pinned host memory: page-locking for CUDA, the memlock budget, and the
process's pool of bounce buffers."""

from __future__ import annotations

import asyncio
import collections
import os
import resource
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import defaults
from .._engine import AlignedBuffer
from ..exceptions import DeviceError, os_error
from . import cuda
from .cuda import require_cuda


def host_unregister(address: int) -> None:
    # An AlignedBuffer's release hook: runs from its deallocator, so it must
    # not raise; a failure (at exit CUDA may be gone already) is counted.
    torch = sys.modules.get("torch")
    try:
        rc = int(torch.cuda.cudart().cudaHostUnregister(address)) if torch is not None else -1
    except Exception:  # reported through stats, never raised from a deallocator
        rc = -1
    if rc != 0:
        cuda.stats["pinned_unregister_errors"] += 1


def pin(buf: AlignedBuffer) -> None:
    """Page-lock buf for CUDA (``cudaHostRegister``, portable to every device)
    until it is freed: it is unregistered just before its pages are unmapped.

    Raises DeviceError without CUDA, OSError (ENOMEM) when CUDA refuses.
    """
    torch = require_cuda("pinned memory")
    n = max(len(buf), 1)
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.address, n, 1))  # 1: cudaHostRegisterPortable
    if rc != 0:
        import errno

        raise os_error(errno.ENOMEM, None, nbytes=n, op=f"cudaHostRegister (cudaError {rc})")
    buf.set_release_hook(host_unregister)


_CAP_IPC_LOCK = 14  # linux/capability.h


def has_cap_ipc_lock() -> bool | None:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _locked_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def memlock_budget() -> int | None:
    """Bytes this process may still page-lock, or None when unbounded
    (RLIMIT_MEMLOCK unlimited, or CAP_IPC_LOCK)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or has_cap_ipc_lock():
        return None
    return max(0, soft - _locked_bytes())


class Slot:
    __slots__ = ("array", "index", "tensor")

    def __init__(self, index: int, array: np.ndarray, tensor: Any) -> None:
        self.index = index
        self.array = array  # uint8 numpy view: what the engine reads into / writes from
        self.tensor = tensor  # the same memory as a torch uint8 tensor (copies)


class _Waiter:
    """A blocking acquirer's place in the queue."""

    __slots__ = ("event", "slot")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.slot: Slot | None = None


class PinnedPool:
    """A fixed set of page-aligned host buffers (slots) shared by every
    transfer of the process, pinned once. Waiters are served in order;
    async waiters on any loop, blocking ones on any thread.

    Parameters
    ----------
    slot_size, nslots : int
    pin : callable or None
        Called with the AlignedBuffer holding every slot (``gpu.pin`` for
        CUDA); None leaves it pageable.
    """

    def __init__(self, slot_size: int, nslots: int, pin: Callable[[AlignedBuffer], None] | None) -> None:
        import torch

        self.slot_size = slot_size
        self.nslots = nslots
        self.pid = os.getpid()
        self.buffer = AlignedBuffer(slot_size * nslots)
        self.pinned = False
        self.why_not_pinned: str | None = "not requested"
        if pin is not None:
            try:
                pin(self.buffer)
                self.pinned, self.why_not_pinned = True, None
            except (OSError, DeviceError) as e:
                self.why_not_pinned = str(e)
        whole = np.frombuffer(memoryview(self.buffer), dtype=np.uint8)
        whole_t = torch.from_numpy(whole)
        self._free: collections.deque[Slot] = collections.deque(
            Slot(i, whole[i * slot_size : (i + 1) * slot_size], whole_t[i * slot_size : (i + 1) * slot_size])
            for i in range(nslots)
        )
        self._waiters: collections.deque[asyncio.Future[Slot] | _Waiter] = collections.deque()
        self._mu = threading.Lock()

    def describe(self) -> dict[str, Any]:
        return dict(
            slot_size=self.slot_size,
            slots=self.nslots,
            free=len(self._free),
            pinned=self.pinned,
            why_not_pinned=self.why_not_pinned,
        )

    async def acquire(self) -> Slot:
        loop = asyncio.get_running_loop()
        with self._mu:
            if self._free and not self._waiters:
                return self._free.popleft()
            fut: asyncio.Future[Slot] = loop.create_future()
            self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            with self._mu:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                    raise
            # a slot was handed over as the wait was cancelled: pass it on
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            raise

    def acquire_blocking(self) -> Slot:
        with self._mu:
            if self._free and not self._waiters:
                return self._free.popleft()
            w = _Waiter()
            self._waiters.append(w)
        w.event.wait()
        if w.slot is None:
            raise RuntimeError("pinned pool handed over no slot")
        return w.slot

    def release(self, slot: Slot) -> None:
        """Give slot to the first waiter, or back to the free list."""
        with self._mu:
            while self._waiters:
                w = self._waiters.popleft()
                if isinstance(w, _Waiter):
                    w.slot = slot
                    w.event.set()
                    return
                if w.done():
                    continue  # cancelled while waiting
                w.get_loop().call_soon_threadsafe(self._hand_over, w, slot)
                return
            self._free.append(slot)

    def _hand_over(self, fut: asyncio.Future[Slot], slot: Slot) -> None:
        if fut.done():
            self.release(slot)  # its waiter was cancelled meanwhile
        else:
            fut.set_result(slot)


_pool: PinnedPool | None = None


def pool() -> PinnedPool:
    """The process's bounce buffers, made on first use: ``pinned_pool`` bytes
    in slots of ``gpu_block_size``, fewer where RLIMIT_MEMLOCK is lower (at
    least two). Without room for two pinned slots, or when CUDA refuses to
    pin, the slots stay pageable and a RuntimeWarning says so."""
    global _pool
    p = _pool
    if p is not None and p.pid == os.getpid():
        return p
    with cuda.lock:
        if _pool is not None and _pool.pid == os.getpid():
            return _pool
        s = defaults.settings
        slot = s.gpu_block_size
        nslots = max(2, s.pinned_pool // slot)
        budget = memlock_budget()
        pin_it: Callable[[AlignedBuffer], None] | None = pin
        why = None
        if budget is not None:
            if budget < 2 * slot:
                pin_it = None
                why = f"RLIMIT_MEMLOCK leaves {budget} bytes, less than two {slot}-byte buffers"
            else:
                nslots = min(nslots, budget // slot)
        p = PinnedPool(slot, nslots, pin_it)
        if why is not None:
            p.why_not_pinned = why
        if not p.pinned:
            warnings.warn(
                f"aionvme: the GPU bounce buffers are not pinned ({p.why_not_pinned}); copies to and "
                "from the GPU run synchronously on a helper thread and are slower",
                RuntimeWarning,
                stacklevel=3,
            )
        _pool = p
        return p


def describe() -> dict[str, Any] | None:
    """The pool's state, or None before its first use."""
    return _pool.describe() if _pool is not None else None


def forget() -> None:
    """Drop the process's reference to the pool (its memory goes with the last slot view)."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=forget)
