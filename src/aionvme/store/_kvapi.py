"""The calls a serving engine's KV-cache tier makes on a store, on top of
get and put: presence checks, pins across calls, the keys cache mode
dropped, and jobs submitted from the engine's own threads (see :mod:`._kv`
for how they work). :class:`TieredStore` inherits them."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine, Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ._errors import StoreClosedError
from ._kv import Evictor, Jobs, PinTable, key_list
from ._memtier import GpuTier, HostTier
from ._reads import Reads
from ._tiers import HOST, Entry
from ._values import check_out, is_cuda

__all__ = ["KVCalls"]

# host hits copied on the loop's thread between two suspensions (about a
# millisecond of memcpy here): a batch of large hits never stalls the loop
YIELD_EVERY = 4 << 20

GET_KWARGS = frozenset({"device", "out", "missing", "timeout"})  # get_many's, after the keys


class KVCalls:
    """Part of :class:`TieredStore` (its attributes are the store's)."""

    _index: dict[Hashable, Entry]
    _closed: bool
    _host: HostTier
    _gpu: GpuTier | None
    _loop: asyncio.AbstractEventLoop | None
    _home: asyncio.AbstractEventLoop | None
    _pins: PinTable
    _jobs: Jobs
    _evictor: Evictor | None
    _reads: Reads

    _enter: Callable[[], asyncio.AbstractEventLoop]
    put_many: Callable[..., Coroutine[Any, Any, None]]
    get_many: Callable[..., Coroutine[Any, Any, list[Any]]]

    def contains(self, key: Hashable) -> bool:
        """``key in store``: sync, from any thread, no I/O."""
        return key in self._index

    def count_prefix(self, keys: Iterable[Hashable]) -> int:
        """How many leading keys are present (sync, from any thread, no I/O):
        the hit length of a prefix of KV blocks."""
        n = 0
        index = self._index
        for k in key_list(keys, "count_prefix"):
            if k not in index:
                break
            n += 1
        return n

    def pin(self, keys: Iterable[Hashable]) -> list[bool]:
        """Pin each key's value (refcounted; from any thread, no loop needed):
        True where the key is present and now pinned, False where it is
        absent (not pinned). A pinned value is never dropped by cache-mode
        eviction nor moved in its slab. A put of a pinned key moves its pins
        to the new value; a delete takes effect for later calls at once (gets
        miss) and the deleted bytes are freed when the last pin goes."""
        return self._pins.pin(key_list(keys, "pin"))

    def unpin(self, keys: Iterable[Hashable]) -> None:
        """Give back one pin per key (from any thread); StorePinError (a
        ValueError) if a key has fewer pins, and then nothing is given back."""
        self._pins.unpin(key_list(keys, "unpin"))

    def drain_evicted(self) -> list[Hashable]:
        """The keys cache-mode eviction dropped since the last call, oldest
        first (thread-safe; not those deleted by the user). The store keeps
        the newest ``evicted_max`` of them (a TieredStore argument, 65536 by
        default): drain often, or the oldest are forgotten, counted by
        :attr:`evicted_lost`."""
        return self._pins.drain()

    @property
    def evicted_lost(self) -> int:
        """Dropped keys that :meth:`drain_evicted` will never list: forgotten
        because more than ``evicted_max`` piled up between two drains (a
        count since the store opened)."""
        return self._pins.evicted_lost

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Mark the keys as just used, as a get would, without reading them:
        cache mode's drop order (``on_full="evict"``) and the host and GPU
        tiers' eviction policies see them as the most recent. Absent keys are
        ignored. From any thread, without waiting: applied on the store's
        loop, before any job submitted after this call starts."""
        ks = key_list(keys, "touch")
        if self._closed:
            raise StoreClosedError("the store is closed")
        loop = self._loop or self._home
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or loop is here:  # no loop yet (nothing runs concurrently), or on it
            self._touch_now(ks)
            return
        try:
            loop.call_soon_threadsafe(self._touch_now, ks)
        except RuntimeError as e:
            raise StoreClosedError("the store's event loop is closed") from e

    def _touch_now(self, keys: list[Hashable]) -> None:
        index = self._index
        live = [index[k] for k in keys if k in index]
        if self._evictor is not None:
            self._evictor.touch(e.key for e in live)
        for e in live:
            self._host.touch(e)
            if self._gpu is not None:
                self._gpu.touch(e)

    def _job_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop or self._home
        if loop is None:
            raise StoreClosedError(
                "submit_* runs on the store's event loop and this TieredStore has none yet: "
                "use it from a coroutine first, or make a SyncTieredStore"
            )
        return loop

    def submit_put_many(self, items: Mapping[Any, Any], **kw: Any) -> concurrent.futures.Future[None]:
        """:meth:`put_many` (``to=``, ``timeout=``) from any thread: it runs on
        the store's loop; its result (None) or error arrives on the returned
        future, and then 1 is added to :meth:`completion_fd`."""
        return self._jobs.submit(self._job_loop(), self._put_job, dict(items), kw)

    def submit_get_many(self, keys: Iterable[Hashable], **kw: Any) -> concurrent.futures.Future[list[Any]]:
        """:meth:`get_many` (``device=``, ``out=``, ``missing=``,
        ``timeout=``) from any thread, as :meth:`submit_put_many`. Hits in
        host memory are copied on the loop's thread in the callback that
        starts the job (no coroutine), when the call copies under 4 MiB."""
        bad = kw.keys() - GET_KWARGS
        if bad:  # (a host hit never reaches get_many, which would refuse them)
            raise TypeError(f"submit_get_many() got unexpected keyword arguments {sorted(bad)}")
        if kw.get("out") is not None:
            kw["out"] = list(kw["out"])
        return self._jobs.submit(self._job_loop(), self._get_job, list(keys), kw)

    def _put_job(self, items: dict[Any, Any], kw: dict[str, Any]) -> Coroutine[Any, Any, None]:
        return self.put_many(items, **kw)

    def _get_job(self, keys: list[Hashable], kw: dict[str, Any]) -> Any:
        """A submitted get_many on the loop's thread: its result if every key
        is a host hit (or absent, with missing='skip'), else its coroutine."""
        got = self._hits_now(keys, kw.get("device", "cpu"), kw.get("out"), kw.get("missing", "raise"))
        return self.get_many(keys, **kw) if got is None else got

    def _hits_now(self, keys: list[Hashable], device: str, out: Sequence[Any] | None, missing: str) -> Any:
        """get_many's result where every key is in the host tier (or absent,
        with missing='skip') and the copies are small (under YIELD_EVERY in
        all, each under copy_threshold, into CPU memory): copied now, with no
        suspension (so no pins needed); None, having done nothing, otherwise
        (get_many then serves the call, and raises what it raises)."""
        if device != "cpu" or missing not in ("raise", "skip") or (out is not None and len(out) != len(keys)):
            return None
        skip = missing == "skip"
        index = self._index
        limit = self._reads.mover.copy_threshold
        entries: list[Entry | None] = []
        total = 0
        for i, k in enumerate(keys):
            e = index.get(k)
            if e is None:
                if not skip:
                    return None
                entries.append(None)
                continue
            c = e.copies.get(HOST)
            n = e.meta.nbytes
            if c is None or c.where is None or n == 0 or n >= limit:
                return None
            if out is not None and not isinstance(out[i], np.ndarray) and is_cuda(out[i]):
                return None
            total += n
            entries.append(e)
        if total >= YIELD_EVERY:
            return None
        self._enter()  # a closed store raises; binds the loop like any call
        if out is not None:
            for d, e in zip(out, entries):
                if e is not None:
                    check_out(d, e.meta)  # every buffer checked before any is filled
        if self._evictor is not None:
            self._evictor.touch(k for k, e in zip(keys, entries) if e is not None)
        hit_now = self._reads.hit_now
        res: list[Any] = []
        for i, e in enumerate(entries):
            if e is None:
                res.append(False if out is not None else None)
                continue
            v = hit_now(e, None if out is None else out[i])
            res.append(True if skip and out is not None else v)
        return res

    def completion_fd(self) -> int:
        """An eventfd (EFD_NONBLOCK) to which 1 is added each time a submitted
        job completes, with a result or an error: poll it, read it, then
        collect the finished futures (counts coalesce). Closed by ``close()``."""
        return self._jobs.fd()

    async def _get_found(
        self, keys: list[Hashable], device: str, out: Sequence[Any] | None, skip: bool, deadline: float | None
    ) -> list[Any]:
        """get_many in cache mode or with missing='skip': the values found are
        pinned until the end (an eviction meanwhile cannot take them). Hits
        in the host tier are copied here, without a task each (an engine's
        batch of host hits: ~40 µs a key through get_many's tasks)."""
        if out is not None and len(out) != len(keys):
            raise ValueError(f"out has {len(out)} buffers for {len(keys)} keys")
        index = self._index
        found = [i for i, k in enumerate(keys) if k in index] if skip else list(range(len(keys)))
        entries = [self._reads.lookup(keys[i]) for i in found]
        outs = None if out is None else [out[i] for i in found]
        if outs is not None:
            for d, e in zip(outs, entries):
                check_out(d, e.meta)  # every buffer checked before any is filled
        held = self._pins.hold(entries)
        try:
            if self._evictor is not None:
                self._evictor.touch(keys[i] for i in found)
            got: list[Any] = [None] * len(found)
            rest = list(range(len(found)))
            if device == "cpu":
                hit_now = self._reads.hit_now
                rest = []
                copied = 0
                for j, e in enumerate(entries):
                    if copied >= YIELD_EVERY:  # the loop's other callbacks run between slices
                        copied = 0
                        await asyncio.sleep(0)
                    v = hit_now(e, None if outs is None else outs[j])
                    if v is None:
                        rest.append(j)
                    else:
                        got[j] = v
                        copied += e.nbytes
            if rest:
                later = None if outs is None else [outs[j] for j in rest]
                more = await self._reads.get_many([keys[found[j]] for j in rest], device, later, deadline)
                for j, v in zip(rest, more):
                    got[j] = v
        finally:
            self._pins.release(held)
        if not skip:
            return got
        res: list[Any] = [False if out is not None else None] * len(keys)
        for i, v in zip(found, got):
            res[i] = True if out is not None else v
        return res
