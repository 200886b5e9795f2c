"""The store's write path: put_many over the mover, the journal and the
write-behind cleaner."""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Awaitable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from ._alloc import ALIGN, round_up
from ._cleaner import Cleaner
from ._errors import AttachError
from ._mover import Mover, as_torch
from ._nvme import Extents
from ._policy import Admission
from ._tiers import GPU, HOST, NVME, Entry, Writers
from ._values import Meta, address, check_keys, describe, flat_bytes, is_cuda, numel

__all__ = ["Writes", "to_the_end"]


async def to_the_end(aw: Awaitable[Any]) -> BaseException | None:
    """Await ``aw`` to its end even when cancelled meanwhile (a write over a
    value's only copy must not be abandoned half way); returns the
    cancellation to re-raise once the caller has taken the result, or None.
    The awaitable's own error is raised."""
    t = asyncio.ensure_future(aw)
    cancelled: BaseException | None = None
    while not t.done():
        try:
            await asyncio.shield(t)
        except asyncio.CancelledError as c:
            if t.cancelled():
                raise
            cancelled = c
    t.result()  # its own error, if it failed
    return cancelled


class Writes:
    """Puts of one store: ``index`` its entries by key, ``queues`` the
    per-key queues of writers, ``journal`` its journal (None: a scratch store)."""

    def __init__(
        self,
        mover: Mover,
        cleaner: Cleaner,
        index: dict[Hashable, Entry],
        queues: dict[Hashable, collections.deque[asyncio.Future[None]]],
        journal: Any,
        persist: bool,
        admission: Admission,
    ) -> None:
        self.mover = mover
        self.admission = admission
        self.cleaner = cleaner
        self.index = index
        self.queues = queues
        self.journal = journal
        self.persist = persist

    def writer(self, *keys: Hashable) -> Writers:
        return Writers(self.queues, keys)

    async def put_many(self, items: Mapping[Any, Any], to: str | None, deadline: float | None) -> None:
        """See :meth:`TieredStore.put_many` (the caller checked ``to``)."""
        m = self.mover
        check_keys(items, self.persist)
        metas = {k: describe(v) for k, v in items.items()}
        reused: list[Entry] = []  # previous entries whose extents this put overwrites
        cancelled: BaseException | None = None
        async with self.writer(*items):
            new: list[Entry] = []
            try:
                bypass: list[tuple[Entry, Any]] = []
                for k, v in items.items():
                    e = Entry(k, metas[k])
                    new.append(e)
                    if e.nbytes == 0:
                        continue
                    src = flat_bytes(v)
                    # Each new entry joins its tier as soon as its bytes are
                    # there, so a batch larger than the tier evicts its own
                    # first values (to NVMe) instead of waiting forever.
                    if to == "nvme":
                        bypass.append((e, src))
                    elif to is None and is_cuda(v) and m.gpu is not None and e.nbytes <= m.gpu.capacity:
                        t = await m.make_room(m.gpu, e.nbytes, deadline, f"{k!r}")
                        e.copy(GPU).where = t
                        t[: e.nbytes].copy_(src)
                        m.gpu.add(e)
                    elif 0 < e.nbytes <= m.host.capacity:
                        await self._fill_host(e, src, deadline)
                    else:
                        bypass.append((e, src))
                if bypass:
                    cancelled = await self._write_bypass(bypass, reused)
                if self.persist:
                    await self._write_through(new)
                    if bypass or any(e.nbytes for e in new):
                        await m.nvme.fsync()
                    await self._journal_put(new)
            except BaseException:
                for e in new:
                    m.retire(e)
                for prev in reused:  # its bytes were being overwritten: the key is gone
                    if self.index.get(prev.key) is prev:
                        del self.index[prev.key]
                    m.retire(prev)
                    prev.replaced.set_result(None)  # type: ignore[union-attr]
                raise
            for e in new:
                old = self.index.get(e.key)
                self.index[e.key] = e
                if old is not None:
                    m.handover(old, e)
                    m.retire(old)
            for prev in reused:
                prev.replaced.set_result(None)  # type: ignore[union-attr]
        self.cleaner.kick()
        if cancelled is not None:
            raise cancelled

    async def _fill_host(self, e: Entry, src: Any, deadline: float | None) -> None:
        """Copy a new value into the host tier (making room): it joins the tier once filled."""
        m = self.mover
        off = await m.make_room(m.host, e.nbytes, deadline, f"{e.key!r}")
        e.copy(HOST).where = off
        with m.pins(HOST, e):  # not evictable while being filled
            self.cleaner.kick()  # write colder values out while this one is copied in
            if is_cuda(src):
                as_torch(m.host.view(off, e.nbytes)).copy_(src)
            else:
                await m.copy(m.host.view(off, e.nbytes), src)
        m.host.add(e)
        if not self.persist:
            self.cleaner.add_dirty(e)

    async def _write_bypass(
        self, bypass: list[tuple[Entry, Any]], reused: list[Entry]
    ) -> BaseException | None:
        """Write values straight to NVMe (values no memory tier can take, or
        to='nvme'); where an old value's pages are reused in place (see
        :meth:`reusable`), the write runs to its end even when cancelled: the
        cancellation to re-raise, or None."""
        m = self.mover
        while True:
            plans = [(e, src, self.reusable(e, src)) for e, src in bypass if e.disk is None]
            late = [(e, src) for e, src, reuse in plans if reuse is None]
            if not late:
                # overwrite the previous values' pages in place: taken with no
                # await between here and the write's start, so a cancellation
                # before it leaves them whole; their readers wait for this put
                # (see Entry.replaced); a pin taken meanwhile on another thread
                # keeps the old value: new space instead
                with m.pin_lock:
                    pinned = [e for e, _src, reuse in plans if reuse[0].pins]  # type: ignore[index]
                    if not pinned:
                        for e, _src, reuse in plans:
                            prev, e.copy(NVME).where = reuse  # type: ignore[misc]
                            m.drop(prev, HOST)
                            m.drop(prev, GPU)
                            prev.copies[NVME].where = None
                            prev.dead = True
                            prev.replaced = asyncio.get_running_loop().create_future()
                            reused.append(prev)
                if not pinned:
                    break
                late = [(e, src) for e, src, _reuse in plans if e in pinned]
            for e, src in late:  # new space (each await may change what is reusable)
                e.copy(NVME).where = await m.nvme.allocate(e.nbytes, address(src))
        jobs = [(e.disk, src) for e, src in bypass]
        if reused:
            return await to_the_end(m.nvme.write(jobs))
        await m.nvme.write(jobs)
        return None

    def reusable(self, e: Entry, src: Any) -> tuple[Entry, Extents] | None:
        """The entry ``e`` replaces and the extents ``e`` takes over, if ``e``
        may overwrite the old value's NVMe pages in place: a scratch store
        (persist=False: no crash promise about the old value), a previous
        value of the same size that nobody reads, holds, loads or moves, whose
        whole pages hold ``e`` at the phase it would get (its memory copies
        are dropped: they would only be evicted to new space later). A swap
        loop then rewrites the same blocks every step (overwriting a written
        block is more than twice as fast as a first write here, see
        bench/probes/write_space.py) and the slab stays the size of the data."""
        if self.persist:
            return None
        prev = self.index.get(e.key)
        if (
            prev is None
            or prev.dead
            or prev.disk is None
            or prev.nbytes != e.nbytes
            or prev.busy()
            or any(x[0] < 0 for x in prev.disk)
        ):
            return None
        want = self.mover.nvme.placement_phase(e.nbytes, address(src))
        if len(prev.disk) != 1:
            return (prev, prev.disk) if want == 0 else None
        # one piece: the same whole pages, at the new phase where that needs no other page
        i, off, _, n = prev.disk[0]
        p = off % ALIGN
        if round_up(p + n) != round_up(want + n):
            return None
        return prev, [(i, off - p + want, 0, n)]

    async def _write_through(self, entries: list[Entry]) -> None:
        """persist=True: the NVMe copy of new entries (they stay in memory, clean).

        New entries are already evictable, so a demotion may be writing one
        meanwhile: those are left to it and waited for. The copies written
        here are pinned until the write ends, and ``disk`` is set only then.
        """
        todo = [e for e in entries if e.nbytes and e.disk is None and not e.moving and not e.dead]
        if todo:
            await self.mover.write_out(todo)
        while any(e.moving for e in entries):
            await self.mover.host.wait_change(None, "a demotion of a value being put")

    async def attach(
        self,
        key: Hashable,
        path: str | os.PathLike[str],
        offset: int,
        shape: Sequence[int],
        dtype: str,
        like: str,
    ) -> None:
        """See :meth:`TieredStore.attach` (the caller checked that the store is a scratch store)."""
        if like == "torch":
            from ._values import torch_dtype, torch_module

            torch = torch_module()  # TorchNotInstalledError where torch is missing
            item = int(torch.empty(0, dtype=torch_dtype(dtype)).element_size())
            name = dtype
        elif like == "numpy":
            item = np.dtype(dtype).itemsize
            name = np.dtype(dtype).str
        else:
            raise ValueError(f"like must be 'torch' or 'numpy', got {like!r}")
        shp = tuple(int(d) for d in shape)
        nbytes = numel(shp) * item
        if offset < 0 or min(shp, default=0) < 0:
            raise AttachError(f"offset and shape must be >= 0, got {offset} and {shp}")
        fname = os.fspath(path)
        si, size = await asyncio.get_running_loop().run_in_executor(None, self.mover.nvme.source, fname)
        if offset + nbytes > size:
            raise AttachError(
                f"{fname}: the region [{offset}, {offset + nbytes}) is past the end of the file "
                f"({size} bytes)"
            )
        async with self.writer(key):
            e = Entry(key, Meta(like, name, shp, nbytes))
            if nbytes:
                e.copy(NVME).where = [(si, int(offset), 0, nbytes)]
            old = self.index.get(key)
            self.index[key] = e
            if old is not None:
                self.mover.handover(old, e)
                self.mover.retire(old)
            self.admission.forget(key)

    async def _journal_put(self, entries: list[Entry]) -> None:
        if self.journal is None:
            return
        sums = self.mover.nvme.checksum_of  # each value's checksum, in its record
        await self.journal.append(
            [
                {"op": "put", "k": e.key, "m": e.meta.to_json(), "x": e.disk or [], "c": sums(e.disk)}
                for e in entries
            ]
        )
