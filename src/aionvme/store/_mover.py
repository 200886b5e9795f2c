"""The mover: loads values into a tier, demotes them out of it and makes
room, over the ordered tiers ``[gpu, host, nvme]`` (hottest first).

A value's copies live in one map (``Entry.copies``: tier name -> Copy), and
each tier does the same few things behind :class:`_tiers.Tier` (allocate,
release, notify, view), so every move is written once: ``load`` brings a
value into a tier from the hottest other tier that has it, ``demote`` moves a
memory tier's victims colder (dropped where another copy exists, else loaded
into the host tier or written to NVMe), ``write_out`` writes values to NVMe.
Every reference a move takes on a copy belongs to a :class:`_tiers.Pins` or
:class:`_tiers.WriteOut`, given back on every path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from ._alloc import ALIGN, round_up
from ._errors import StoreFullError, StoreTimeoutError
from ._memtier import GpuTier, HostTier, MemTier
from ._nvme import Extents, NvmeTier, phase_of
from ._tiers import GPU, HOST, NVME, Entry, Pins, WriteOut
from ._values import address, is_cuda

__all__ = ["COPY_SLICE", "Mover", "as_torch", "copy_into", "read_job"]

COPY_SLICE = 4 << 20  # a large copy is split into slices of at least this many bytes, one per thread


def as_torch(a: Any) -> Any:
    import torch

    return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)


def copy_into(dst: Any, src: Any) -> None:
    """dst[:] = src for flat uint8 numpy arrays / torch tensors (the GIL is released)."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        as_torch(dst).copy_(as_torch(src))


def read_job(ext: Any, raw: Any, span: Any, nbytes: int) -> tuple[Any, ...]:
    """The NVMe tier's read job for a value's extents into ``raw`` (its bytes),
    given ``span``: page-aligned whole pages that hold raw, or None. A
    one-piece slab extent at raw's phase in the span is read whole into the
    span (one aligned transfer, no bounce); else raw, in whole pages when it
    has them."""
    if (
        span is not None
        and len(ext) == 1
        and ext[0][0] >= 0
        and ext[0][1] % ALIGN == address(raw) - address(span)
    ):
        return (ext, span, True)
    if span is not None and address(raw) == address(span):
        raw = span  # a page-aligned result: whole pages (striped pieces)
    whole = len(raw) >= round_up(nbytes)
    return (ext, raw if whole else raw[:nbytes])


