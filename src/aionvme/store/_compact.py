"""Compaction of the NVMe tier: values move down in their slab files so free
space is one piece at the end of each."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Hashable
from typing import Any

from .. import memory
from ._alloc import round_up
from ._mover import Mover
from ._nvme import span
from ._tiers import NVME, Entry, Writers

__all__ = ["Compactor"]


class Compactor:
    """Moves the values of one store's slabs (see :meth:`run`).

    ``index`` and ``queues`` are the store's (its entries by key, the
    per-key queues of writers); ``journal`` its journal or None.
    """

    def __init__(
        self,
        mover: Mover,
        index: dict[Hashable, Entry],
        queues: dict[Hashable, collections.deque[asyncio.Future[None]]],
        journal: Any,
        persist: bool,
    ) -> None:
        self.mover = mover
        self.index = index
        self.queues = queues
        self.journal = journal
        self.persist = persist
        self._lock: asyncio.Lock | None = None

    async def run(self) -> int:
        """Move values down so free space joins at each slab's end; the bytes
        moved. Values being written, read or replaced are skipped (tried
        again next time); with ``persist=True`` each move is durable (data
        fdatasynced, then its journal record) before the old extent is reused."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        nvme = self.mover.nvme
        moved = 0
        async with self._lock:
            for si, slab in enumerate(nvme.slabs):
                pieces = sorted(
                    (x[1], e) for e in list(self.index.values()) if e.disk for x in e.disk if x[0] == si
                )
                for off, e in pieces:
                    if slab.alloc.free_bytes == slab.alloc.tail_free():
                        break  # no hole left below the end
                    c = e.copies[NVME]
                    if e.dead or e.key in self.queues or c.refs or c.loading is not None or e.pins:
                        continue  # busy: a put, delete, write-out or read of it is in flight, or pinned
                    moved += await self._move_piece(e, si, off)
            if moved:
                nvme.stats["compactions"] += 1
        return moved

    async def _move_piece(self, e: Entry, si: int, off: int) -> int:
        """Move e's piece at (slab si, off) to the lowest hole below it."""
        nvme = self.mover.nvme
        old_disk = e.disk
        if old_disk is None:
            return 0
        piece = next((x for x in old_disk if x[0] == si and x[1] == off), None)
        if piece is None:
            return 0
        slab = nvme.slabs[si]
        n = int(piece[3])
        base, sp = span(off, n)  # the allocated extent (a phase-placed value's starts before off)
        phase = off - base
        new = slab.alloc.alloc_below(sp, base)
        if new is None:
            return 0
        async with Writers(self.queues, [e.key]):  # no put or delete of the key meanwhile (journal order)
            if e.dead or e.disk is not old_disk or self.index.get(e.key) is not e:
                slab.alloc.free(new, sp)
                return 0
            bounce = memory.empty(round_up(sp), "uint8")
            c = e.copy(NVME)
            with self.mover.pins(NVME, e):
                try:
                    await slab.file.pread(bounce, base)
                    await slab.file.pwrite(bounce, new)
                    if self.persist:
                        await slab.file.fdatasync()
                except BaseException:
                    slab.alloc.free(new, sp)
                    raise
                # a read of the old place began meanwhile, or the value went: keep the old place
                stale = e.dead or c.refs > 1 or e.disk is not old_disk
            if stale:
                slab.alloc.free(new, sp)
                return 0
            ext = [(si, new + phase, x[2], x[3]) if x is piece else x for x in old_disk]
            if self.journal is not None:
                try:
                    sum_ = nvme.checksum_of(old_disk)  # the checksum follows the value
                    await self.journal.append(
                        [{"op": "put", "k": e.key, "m": e.meta.to_json(), "x": ext, "c": sum_}]
                    )
                except BaseException:
                    slab.alloc.free(new, sp)
                    raise
            nvme.moved(old_disk, ext)
            c.where = ext
            slab.alloc.free(base, sp)
            nvme.stats["bytes_in"] += n
            nvme.stats["bytes_out"] += n
        return n
