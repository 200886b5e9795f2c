"""What the store's mover works with: the tier interface, a value's copies
(one map, tier name -> :class:`Copy`), and the owners of the counts taken on
them (:class:`Pins`, :class:`WriteOut`, :class:`Writers`).

A count (a reference, a claim, a write-out mark) is taken and given back by
one owner object, whose ``release`` runs once on every path (a ``with``
block, a ``finally`` or a task's done callback), so no error path leaves a
value pinned for good.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

from ._values import Meta

__all__ = ["GPU", "HOST", "NVME", "Copy", "Entry", "Pins", "Tier", "WriteOut", "Writers"]

GPU, HOST, NVME = "gpu", "host", "nvme"  # the tiers, hottest first


class Tier(Protocol):
    """What the mover asks of a tier (GPU, host, NVMe); a copy's ``where``
    is the tier's own handle of the bytes: a uint8 CUDA tensor, an offset in
    the host arena, a list of extents in the slab files."""

    name: str
    stats: dict[str, float]

    def release(self, where: Any, nbytes: int) -> None:
        """Give a copy's space back to the tier."""

    def notify(self) -> None:
        """A copy may have become evictable or freed: wake who waits for room."""


class Copy:
    """One copy of a value in one tier.

    ``refs`` counts readers, holders and write-outs of the copy in flight: it
    is freed (or evicted) only at zero. ``claims`` counts readers and holders
    waiting for a load into this tier: until each has resumed and taken its
    reference, the copy the load made is not evictable (else two holds whose
    values do not fit the tier together evict each other's value before either
    takes it, forever). ``loading`` is the load into this tier in flight (for
    the NVMe tier: the :class:`WriteOut` writing the value there).
    """

    __slots__ = ("claims", "loading", "refs", "where")

    def __init__(self) -> None:
        self.where: Any = None
        self.refs = 0
        self.claims = 0
        self.loading: Any = None

    def __repr__(self) -> str:
        return f"Copy(where={self.where!r}, refs={self.refs}, claims={self.claims}, loading={self.loading!r})"


class Entry:
    """One version of one key. Its bytes never change: a put makes a new Entry
    and retires the old one, so every copy of an Entry holds the same bytes and
    any of them may serve a read."""

    __slots__ = ("copies", "dead", "key", "meta", "pins", "replaced")

    def __init__(self, key: Hashable, meta: Meta) -> None:
        self.key = key
        self.meta = meta
        self.copies: dict[str, Copy] = {}
        self.dead = False  # replaced or deleted
        # pins across calls (TieredStore.pin, from any thread): while > 0 the
        # value is never evicted from the NVMe tier, moved or overwritten, and
        # its copies outlive a delete. Changed, and ``dead`` set, only under
        # the store's pin lock (Mover.pin_lock), so a pin taken on another
        # thread and an eviction or delete on the loop's never cross.
        self.pins = 0
        # set while a put overwrites this entry's NVMe extents in place (see
        # TieredStore._reusable): done when the index holds the new entry (or
        # the key is gone); readers that find no copy wait for it
        self.replaced: asyncio.Future[None] | None = None

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    def copy(self, tier: str) -> Copy:
        """The copy's record in ``tier`` (made empty when there is none)."""
        c = self.copies.get(tier)
        if c is None:
            c = self.copies[tier] = Copy()
        return c

    def at(self, tier: str) -> Any:
        """The copy's place in ``tier``, or None."""
        c = self.copies.get(tier)
        return None if c is None else c.where

    def loading(self, tier: str) -> Any:
        c = self.copies.get(tier)
        return None if c is None else c.loading

    @property
    def host(self) -> int | None:
        c = self.copies.get(HOST)  # (not at(): a call less on the paths every get takes)
        return None if c is None else c.where

    @property
    def gpu(self) -> Any:
        c = self.copies.get(GPU)
        return None if c is None else c.where

    @property
    def disk(self) -> Any:
        c = self.copies.get(NVME)
        return None if c is None else c.where

    @property
    def moving(self) -> bool:
        """A write of the value to the NVMe tier is in flight."""
        return self.loading(NVME) is not None

    def busy(self) -> bool:
        """Someone pins it, or reads, holds, loads or writes out one of its copies."""
        return self.pins > 0 or any(c.refs or c.claims or c.loading is not None for c in self.copies.values())

    def idle(self) -> bool:
        return not self.busy()

    def __repr__(self) -> str:
        return f"<Entry {self.key!r} {self.copies}{' dead' if self.dead else ''}>"


class Pins:
    """References on the copies of ``entries`` in one tier, taken now and given
    back once by :meth:`release` (idempotent; also the end of a ``with``):
    the owner of those counts."""

    __slots__ = ("_unref", "entries", "tier")

    def __init__(self, tier: str, entries: Iterable[Entry], unref: Callable[[Entry, str], None]) -> None:
        self.tier = tier
        self.entries = list(entries)
        self._unref = unref
        for e in self.entries:
            e.copy(tier).refs += 1

    def release(self) -> None:
        entries, self.entries = self.entries, []
        for e in entries:
            self._unref(e, self.tier)

    def __enter__(self) -> Pins:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class WriteOut:
    """A write of values to the NVMe tier from their hottest memory copy: marks
    each value as moving (its NVMe copy's ``loading``) and pins the copy it is
    written from; :meth:`release` undoes both, once."""

    __slots__ = ("_done", "entries", "pins", "sources")

    def __init__(self, entries: Iterable[Entry], unref: Callable[[Entry, str], None]) -> None:
        self.entries = list(entries)
        self._done: Callable[[WriteOut], None] | None = None
        self.sources = [HOST if e.at(HOST) is not None else GPU for e in self.entries]
        self.pins = [Pins(s, [e], unref) for e, s in zip(self.entries, self.sources)]
        for e in self.entries:
            e.copy(NVME).loading = self

    def on_release(self, fn: Callable[[WriteOut], None]) -> None:
        self._done = fn

    def release(self) -> None:
        if not self.pins:
            return
        pins, self.pins = self.pins, []
        for e in self.entries:
            c = e.copies[NVME]
            if c.loading is self:
                c.loading = None
        for p in pins:
            p.release()
        if self._done is not None:
            self._done(self)

    def __enter__(self) -> WriteOut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Writers:
    """Tickets on the per-key queues of writers: puts, deletes (and
    compaction moves) of a key run one at a time, in call order, even when one
    call writes several keys (put_many): the call takes a ticket on every
    key's queue at once, when it starts, so a later call never overtakes it
    and no two calls wait on each other."""

    def __init__(self, queues: dict[Hashable, collections.deque[asyncio.Future[None]]], keys: Any) -> None:
        self.queues = queues
        self.keys = list(dict.fromkeys(keys))
        self.tickets: list[tuple[Hashable, asyncio.Future[None]]] = []

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        for k in self.keys:  # all tickets at once: no await in this loop
            q = self.queues.get(k)
            if q is None:
                q = self.queues[k] = collections.deque()
            fut: asyncio.Future[None] = loop.create_future()
            if not q:
                fut.set_result(None)
            q.append(fut)
            self.tickets.append((k, fut))
        try:
            for _k, fut in self.tickets:
                await fut
        except BaseException:
            self._release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        tickets, self.tickets = self.tickets, []
        for k, fut in tickets:
            q = self.queues[k]
            head = q[0] is fut
            q.remove(fut)
            if not fut.done():
                fut.cancel()
            if head and q and not q[0].done():
                q[0].set_result(None)
            if not q:
                del self.queues[k]