class Mover:
    """Moves values between the tiers of one store (see the module's notes).

    ``tasks``: every background task of the store (loads, write-behind);
    ``errors``: failures of loads nobody awaited; ``cleaning``: the
    write-behind batches in flight (:mod:`._cleaner` starts them; making room
    in the host tier waits for them rather than evict hotter values);
    ``dirty``: host values put with no other copy, oldest first.
    """

    def __init__(self, host: HostTier, gpu: GpuTier | None, nvme: NvmeTier) -> None:
        self.host = host
        self.gpu = gpu
        self.nvme = nvme
        self.tiers: dict[str, Any] = {GPU: gpu, HOST: host, NVME: nvme} if gpu else {HOST: host, NVME: nvme}
        self.tasks: set[asyncio.Task[Any]] = set()
        # loads started by a get or prefetch that do not wait for room: a hold
        # that joins one and sees it fail starts its own
        self.nowait_loads: set[asyncio.Task[None]] = set()
        self.errors: list[BaseException] = []
        self.cleaning: set[asyncio.Task[None]] = set()
        self.dirty: dict[Entry, None] = {}
        self.copy_threshold = 8 << 20  # bigger copies run on threads (the loop never stalls long)
        self.copy_threads = 8
        self.copy_slice = COPY_SLICE
        self.copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
        # guards Entry.pins and Entry.dead (pins are taken on any thread, see Entry)
        self.pin_lock = threading.Lock()
        # a key's pins follow it to its new value (set by the store, see _kv.PinTable)
        self.handover: Callable[[Entry, Entry], None] = lambda old, new: None

    def note_error(self, exc: BaseException) -> None:
        self.errors.append(exc)
        del self.errors[:-16]

    # -- counts and copies --------------------------------------------------------------

    def pins(self, tier: str, *entries: Entry) -> Pins:
        """References on the entries' copies in ``tier`` (``with`` gives them back)."""
        return Pins(tier, entries, self.unref)

    def unref(self, e: Entry, tier: str) -> None:
        c = e.copies[tier]
        c.refs -= 1
        if c.refs == 0:
            if e.dead:
                self.settle(e)
            else:
                self.tiers[tier].notify()

    def settle(self, e: Entry) -> None:
        """Free each copy of a dead entry that nobody uses any more (a pinned
        one's when its last pin goes: :meth:`_kv.PinTable.unpin` calls this again)."""
        if e.pins:
            return
        for name, c in e.copies.items():
            if c.where is not None and c.refs == 0:
                where, c.where = c.where, None
                self.tiers[name].release(where, e.nbytes)

    def retire(self, e: Entry) -> None:
        """The entry was replaced or deleted: free each copy now, or when its last user ends."""
        with self.pin_lock:
            e.dead = True
        self.dirty.pop(e, None)
        for name in (GPU, HOST):
            t = self.tiers.get(name)
            if t is not None:
                t.discard(e)
        self.settle(e)

    def drop(self, e: Entry, tier: str) -> None:
        """Evict a live entry's copy from a memory tier (it has another copy)."""
        c = e.copies.get(tier)
        t = self.tiers.get(tier)
        if c is None or c.where is None or t is None:
            return
        t.discard(e)
        if tier == HOST:
            self.dirty.pop(e, None)
        where, c.where = c.where, None
        t.release(where, e.nbytes)
        t.stats["evictions"] += 1
        t.stats["bytes_out"] += e.nbytes

    def view(self, tier: str, e: Entry, whole_pages: bool = False) -> Any:
        """The bytes of e's copy in a memory tier (flat uint8)."""
        return self.tiers[tier].view(e.at(tier), e.nbytes, whole_pages)

    @staticmethod
    def elsewhere(e: Entry, tier: str) -> bool:
        """e has a copy in another tier than ``tier``."""
        return any(c.where is not None for n, c in e.copies.items() if n != tier)

    # -- making room ---------------------------------------------------------------------

    @staticmethod
    def evictable(tier: MemTier, e: Entry) -> bool:
        c = e.copies.get(tier.name)
        return c is not None and c.where is not None and not c.refs and not c.claims and c.loading is None

    async def make_room(
        self,
        tier: MemTier,
        nbytes: int,
        deadline: float | None,
        what: str,
        wait: bool = True,
        phase: int = 0,
        moot: Callable[[], bool] | None = None,
    ) -> Any:
        """Allocate nbytes in a memory tier, evicting colder as needed; waits
        (FIFO among callers) while everything evictable is held or in flight.
        ``phase``: the host tier places the bytes that far into a page.
        ``moot``: the room is no longer needed once this is true (a load whose
        value reached the tier another way): then None, without allocating.
        A failed eviction (the NVMe write of a victim) raises here."""
        got = tier.try_alloc(nbytes, phase)  # type: ignore[attr-defined]
        if got is not None and not tier.lock.locked():
            return got
        if got is not None:
            tier.free(got, nbytes)  # type: ignore[attr-defined]
        async with tier.lock:
            while True:
                if moot is not None and moot():
                    return None
                got = tier.try_alloc(nbytes, phase)  # type: ignore[attr-defined]
                if got is not None:
                    return got
                short = nbytes + phase - (tier.capacity - tier.used)
                if tier is self.host and self.cleaning:
                    await self._drop_clean(short)
                    continue
                victims: list[Entry] = []
                freed = 0
                for cand in tier.policy.victims():
                    e: Entry = cand  # type: ignore[assignment]
                    if e not in tier.entries or not self.evictable(tier, e):
                        continue
                    victims.append(e)
                    freed += round_up(e.nbytes)
                    if freed >= max(short, 1):
                        break
                if victims:
                    await self.demote(tier, victims, deadline)
                    continue
                if not wait:
                    raise StoreTimeoutError(f"no room in the {tier.name} tier for {what} without waiting")
                await tier.wait_change(deadline, what)

    async def _drop_clean(self, short: int) -> None:
        """The coldest host values are being written already: drop clean ones
        if that makes room, else wait for a batch to end (its values drop at
        once) rather than evict hotter ones."""
        tier = self.host
        clean: list[Entry] = []
        got = 0
        for cand in tier.policy.victims():  # in the policy's order
            c: Entry = cand  # type: ignore[assignment]
            if c not in tier.entries or c.moving:
                if c.moving:
                    break  # being written: it goes first, once clean
                continue
            if not self.evictable(tier, c):
                continue  # held or loading
            if c.disk is None and c.gpu is None:
                break  # dirty: never evict a later victim before it
            clean.append(c)
            got += round_up(c.nbytes)
            if got >= short:
                break
        if clean and got >= short:
            for c in clean:
                self.drop(c, HOST)
        else:
            await asyncio.wait(set(self.cleaning), return_when=asyncio.FIRST_COMPLETED)

    async def demote(self, tier: MemTier, victims: list[Entry], deadline: float | None) -> None:
        """Move a memory tier's copies out: those with another copy are
        dropped; the others are loaded into the host tier (GPU victims that
        fit it) or written to NVMe (one batched write per slab), then dropped."""
        name = tier.name
        alone: list[Entry] = []
        for e in victims:
            if self.elsewhere(e, name):
                self.drop(e, name)
            else:
                alone.append(e)
        if not alone:
            return
        if name == GPU:
            for e in alone:
                with self.pins(GPU, e):
                    if e.nbytes <= self.host.capacity:
                        await self.load(e, HOST, deadline)
                    else:
                        await self.write_out([e])
                self._drop_if_spare(e, name)
            return
        await self.write_out(alone)
        for e in alone:
            self._drop_if_spare(e, name)

    def _drop_if_spare(self, e: Entry, tier: str) -> None:
        c = e.copies.get(tier)
        if not e.dead and c is not None and c.refs == 0 and self.elsewhere(e, tier):
            self.drop(e, tier)

    # -- writing to NVMe ----------------------------------------------------------------

    def write_jobs(self, w: WriteOut, exts: Sequence[Extents]) -> list[tuple[Extents, Any]]:
        """The NVMe tier's write jobs of a write-out: each value's pinned copy, in whole pages."""
        return [(x, self.view(s, e, True)) for x, e, s in zip(exts, w.entries, w.sources)]

    def try_allocate(self, w: WriteOut) -> list[Extents] | None:
        """Extents for each value of a write-out from free space, without
        waiting; None (nothing allocated) where one needs a slab to grow."""
        exts: list[Extents] = []
        for e, s in zip(w.entries, w.sources):
            x = self.nvme.try_allocate(e.nbytes, e.host if s == HOST else 0)  # type: ignore[arg-type]
            if x is None:
                for got in exts:
                    self.nvme.free(got)
                return None
            exts.append(x)
        return exts

    async def write_out(
        self,
        entries: list[Entry],
        w: WriteOut | None = None,
        exts: list[Extents] | None = None,
        pending: Coroutine[Any, Any, None] | None = None,
    ) -> None:
        """Write values to the NVMe tier from their host copy (else GPU); each
        gets its extents once written (a dead one, or one written meanwhile,
        gives them back). ``w``, ``exts`` and ``pending``: the write-out, its
        extents and its write where the caller started them already. The
        write-out's marks and references are given back on every path."""
        if w is None:
            w = WriteOut(entries, self.unref)
        got: list[Extents] = exts if exts is not None else []
        try:
            with w:
                try:
                    if pending is not None:
                        await pending
                    else:
                        for e, s in zip(w.entries, w.sources):
                            got.append(await self.nvme.allocate(e.nbytes, e.host if s == HOST else 0))  # type: ignore[arg-type]
                        await self.nvme.write(self.write_jobs(w, got))
                except BaseException:
                    for x in got:
                        self.nvme.free(x)
                    raise
                for x, e in zip(got, w.entries):
                    if e.dead or e.disk is not None:
                        self.nvme.free(x)
                    else:
                        e.copy(NVME).where = x
        finally:
            self.host.notify()  # waiters on `moving` (a write-through of these entries)

    # -- loading into the memory tiers ---------------------------------------------------

    def start_load(
        self, e: Entry, tier: str, deadline: float | None, wait: bool = True
    ) -> asyncio.Task[None]:
        """The task that brings e into the host (or GPU) tier; one per entry and tier."""
        c = e.copy(tier)
        t: asyncio.Task[None] | None = c.loading
        if t is not None:
            return t
        t = asyncio.get_running_loop().create_task(self.load(e, tier, deadline, wait))
        c.loading = t
        self.tasks.add(t)
        if not wait:
            self.nowait_loads.add(t)

        def done(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            self.nowait_loads.discard(task)
            if c.loading is task:
                c.loading = None
                # a loading entry is not evictable: a put that found nothing
                # else to evict waits for this (add() woke it too early)
                self.tiers[tier].notify()
            if not task.cancelled() and task.exception() is not None and wait:
                self.note_error(task.exception())  # type: ignore[arg-type]

        t.add_done_callback(done)
        return t

    def source(self, e: Entry, tier: str) -> str | None:
        """The tier a load into ``tier`` copies from: another memory tier, else NVMe."""
        for name in (GPU, HOST, NVME):
            if name != tier and e.at(name) is not None:
                return name
        return None

    async def load(self, e: Entry, tier: str, deadline: float | None, wait: bool = True) -> None:
        """Bring e into a memory tier (making room, waiting for it if ``wait``)."""
        t: MemTier = self.tiers[tier]
        if e.at(tier) is not None or e.dead:
            return
        # moot: a get's promotion put the value in the tier meanwhile (a load
        # is not evictable, so waiting on would wait for itself)
        got = await self.make_room(
            t,
            e.nbytes,
            deadline,
            f"{e.key!r}",
            wait,
            phase_of(e.disk) if tier == HOST else 0,
            lambda: e.at(tier) is not None or e.dead,
        )
        if got is None:
            return
        try:
            if e.at(tier) is not None or e.dead:
                return
            src = self.source(e, tier)
            if src is None:
                return
            with self.pins(src, e):
                await self._transfer(e, src, tier, got)
            if e.at(tier) is not None or e.dead:
                return
            e.copy(tier).where, got = got, None
            t.add(e)
        finally:
            if got is not None:
                t.free(got, e.nbytes)  # type: ignore[attr-defined]

    async def _transfer(self, e: Entry, src: str, dst: str, where: Any) -> None:
        """Copy e's bytes from its (pinned) copy in ``src`` to ``where`` in memory tier ``dst``."""
        n = e.nbytes
        if src != NVME:
            copy_into(self.tiers[dst].view(where, n), self.view(src, e))
            return
        if dst == HOST:
            p = where % ALIGN
            whole = self.host.arena[where - p : where - p + round_up(p + n)]
            await self.nvme.read([read_job(e.disk, self.host.view(where, n, True), whole, n)], [e.key])
        else:
            await self.nvme.read([(e.disk, where)], [e.key])
        self.nvme.stats["hits"] += 1

    async def claimed(self, e: Entry, task: asyncio.Task[None], tier: str) -> None:
        """Await e's load into ``tier`` holding a claim on what it brings (see
        Copy.claims): the caller takes it before its next suspension point."""
        c = e.copy(tier)
        c.claims += 1
        try:
            if task.done():
                # its done callback (which clears Copy.loading) runs first: a
                # caller that loops until the load is gone must not spin
                await asyncio.sleep(0)
            await asyncio.shield(task)
        finally:
            # evictable again once the caller has taken its reference (it does
            # so before the waiters woken here run)
            c.claims -= 1
            if c.claims == 0:
                self.tiers[tier].notify()

    async def join_load(self, e: Entry, task: asyncio.Task[None], tier: str = HOST) -> bool:
        """Wait for a load a hold needs: False if it was someone else's load
        that would not wait for room and found none (the hold then starts
        its own, which waits); its own load's errors are raised."""
        nowait = task in self.nowait_loads
        try:
            await self.claimed(e, task, tier)
        except (StoreFullError, StoreTimeoutError):
            if nowait:
                await asyncio.sleep(0)  # its done callback has run: the next start_load is ours
                return False
            raise
        return True

    async def await_load(self, e: Entry, task: asyncio.Task[None], tier: str = HOST) -> bool:
        """Wait for a load; False if it found no room (the caller reads directly instead)."""
        try:
            await self.claimed(e, task, tier)
        except (StoreFullError, StoreTimeoutError):
            return False
        return True

    def stats(self, nvme_entries: int) -> dict[str, dict[str, Any]]:
        """See :meth:`TieredStore.stats` (``nvme_entries``: the values with an NVMe copy)."""
        out: dict[str, dict[str, Any]] = {}
        for name, t in self.tiers.items():
            if name == NVME:
                continue
            out[name] = {"used": t.used, "capacity": t.capacity, "entries": len(t.entries)}
            if name == HOST:
                out[name]["pinned"] = t.pinned
            out[name].update(t.stats)
        nv = self.nvme
        out[NVME] = {
            "used": nv.used,
            "capacity": nv.capacity,
            "entries": nvme_entries,
            "slabs": [s.path for s in nv.slabs],
            "free_extents": sum(len(s.alloc.extents()) for s in nv.slabs),
            "fragmentation": max((s.alloc.fragmentation() for s in nv.slabs), default=0.0),
            **nv.stats,
        }
        return out

    # -- copies between memory ----------------------------------------------------------

    async def copy(self, dst: Any, src: Any) -> None:
        """dst[:] = src; large copies in parallel slices on threads (numpy and
        torch release the GIL), awaited to the end even if cancelled."""
        n = len(dst)
        if n < self.copy_threshold or is_cuda(dst) or is_cuda(src):
            copy_into(dst, src)
            return
        if self.copy_pool is None:
            self.copy_pool = concurrent.futures.ThreadPoolExecutor(
                self.copy_threads, thread_name_prefix="aionvme-store-copy"
            )
        loop = asyncio.get_running_loop()
        k = max(1, min(self.copy_threads, n // self.copy_slice))
        step = round_up(-(-n // k))
        futs = [
            loop.run_in_executor(self.copy_pool, copy_into, dst[o : o + step], src[o : o + step])
            for o in range(0, n, step)
        ]
        every = asyncio.gather(*futs, return_exceptions=True)
        try:
            results = await asyncio.shield(every)
        except asyncio.CancelledError:
            await every  # the threads still write into dst: wait before anyone reuses it
            raise
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def stop_copies(self) -> None:
        pool, self.copy_pool = self.copy_pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # idle: every copy was awaited
