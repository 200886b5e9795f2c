"""TieredStore: tensors by key in GPU memory, host memory and NVMe slabs."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import os
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .. import defaults, memory
from .._runtime.reactor import get_reactor
from ..exceptions import DeviceError
from ._alloc import ALIGN, round_up
from ._errors import (
    AttachError,
    StoreClosedError,
    StoreFullError,
    StoreKeyError,
    StoreTimeoutError,
)
from ._journal import Journal, load_index
from ._lock import own_dirs
from ._memtier import GpuTier, HostTier, MemTier
from ._nvme import Extents, NvmeTier, phase_of, span
from ._policy import Admission, EvictionPolicy, make_admission, make_policy
from ._values import (
    Meta,
    address,
    check_keys,
    check_out,
    describe,
    flat_bytes,
    is_cuda,
    numel,
    result_like,
    result_span,
    view_as,
)

# a mapping's key type is invariant: put_many takes dict[str, Tensor] through a TypeVar
K = TypeVar("K", bound=Hashable)

__all__ = ["TieredStore"]

BASENAME = "aionvme-store"
COPY_SLICE = 4 << 20  # a large copy is split into slices of at least this many bytes, one per thread


class Entry:
    """One version of one key. Its bytes never change: a put makes a new Entry
    and retires the old one, so every copy of an Entry (GPU, host, NVMe) holds
    the same bytes and any of them may serve a read.

    ``refs``/``gpu_refs``/``disk_refs`` count readers (and holders) of each copy
    in flight: a copy is freed only when its count is zero, so a delete or an
    eviction never lets memory or an extent be reused under a read.
    """

    __slots__ = (
        "claims",
        "dead",
        "disk",
        "disk_refs",
        "gpu",
        "gpu_claims",
        "gpu_loading",
        "gpu_refs",
        "host",
        "key",
        "loading",
        "meta",
        "moving",
        "refs",
        "replaced",
    )

    def __init__(self, key: Hashable, meta: Meta) -> None:
        self.key = key
        self.meta = meta
        self.host: int | None = None  # offset in the host arena
        self.disk: Extents | None = None
        self.gpu: Any = None  # a uint8 CUDA tensor
        self.refs = 0
        self.gpu_refs = 0
        self.disk_refs = 0
        # readers and holders waiting on a load of this entry into the host
        # (GPU) tier: until each has resumed and taken its copy or reference,
        # the copy the load made is not evictable, or two holds whose values
        # do not fit the tier together evict each other's value before either
        # takes it, forever. A claim pins nothing while the load runs (the
        # copy does not exist yet), only between the load's end and the
        # claimants' next step.
        self.claims = 0
        self.gpu_claims = 0
        self.loading: asyncio.Task[None] | None = None  # colder -> host
        self.gpu_loading: asyncio.Task[None] | None = None  # colder -> GPU
        self.moving = False  # host -> NVMe write in flight
        self.dead = False  # replaced or deleted
        # set while a put overwrites this entry's NVMe extents in place (see
        # TieredStore._reusable): done when the index holds the new entry (or
        # the key is gone); readers that find no copy wait for it
        self.replaced: asyncio.Future[None] | None = None

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes


def _as_torch(a: Any) -> Any:
    import torch

    return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)


def _copy_into(dst: Any, src: Any) -> None:
    """dst[:] = src for flat uint8 numpy arrays / torch tensors (the GIL is released)."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        _as_torch(dst).copy_(_as_torch(src))


async def _to_the_end(aw: Awaitable[Any]) -> BaseException | None:
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


def _read_job(ext: Any, raw: Any, span: Any, nbytes: int) -> tuple[Any, ...]:
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


def _sizes(value: int | str | None) -> int | None:
    return None if value is None else defaults.parse_size(value)


class TieredStore:
    """A store of tensors by key over tiers: GPU memory (optional), host memory, NVMe.

    Parameters
    ----------
    path : str or list of str
        Directory (or directories, one per drive: values are striped over
        them) for the NVMe tier's slab files.
    host : int or str
        Host tier capacity in bytes (``"8G"``). 0: no host tier.
    gpu : int or str or None
        GPU tier capacity; None (default) for none. Needs CUDA.
    policy : {'lru', 'lfu', 's3fifo'} or callable
        Eviction policy of the memory tiers, or a factory of
        :class:`EvictionPolicy` objects (one per tier).
    persist : bool
        False (default): a scratch cache, its files removed by :meth:`close`.
        True: every returned ``put`` is durable (data, then a journal
        record, each fdatasynced) and reopening the same path, after a clean
        close or a crash, gives back every key with its bytes. Keys must be str.
    nvme : int or str or None
        NVMe tier capacity, preallocated and split over the directories. None
        (default): each slab grows by ``fallocate`` as needed until the disk is full.
    admit : {'always', 'second-touch'} or Admission
        Whether a read served from a colder tier copies the value into the
        host (or GPU) tier: always (default), or only on a key's second miss.
    timeout : float or None
        Default seconds ``put``/``get``/``hold``/``evict`` wait for room in a
        tier full of held values before raising :class:`StoreTimeoutError`.
    stripe : int or str
        Values at least this large are split over all the directories.
    checksum : bool
        True (default): each value's xxh3_64 is taken when it is written to
        NVMe and checked when it is read back (:class:`CorruptValueError`).
    recover : bool
        persist=True: open an index whose journal is damaged (which is
        otherwise a :class:`StoreCorruptError`), keeping every intact record;
        ``store.recovered`` then says what was dropped.
    mode : int
        Permissions of the store's files (0o600, default) and of the
        directories it creates (the same, with x where r: 0o700).

    Notes
    -----
    Placement: ``put`` copies the value into the hottest tier its device
    reaches (CUDA tensors into the GPU tier, CPU values into the host tier;
    larger than the tier: straight to NVMe); what it pushes out moves one tier
    colder. With ``persist=False`` the NVMe copy is written only on eviction
    (write-back); with ``persist=True`` before ``put`` returns (write-through),
    so evicting from host memory never writes again.

    Write-behind (``persist=False``): once the host tier is three quarters
    full, its coldest values without an NVMe copy are written in the
    background, in batches of ``clean_batch`` bytes (4 MiB) with up to a
    quarter of the tier in flight, starting as soon as a put reserves its
    room; they stay in memory, clean, so a put that needs room drops one at
    once instead of waiting for its write.

    Copies: a get served by the host tier copies on the event loop's thread
    below ``copy_threshold`` bytes (8 MiB) and returns without suspending;
    larger copies (in and out) run as up to ``copy_threads`` parallel slices
    on the store's own threads.

    Ownership: ``get`` returns a new array or tensor the caller owns (a copy
    from a memory tier, or read straight from NVMe into fresh page-aligned
    memory). ``hold`` lends a view of the store's own memory, valid and
    never evicted until the block exits; do not modify it.

    Concurrency: every method is a coroutine for one event loop (the first
    that uses the store). Puts and deletes of one key apply in call order;
    a get sees a complete value, the one installed when it started or a
    newer one. Use :class:`SyncTieredStore` from code without a loop.

    Cancellation: a cancelled call returns only after the I/O and copies it
    started have ended; a cancelled put leaves the key as it was.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        host: int | str = "1G",
        gpu: int | str | None = None,
        policy: str | Callable[[], EvictionPolicy] = "lru",
        persist: bool = False,
        *,
        nvme: int | str | None = None,
        admit: str | Admission | None = None,
        timeout: float | None = None,
        stripe: int | str = "4M",
        checksum: bool = True,
        recover: bool = False,
        mode: int = 0o600,
    ) -> None:
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        if not paths:
            raise ValueError("TieredStore needs at least one directory")
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        self.persist = bool(persist)
        self.timeout = timeout
        self.copy_threshold = 8 << 20  # bigger copies run on threads (the loop never stalls long)
        self.copy_threads = min(8, os.cpu_count() or 1)  # slices of a large copy run in parallel
        self.copy_slice = COPY_SLICE
        self._copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
        factory = make_policy(policy)
        self.admission = make_admission(admit)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._index: dict[Hashable, Entry] = {}
        self._klocks: dict[Hashable, collections.deque[asyncio.Future[None]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # loads started by a get or prefetch that do not wait for room: a hold that
        # joins one and sees it fail starts its own
        self._nowait_loads: set[asyncio.Task[None]] = set()
        self._compact_lock: asyncio.Lock | None = None
        self._cleaners: set[asyncio.Task[None]] = set()  # write-behind batches in flight
        self._clean_bytes = 0  # bytes they write
        # host entries put with no other copy, oldest first: what write-behind
        # looks at (it skips clean values without walking the whole tier);
        # entries that stopped being dirty are dropped as the cleaner meets them
        self._dirty: dict[Entry, None] = {}
        self.clean_batch = 4 << 20  # bytes per write-behind batch (several in flight)
        self.errors: list[BaseException] = []  # failures of prefetches nobody awaited
        host_b = defaults.parse_size(host)
        gpu_b = _sizes(gpu)
        self._gpu: GpuTier | None = None
        cuda = False
        if gpu_b:
            import torch

            if not torch.cuda.is_available():
                raise DeviceError("gpu= needs CUDA, which is not available here (pass gpu=None)")
            self._gpu = GpuTier(gpu_b, factory, "cuda")
            cuda = True
        else:
            import sys

            if "torch" in sys.modules:
                import torch

                cuda = bool(torch.cuda.is_available())
        self._host = HostTier(host_b, factory, pinned=cuda and host_b > 0)
        self._journal: Journal | None = None
        self.recovered: dict[str, Any] | None = None  # what recover=True dropped (see the README)
        entries: dict[str, list[Any]] = {}
        lock = None
        if self.persist:
            # storetrust: one owner per directory, then the index checked (or recovered)
            lock = own_dirs(self.paths, mode)
            snap = os.path.join(self.paths[0], f"{BASENAME}.index")
            jpath = os.path.join(self.paths[0], f"{BASENAME}.journal")
            try:
                idx = load_index(snap, jpath, recover)
            except BaseException:
                lock.release()
                raise
            gen, slabs, entries, valid, self.recovered = (
                idx.generation,
                idx.slabs,
                idx.entries,
                idx.valid,
                idx.recovered,
            )
            if slabs is not None and [os.path.dirname(s) for s in slabs] != self.paths:
                from ._errors import JournalError

                lock.release()
                raise JournalError(
                    f"the store in {self.paths[0]} was made with directories "
                    f"{[os.path.dirname(s) for s in slabs]}, not {self.paths}"
                )
        try:  # storetrust: mode= and checksum= for the NVMe tier; the lock released on failure
            self._nvme = NvmeTier(
                self.paths,
                _sizes(nvme),
                persist=self.persist,
                stripe=defaults.parse_size(stripe),
                mode=mode,
                checksum=checksum,
            )
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self._nvme.compactor = self._compact
        if self.persist:
            try:
                for k, (m, x, c) in entries.items():
                    e = Entry(k, Meta.from_json(m))
                    ext = [tuple(int(v) for v in piece) for piece in x]
                    if ext:
                        self._nvme.reserve(ext, c)  # type: ignore[arg-type]  # storetrust: + checksum
                        e.disk = ext  # type: ignore[assignment]
                    self._index[k] = e
                self._journal = Journal(snap, jpath, gen, valid, lock=lock, mode=mode)
                if slabs is None or idx.rewrite:  # storetrust: a format-1 store, a recovery
                    self._journal.write_snapshot(self._slab_paths(), self._index_json())
            except BaseException:
                self._nvme.close(remove=False)
                if lock is not None:
                    lock.release()
                raise

    # -- plumbing ---------------------------------------------------------------------

    def _slab_paths(self) -> list[str]:
        return [s.path for s in self._nvme.slabs]

    def _index_json(self) -> dict[str, list[Any]]:
        nv = self._nvme  # storetrust: each entry's checksum
        return {
            str(k): [e.meta.to_json(), e.disk or [], nv.checksum_of(e.disk)] for k, e in self._index.items()
        }

    def _enter(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise StoreClosedError("the store is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise StoreClosedError(
                "this TieredStore belongs to another event loop (use one store per loop, "
                "or SyncTieredStore from blocking code)"
            )
        return loop

    def _deadline(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        return None if t is None else asyncio.get_running_loop().time() + t

    def _lookup(self, key: Hashable) -> Entry:
        e = self._index.get(key)
        if e is None:
            self._nvme.stats["misses"] += 1
            raise StoreKeyError(key)
        return e

    def _writer(self, *keys: Hashable) -> _Writers:
        """Puts, deletes (and compaction moves) of a key run one at a time, in
        call order, even when one call writes several keys (put_many): the
        call takes a ticket on every key's queue at once, when it starts, so
        a later call never overtakes it and no two calls wait on each other."""
        return _Writers(self._klocks, keys)

    async def _copy(self, dst: Any, src: Any) -> None:
        """dst[:] = src; large copies in parallel slices on threads (numpy and
        torch release the GIL), awaited to the end even if cancelled."""
        n = len(dst)
        if n < self.copy_threshold or is_cuda(dst) or is_cuda(src):
            _copy_into(dst, src)
            return
        if self._copy_pool is None:
            self._copy_pool = concurrent.futures.ThreadPoolExecutor(
                self.copy_threads, thread_name_prefix="aionvme-store-copy"
            )
        loop = asyncio.get_running_loop()
        k = max(1, min(self.copy_threads, n // self.copy_slice))
        step = round_up(-(-n // k))
        futs = [
            loop.run_in_executor(self._copy_pool, _copy_into, dst[o : o + step], src[o : o + step])
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

    def _hit_now(self, e: Entry, out: Any) -> Any:
        """A CPU get served from the host tier with no suspension point (so no
        reference count, no task switch, no notify): the value, or None where
        the general path must serve it (not in host memory, a copy large
        enough for threads, a CUDA ``out``)."""
        off = e.host
        meta = e.meta
        n = meta.nbytes
        if off is None or n == 0 or n >= self.copy_threshold:
            return None
        h = self._host
        src = h.arena[off : off + n]
        if out is None:
            # allocate and copy in one call (a torch value: torch's own memory, as torch.empty gives)
            value = view_as(src, meta)
            value = value.copy() if meta.kind == "numpy" else value.clone()
        elif isinstance(out, np.ndarray):
            np.copyto(check_out(out, meta), src)
            value = out
        else:
            if is_cuda(out):
                return None
            _copy_into(check_out(out, meta), src)
            value = out
        st = h.stats
        st["hits"] += 1
        st["bytes_out"] += n
        h.touch(e)
        return value

    # -- copies: release ----------------------------------------------------------------

    def _unref_host(self, e: Entry) -> None:
        e.refs -= 1
        if e.refs == 0:
            if e.dead and e.host is not None:
                self._host.free(e.host, e.nbytes)
                e.host = None
            else:
                self._host.notify()

    def _unref_gpu(self, e: Entry) -> None:
        e.gpu_refs -= 1
        if e.gpu_refs == 0 and self._gpu is not None:
            if e.dead and e.gpu is not None:
                self._gpu.free(e.gpu, e.nbytes)
                e.gpu = None
            else:
                self._gpu.notify()

    def _unref_disk(self, e: Entry) -> None:
        e.disk_refs -= 1
        if e.disk_refs == 0 and e.dead and e.disk is not None and not e.moving:
            self._nvme.free(e.disk)
            e.disk = None

    def _retire(self, e: Entry) -> None:
        """The entry was replaced or deleted: free each copy now, or when its last reader ends."""
        e.dead = True
        self._host.discard(e)
        self._dirty.pop(e, None)
        if self._gpu is not None:
            self._gpu.discard(e)
        if e.host is not None and e.refs == 0 and not e.moving:
            self._host.free(e.host, e.nbytes)
            e.host = None
        if e.gpu is not None and e.gpu_refs == 0 and self._gpu is not None:
            self._gpu.free(e.gpu, e.nbytes)
            e.gpu = None
        if e.disk is not None and e.disk_refs == 0 and not e.moving:
            self._nvme.free(e.disk)
            e.disk = None

    def _drop_host(self, e: Entry) -> None:
        """Evict a live entry's host copy (it has another copy)."""
        if e.host is None:
            return
        self._host.discard(e)
        self._dirty.pop(e, None)
        self._host.free(e.host, e.nbytes)
        e.host = None
        self._host.stats["evictions"] += 1
        self._host.stats["bytes_out"] += e.nbytes

    def _drop_gpu(self, e: Entry) -> None:
        if e.gpu is None or self._gpu is None:
            return
        self._gpu.discard(e)
        self._gpu.free(e.gpu, e.nbytes)
        e.gpu = None
        self._gpu.stats["evictions"] += 1
        self._gpu.stats["bytes_out"] += e.nbytes

    # -- making room ---------------------------------------------------------------------

    def _evictable(self, tier: MemTier, e: Entry) -> bool:
        if tier is self._host:
            return e.refs == 0 and not e.claims and not e.moving and e.loading is None and e.host is not None
        return e.gpu_refs == 0 and not e.gpu_claims and e.gpu_loading is None and e.gpu is not None

    async def _make_room(
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
        value reached the tier another way): then None, without allocating."""
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
                if tier is self._host and self._cleaners:
                    # the coldest values are being written already: drop clean
                    # ones if that makes room, else wait for a batch to end
                    # (its values drop at once) rather than evict hotter ones
                    clean: list[Entry] = []
                    got_b = 0
                    for cand in tier.policy.victims():  # in the policy's order
                        c: Entry = cand  # type: ignore[assignment]
                        if c not in tier.entries or c.moving:
                            if c.moving:
                                break  # being written: it goes first, once clean
                            continue
                        if not self._evictable(tier, c):
                            continue  # held or loading
                        if c.disk is None and c.gpu is None:
                            break  # dirty: never evict a later victim before it
                        clean.append(c)
                        got_b += round_up(c.nbytes)
                        if got_b >= short:
                            break
                    if clean and got_b >= short:
                        for c in clean:
                            self._drop_host(c)
                    else:
                        await asyncio.wait(set(self._cleaners), return_when=asyncio.FIRST_COMPLETED)
                    continue
                victims: list[Entry] = []
                freed = 0
                for cand in tier.policy.victims():
                    e: Entry = cand  # type: ignore[assignment]
                    if e not in tier.entries or not self._evictable(tier, e):
                        continue
                    victims.append(e)
                    freed += round_up(e.nbytes)
                    if freed >= max(short, 1) and len(victims) >= 1:
                        break
                if victims:
                    if tier is self._host:
                        await self._demote_host(victims)
                    else:
                        await self._demote_gpu(victims, deadline)
                    continue
                if not wait:
                    raise StoreTimeoutError(f"no room in the {tier.name} tier for {what} without waiting")
                await tier.wait_change(deadline, what)

    async def _demote_host(self, victims: list[Entry]) -> None:
        """Move host copies out: entries with another copy are dropped; the
        others are written to NVMe first (one batched write per slab)."""
        dirty: list[Entry] = []
        for e in victims:
            if e.disk is not None or e.gpu is not None:
                self._drop_host(e)
            else:
                dirty.append(e)
        if not dirty:
            return
        for e in dirty:
            e.moving = True
            e.refs += 1
        exts: list[Extents] = []
        try:
            for e in dirty:
                exts.append(await self._nvme.allocate(e.nbytes, e.host))  # type: ignore[arg-type]
            jobs = [(x, self._host.view(e.host, e.nbytes, True)) for x, e in zip(exts, dirty)]  # type: ignore[arg-type]
            await self._nvme.write(jobs)
        except BaseException:
            for x in exts:
                self._nvme.free(x)
            raise
        finally:
            for e in dirty:
                e.moving = False
        for x, e in zip(exts, dirty):
            if e.dead or e.disk is not None:
                self._nvme.free(x)
            else:
                e.disk = x
        for e in dirty:
            e.refs -= 1
            if e.dead:
                if e.refs == 0 and e.host is not None:
                    self._host.free(e.host, e.nbytes)
                    e.host = None
            elif e.refs == 0:
                self._drop_host(e)
        self._host.notify()  # waiters on `moving` (a write-through of these entries)

    async def _demote_gpu(self, victims: list[Entry], deadline: float | None) -> None:
        for e in victims:
            if e.host is not None or e.disk is not None:
                self._drop_gpu(e)
                continue
            e.gpu_refs += 1
            try:
                if self._host.capacity >= e.nbytes and e.nbytes <= self._host.capacity:
                    await self._load_host(e, deadline)
                else:
                    x = await self._nvme.allocate(e.nbytes)
                    try:
                        await self._nvme.write([(x, e.gpu[: e.nbytes])])
                    except BaseException:
                        self._nvme.free(x)
                        raise
                    if e.dead or e.disk is not None:
                        self._nvme.free(x)
                    else:
                        e.disk = x
            finally:
                self._unref_gpu(e)
            if not e.dead and e.gpu_refs == 0 and (e.host is not None or e.disk is not None):
                self._drop_gpu(e)

    # -- loading into the memory tiers ---------------------------------------------------

    def _start_load(
        self, e: Entry, deadline: float | None, gpu: bool = False, wait: bool = True
    ) -> asyncio.Task[None]:
        """The task that brings e into the host (or GPU) tier; one per entry and tier."""
        t = e.gpu_loading if gpu else e.loading
        if t is not None:
            return t
        coro = self._load_gpu(e, deadline, wait) if gpu else self._load_host(e, deadline, wait)
        t = asyncio.get_running_loop().create_task(coro)
        if gpu:
            e.gpu_loading = t
        else:
            e.loading = t
        self._tasks.add(t)
        if not wait:
            self._nowait_loads.add(t)

        def done(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            self._nowait_loads.discard(task)
            if gpu:
                if e.gpu_loading is task:
                    e.gpu_loading = None
                    if self._gpu is not None:
                        self._gpu.notify()
            elif e.loading is task:
                e.loading = None
                # a loading entry is not evictable: a put that found nothing
                # else to evict waits for this (add() woke it too early)
                self._host.notify()
            if not task.cancelled() and task.exception() is not None and wait:
                self.errors.append(task.exception())  # type: ignore[arg-type]
                del self.errors[:-16]

        t.add_done_callback(done)
        return t

    async def _load_host(self, e: Entry, deadline: float | None, wait: bool = True) -> None:
        if e.host is not None or e.dead:
            return
        # moot: a get's promotion put the value in the tier meanwhile (a load
        # is not evictable, so waiting on would wait for itself)
        off = await self._make_room(
            self._host,
            e.nbytes,
            deadline,
            f"{e.key!r}",
            wait,
            phase_of(e.disk),
            lambda: e.host is not None or e.dead,
        )
        if off is None:
            return
        try:
            dst = self._host.view(off, e.nbytes, True)
            if e.host is not None or e.dead:
                return
            if e.gpu is not None:
                e.gpu_refs += 1
                try:
                    _as_torch(dst[: e.nbytes]).copy_(e.gpu[: e.nbytes])
                finally:
                    self._unref_gpu(e)
            elif e.disk is not None:
                e.disk_refs += 1
                try:
                    p = off % ALIGN
                    whole = self._host.arena[off - p : off - p + round_up(p + e.nbytes)]
                    await self._nvme.read([_read_job(e.disk, dst, whole, e.nbytes)], [e.key])
                finally:
                    self._unref_disk(e)
                self._nvme.stats["hits"] += 1
            else:
                return
            if e.host is not None or e.dead:
                return
            e.host, off = off, -1
            self._host.add(e)
        finally:
            if off >= 0:
                self._host.free(off, e.nbytes)

    async def _load_gpu(self, e: Entry, deadline: float | None, wait: bool = True) -> None:
        gpu = self._gpu
        if gpu is None or e.gpu is not None or e.dead:
            return
        t = await self._make_room(
            gpu, e.nbytes, deadline, f"{e.key!r}", wait, moot=lambda: e.gpu is not None or e.dead
        )
        if t is None:
            return
        try:
            if e.gpu is not None or e.dead:
                return
            if e.host is not None:
                e.refs += 1
                try:
                    t[: e.nbytes].copy_(_as_torch(self._host.view(e.host, e.nbytes)), non_blocking=False)
                finally:
                    self._unref_host(e)
            elif e.disk is not None:
                e.disk_refs += 1
                try:
                    await self._nvme.read([(e.disk, t)], [e.key])
                finally:
                    self._unref_disk(e)
                self._nvme.stats["hits"] += 1
            else:
                return
            if e.gpu is not None or e.dead:
                return
            e.gpu, t = t, None
            gpu.add(e)
        finally:
            if t is not None:
                gpu.free(t, e.nbytes)

    # -- put ------------------------------------------------------------------------------

    async def put(
        self, key: Hashable, value: Any, *, to: str | None = None, timeout: float | None = None
    ) -> None:
        """Store a copy of ``value`` (numpy array or torch tensor) under ``key``.

        Replaces what the key held. Waits for room while the tier it lands in
        is full of held values (:class:`StoreTimeoutError` after ``timeout``).
        With ``persist=True``, returns once the value and its index record are durable.

        Parameters
        ----------
        to : {None, 'host', 'nvme'}
            Where the value lands. None: the hottest tier with room (a CUDA
            tensor in the GPU tier, else host memory); what it pushes out moves
            colder. 'host': host memory even for a CUDA tensor. 'nvme': written
            straight from ``value`` to the NVMe tier, with no copy in memory
            and nothing evicted (a swap-out of a value known to be cold); it
            returns once the bytes are written. In a scratch store
            (persist=False) a swap-out of a key whose old value has the same
            size and is not in use overwrites the old value's pages in place,
            so a swap loop rewrites the same blocks every step: reads of the
            key meanwhile wait for the new value; cancelling such a put
            finishes the write first (the new value stays) and an I/O error
            removes the key (its old bytes were partly overwritten).

        Raises
        ------
        StoreFullError
            No room in the NVMe tier (an ``OSError`` with errno ENOSPC).
        """
        await self.put_many({key: value}, to=to, timeout=timeout)

    async def put_many(
        self, items: Mapping[K, Any], *, to: str | None = None, timeout: float | None = None
    ) -> None:
        """put each key and value; NVMe writes of the batch go as one request per slab."""
        if to not in (None, "host", "nvme"):
            raise ValueError(f"to must be None, 'host' or 'nvme', got {to!r}")
        self._enter()
        check_keys(items, self.persist)  # storetrust: StoreKeyTypeError
        metas = {k: describe(v) for k, v in items.items()}
        deadline = self._deadline(timeout)
        reused: list[Entry] = []  # previous entries whose extents this put overwrites
        cancelled: BaseException | None = None
        async with self._writer(*items):
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
                    elif (
                        to is None and is_cuda(v) and self._gpu is not None and e.nbytes <= self._gpu.capacity
                    ):
                        t = await self._make_room(self._gpu, e.nbytes, deadline, f"{k!r}")
                        e.gpu = t
                        t[: e.nbytes].copy_(src)
                        self._gpu.add(e)
                    elif 0 < e.nbytes <= self._host.capacity:
                        off = await self._make_room(self._host, e.nbytes, deadline, f"{k!r}")
                        e.host = off
                        e.refs += 1  # not evictable while being filled
                        self._kick_cleaner()  # write colder values out while this one is copied in
                        try:
                            if is_cuda(src):
                                _as_torch(self._host.view(off, e.nbytes)).copy_(src)
                            else:
                                await self._copy(self._host.view(off, e.nbytes), src)
                        finally:
                            e.refs -= 1
                        self._host.add(e)
                        if not self.persist:
                            self._dirty[e] = None
                    else:
                        bypass.append((e, src))
                # straight to NVMe: values no memory tier can take
                while True:
                    plans = [(e, src, self._reusable(e, src)) for e, src in bypass if e.disk is None]
                    late = [(e, src) for e, src, reuse in plans if reuse is None]
                    if not late:
                        # overwrite the previous values' pages in place: taken
                        # with no await between here and the write's start, so
                        # a cancellation before it leaves them whole; their
                        # readers wait for this put (see Entry.replaced)
                        for e, _src, reuse in plans:
                            prev, e.disk = reuse  # type: ignore[misc]
                            self._drop_host(prev)
                            self._drop_gpu(prev)
                            prev.disk = None
                            prev.dead = True
                            prev.replaced = asyncio.get_running_loop().create_future()
                            reused.append(prev)
                        break
                    for e, src in late:  # new space (each await may change what is reusable)
                        e.disk = await self._nvme.allocate(e.nbytes, address(src))
                if bypass:
                    jobs = [(e.disk, src) for e, src in bypass]
                    if reused:
                        cancelled = await _to_the_end(self._nvme.write(jobs))  # type: ignore[arg-type]
                    else:
                        await self._nvme.write(jobs)  # type: ignore[arg-type]
                if self.persist:
                    await self._write_through(new)
                    if bypass or any(e.nbytes for e in new):
                        await self._nvme.fsync()
                    await self._journal_put(new)
            except BaseException:
                for e in new:
                    self._retire(e)
                for prev in reused:  # its bytes were being overwritten: the key is gone
                    if self._index.get(prev.key) is prev:
                        del self._index[prev.key]
                    self._retire(prev)
                    prev.replaced.set_result(None)  # type: ignore[union-attr]
                raise
            for e in new:
                old = self._index.get(e.key)
                self._index[e.key] = e
                if old is not None:
                    self._retire(old)
            for prev in reused:
                prev.replaced.set_result(None)  # type: ignore[union-attr]
        self._kick_cleaner()
        if cancelled is not None:
            raise cancelled

    def _reusable(self, e: Entry, src: Any) -> tuple[Entry, Extents] | None:
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
        prev = self._index.get(e.key)
        if (
            prev is None
            or prev.dead
            or prev.disk is None
            or prev.nbytes != e.nbytes
            or prev.refs
            or prev.gpu_refs
            or prev.disk_refs
            or prev.moving
            or prev.loading is not None
            or prev.gpu_loading is not None
            or any(x[0] < 0 for x in prev.disk)
        ):
            return None
        want = self._nvme.placement_phase(e.nbytes, address(src))
        if len(prev.disk) != 1:
            return (prev, prev.disk) if want == 0 else None
        # one piece: the same whole pages, at the new phase where that needs no other page
        i, off, _, n = prev.disk[0]
        p = off % ALIGN
        if round_up(p + n) != round_up(want + n):
            return None
        return prev, [(i, off - p + want, 0, n)]

    # -- write-back cleaning ------------------------------------------------------------

    def _kick_cleaner(self) -> None:
        """persist=False write-behind: while the host tier is at least three
        quarters full, write its coldest values that have no NVMe copy yet,
        in batches of up to ``clean_batch`` bytes (and at most half the
        in-flight budget, so two batches overlap), with up to a quarter of the
        tier in flight, and always at least two batches of one value each
        (a small tier whose every put evicts keeps the device busy with the
        next value while the previous one is written). They stay in memory,
        now clean, so the put that needs room later drops them at once
        instead of waiting for a write: evictions overlap with the puts (and
        copies) that cause them, and the device always has the next batch
        queued. Each batch that ends starts the next."""
        h = self._host
        if self.persist or self._closed:
            return
        budget = max(h.capacity // 4, 1)
        if h.used * 4 < h.capacity * 3:
            return
        if self._clean_bytes >= budget and len(self._cleaners) >= 2:
            return
        dirty_now = self._dirty_candidates(budget - self._clean_bytes + 2 * self.clean_batch)
        per_batch = min(self.clean_batch, max(budget // 2, 1))
        loop = asyncio.get_running_loop()
        started = False
        i = 0
        while i < len(dirty_now) and (self._clean_bytes < budget or len(self._cleaners) < 2):
            room = min(max(budget - self._clean_bytes, 0), per_batch)
            batch: list[Entry] = []
            total = 0
            while i < len(dirty_now):
                n = round_up(dirty_now[i].nbytes)
                if total + n > room and batch:
                    break  # the next batch starts with it
                batch.append(dirty_now[i])
                total += n
                i += 1
                if total >= room:
                    break
            for e in batch:
                e.moving = True
                e.refs += 1
            self._clean_bytes += total
            # Where free space takes the batch, its write is queued here and
            # handed to the kernel before returning: a caller that puts again
            # without suspending (a host tier with clean values to drop) would
            # otherwise leave the device idle until its next suspension.
            exts = self._try_allocate(batch)
            pending = None
            if exts is not None:
                pending = self._nvme.start_write(self._clean_jobs(exts, batch))
                started = True
            task = loop.create_task(self._clean(batch, exts, pending))
            self._cleaners.add(task)
            self._tasks.add(task)
            task.add_done_callback(
                lambda t, total=total, b=batch, p=pending: self._cleaned(t, total, b, p)  # type: ignore[misc]
            )
        if started:
            get_reactor(loop).flush_now()

    def _clean_jobs(self, exts: list[Extents], batch: list[Entry]) -> list[tuple[Extents, Any]]:
        """The NVMe tier's write jobs of a write-behind batch: each value's
        host copy, in whole pages, to its extents."""
        return [(x, self._host.view(e.host, e.nbytes, True)) for x, e in zip(exts, batch)]  # type: ignore[arg-type]

    def _try_allocate(self, batch: list[Entry]) -> list[Extents] | None:
        """NVMe extents for each entry of a write-behind batch from free space,
        without waiting; None (nothing allocated) where one needs a slab to grow."""
        exts: list[Extents] = []
        for e in batch:
            x = self._nvme.try_allocate(e.nbytes, e.host)  # type: ignore[arg-type]
            if x is None:
                for got in exts:
                    self._nvme.free(got)
                return None
            exts.append(x)
        return exts

    def _dirty_candidates(self, want: int) -> list[Entry]:
        """Dirty host values that can be written now, oldest put first, about
        ``want`` bytes of them; entries no longer dirty leave ``_dirty``."""
        h = self._host
        got: list[Entry] = []
        gone: list[Entry] = []
        n = 0
        for e in self._dirty:
            if e.disk is not None or e.gpu is not None or e.host is None or e.dead or e not in h.entries:
                gone.append(e)  # written, copied elsewhere, or out of the tier
                continue
            if e.refs or e.moving or e.loading is not None:
                continue  # busy now: a later kick takes it
            got.append(e)
            n += round_up(e.nbytes)
            if n >= want:
                break
        for e in gone:
            del self._dirty[e]
        return got

    def _cleaned(
        self,
        t: asyncio.Task[None],
        nbytes: int,
        batch: list[Entry] | None = None,
        pending: Coroutine[Any, Any, None] | None = None,
    ) -> None:
        self._tasks.discard(t)
        self._cleaners.discard(t)
        self._clean_bytes -= nbytes
        if t.cancelled():
            if pending is not None and inspect.getcoroutinestate(pending) == inspect.CORO_CREATED:
                # cancelled before it ran (a loop shutting down): _clean's own
                # cleanup never ran. The write goes on unawaited, so its extents
                # stay allocated (it may still land there) and the values stay
                # dirty, but they are no longer pinned.
                pending.close()
                for e in batch or ():
                    e.moving = False
                    self._unref_host(e)
                self._host.notify()
            return
        if t.exception() is not None:
            self.errors.append(t.exception())  # type: ignore[arg-type]
            del self.errors[:-16]
            return  # no retry from here (a full disk would spin): the next put or eviction tries
        self._kick_cleaner()

    async def _clean(
        self,
        dirty: list[Entry],
        got: list[Extents] | None = None,
        pending: Coroutine[Any, Any, None] | None = None,
    ) -> None:
        """Write one write-behind batch (its entries are marked moving and
        referenced); ``got`` and ``pending``: its extents and its write, where
        :meth:`_kick_cleaner` started it already."""
        h = self._host
        exts: list[Extents] = got if got is not None else []
        try:
            if pending is not None:
                await pending
            else:
                for e in dirty:
                    exts.append(await self._nvme.allocate(e.nbytes, e.host))  # type: ignore[arg-type]
                await self._nvme.write(self._clean_jobs(exts, dirty))
        except BaseException:
            for x in exts:
                self._nvme.free(x)
            raise
        finally:
            for e in dirty:
                e.moving = False
                self._unref_host(e)
            h.notify()
        for x, e in zip(exts, dirty):
            if e.dead or e.disk is not None:
                self._nvme.free(x)
            else:
                e.disk = x

    async def _write_through(self, entries: list[Entry]) -> None:
        """persist=True: the NVMe copy of new entries (they stay in memory, clean).

        New entries are already evictable, so a demotion may be writing one
        meanwhile: those are left to it and waited for. The copies written
        here are pinned until the write ends, and ``disk`` is set only then.
        """
        todo = [e for e in entries if e.nbytes and e.disk is None and not e.moving and not e.dead]
        for e in todo:
            if e.host is not None:
                e.refs += 1
            else:
                e.gpu_refs += 1
        exts: list[Extents] = []
        try:
            for e in todo:
                exts.append(await self._nvme.allocate(e.nbytes, e.host or 0))
            jobs = []
            for e, x in zip(todo, exts):
                if e.host is not None:
                    jobs.append((x, self._host.view(e.host, e.nbytes, True)))
                else:
                    jobs.append((x, e.gpu[: round_up(e.nbytes)]))
            await self._nvme.write(jobs)
        except BaseException:
            for x in exts:
                self._nvme.free(x)
            raise
        finally:
            for e in todo:
                if e.host is not None and e.refs > 0:
                    self._unref_host(e)
                else:
                    self._unref_gpu(e)
        for e, x in zip(todo, exts):
            if e.disk is None and not e.dead:
                e.disk = x
            else:
                self._nvme.free(x)
        while any(e.moving for e in entries):
            await self._host.wait_change(None, "a demotion of a value being put")

    async def _journal_put(self, entries: list[Entry]) -> None:
        if self._journal is None:
            return
        sums = self._nvme.checksum_of  # storetrust: + each value's checksum
        await self._journal.append(
            [
                {"op": "put", "k": e.key, "m": e.meta.to_json(), "x": e.disk or [], "c": sums(e.disk)}
                for e in entries
            ]
        )

    # -- get ------------------------------------------------------------------------------

    async def get(
        self, key: Hashable, device: str = "cpu", *, out: Any = None, timeout: float | None = None
    ) -> Any:
        """A new array or tensor with the bytes, dtype and shape that were put.

        Parameters
        ----------
        device : str
            'cpu', or 'cuda[:N]' for a torch value.
        out : array or tensor, optional
            Fill this (same number of bytes, contiguous) instead of allocating.

        Raises
        ------
        StoreKeyError
            The key is not in the store (a ``KeyError``).

        Notes
        -----
        A hit in a memory tier is a copy; a miss reads from NVMe straight into
        the result (page-aligned) and, if the admission policy agrees, also
        into the host tier (promotion). A get waits for a prefetch of the key
        in flight. The result never aliases the store's memory.
        """
        self._enter()
        e = self._lookup(key)
        if device == "cpu" and e.host is not None:
            value = self._hit_now(e, out)
            if value is not None:
                return value
        return await self._get_entry(e, str(device), out, self._deadline(timeout))

    async def _get_entry(
        self, e: Entry, device: str, out: Any, deadline: float | None, direct: bool = False
    ) -> Any:
        meta = e.meta
        cuda = device.startswith("cuda")
        span = None  # the whole pages around a fresh CPU result (see NvmeTier.read)
        if out is not None:
            raw = check_out(out, meta)
            value = out
            cuda = is_cuda(out)
        elif device == "cpu" and meta.nbytes:
            value, raw, span = result_span(meta, phase_of(e.disk))
        else:
            value, raw = result_like(meta, device, aligned=True, nbytes=round_up(meta.nbytes))
        if meta.nbytes == 0:
            return value
        # a hit: the copy in the tier asked for was there, or on its way (a
        # prefetch), when the get began
        if cuda and self._gpu is not None:
            hit = e.gpu is not None or e.gpu_loading is not None
            self._gpu.stats["hits" if hit else "misses"] += 1
        elif not cuda:
            hit = e.host is not None or e.loading is not None
            self._host.stats["hits" if hit else "misses"] += 1
        cuda_direct = direct
        for _ in range(8):
            if (
                cuda
                and self._gpu is not None
                and e.gpu is None
                and e.gpu_loading is None
                and not cuda_direct
                and e.nbytes <= self._gpu.capacity
                and self.admission.admit(e.key, e.nbytes)
            ):
                self._start_load(e, deadline, gpu=True, wait=False)
            if e.gpu is not None:
                e.gpu_refs += 1
                try:
                    raw[: meta.nbytes].copy_(e.gpu[: meta.nbytes])
                finally:
                    self._unref_gpu(e)
                self._gpu.touch(e)  # type: ignore[union-attr]
                return value
            if cuda and e.gpu_loading is not None and not cuda_direct:
                if not await self._await_load(e, e.gpu_loading, gpu=True):
                    cuda_direct = True
                continue
            if (
                e.host is None
                and e.loading is None
                and e.disk is not None
                and not cuda
                and not direct
                and 0 < e.nbytes <= self._host.capacity
                and self.admission.admit(e.key, e.nbytes)
            ):
                self._start_load(e, deadline, wait=False)
            if e.loading is not None and e.host is None and not direct:
                if not await self._await_load(e, e.loading):
                    direct = True  # no room to promote: read straight into the result
                continue
            if e.host is not None:
                e.refs += 1
                try:
                    src = self._host.view(e.host, meta.nbytes)
                    if cuda:
                        _as_torch(raw[: meta.nbytes]).copy_(_as_torch(src))
                    else:
                        await self._copy(raw[: meta.nbytes], src)
                finally:
                    self._unref_host(e)
                self._host.stats["bytes_out"] += meta.nbytes
                self._host.touch(e)
                return value
            if e.disk is not None:
                e.disk_refs += 1
                try:
                    await self._nvme.read([_read_job(e.disk, raw, span, meta.nbytes)], [e.key])
                finally:
                    self._unref_disk(e)
                self._nvme.stats["hits"] += 1
                return value
            break
        # every copy went away under us: the key was deleted or replaced
        if e.replaced is not None:
            await asyncio.shield(e.replaced)  # a put overwriting it in place
        cur = self._index.get(e.key)
        if cur is None:
            raise StoreKeyError(e.key)
        # the same value, whose loads kept losing their copies to evictions:
        # read it without promoting
        return await self._get_entry(cur, device, out, deadline, direct=cur is e)

    async def _promote_from(self, e: Entry, raw: Any) -> None:
        """Copy a value just read from NVMe (``raw``, its bytes) into the host
        tier, if room can be made without waiting."""
        if e.host is not None or e.loading is not None or e.dead:
            return
        try:
            off = await self._make_room(
                self._host, e.nbytes, None, f"{e.key!r}", wait=False, phase=phase_of(e.disk)
            )
        except (StoreFullError, StoreTimeoutError):
            return  # no room now (or no disk room to evict to): the value stays on NVMe
        try:
            if e.host is not None or e.dead:
                return
            await self._copy(self._host.view(off, e.nbytes), raw[: e.nbytes])
            if e.host is not None or e.dead:
                return
            e.host, off = off, -1
            self._host.add(e)
        finally:
            if off >= 0:
                self._host.free(off, e.nbytes)

    async def _claimed(self, e: Entry, task: asyncio.Task[None], gpu: bool) -> None:
        """Await e's load into the host (GPU) tier holding a claim on what it
        brings (see Entry.claims): the caller takes it before its next
        suspension point."""
        if gpu:
            e.gpu_claims += 1
        else:
            e.claims += 1
        try:
            await asyncio.shield(task)
        finally:
            # evictable again once the caller has taken its reference (it does
            # so before the waiters woken here run)
            if gpu:
                e.gpu_claims -= 1
                if e.gpu_claims == 0 and self._gpu is not None:
                    self._gpu.notify()
            else:
                e.claims -= 1
                if e.claims == 0:
                    self._host.notify()

    async def _join_load(self, e: Entry, task: asyncio.Task[None], gpu: bool = False) -> bool:
        """Wait for a load a hold needs: False if it was someone else's load
        that would not wait for room and found none (the hold then starts
        its own, which waits); its own load's errors are raised."""
        nowait = task in self._nowait_loads
        try:
            await self._claimed(e, task, gpu)
        except (StoreFullError, StoreTimeoutError):
            if nowait:
                await asyncio.sleep(0)  # its done callback has run: the next _start_load is ours
                return False
            raise
        return True

    async def _await_load(self, e: Entry, task: asyncio.Task[None], gpu: bool = False) -> bool:
        """Wait for a load; False if it found no room (the caller reads directly instead)."""
        try:
            await self._claimed(e, task, gpu)
        except (StoreFullError, StoreTimeoutError):
            return False
        return True

    async def get_many(
        self,
        keys: Iterable[Hashable],
        device: str = "cpu",
        *,
        out: Sequence[Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """get of each key, in order (``out``: fill these arrays or tensors,
        one per key, as ``get(out=)`` does, and return them).

        Values only on NVMe are read straight into their results, all in one
        request per slab; then, where the admission policy agrees, the last
        of them that fit in the host tier are copied into it (promotion that
        never waits for room: a batch larger than the tier does not evict its
        own values one by one).
        """
        self._enter()
        ks = list(keys)
        entries = [self._lookup(k) for k in ks]
        deadline = self._deadline(timeout)
        dests: list[Any] = [None] * len(ks)
        if out is not None:
            dests = list(out)
            if len(dests) != len(ks):
                raise ValueError(f"out has {len(dests)} buffers for {len(ks)} keys")
            for d, e in zip(dests, entries):
                check_out(d, e.meta)
        res: list[Any] = [None] * len(ks)
        cold: list[tuple[int, Entry, Any, Any]] = []
        jobs: list[tuple[Any, ...]] = []  # their NVMe reads
        warm: list[int] = []
        admitted: list[tuple[Entry, Any]] = []
        for i, e in enumerate(entries):
            d = dests[i]
            if (
                str(device) == "cpu"
                and (d is None or not is_cuda(d))
                and e.nbytes > 0
                and e.host is None
                and e.loading is None
                and e.gpu is None
                and e.disk is not None
            ):
                # only on NVMe: read straight into the result with the others
                # (one batched request per slab), promote afterwards
                span = None
                if d is None:
                    value, raw, span = result_span(e.meta, phase_of(e.disk))
                else:
                    value, raw = d, check_out(d, e.meta)
                cold.append((i, e, value, raw))
                jobs.append(_read_job(e.disk, raw, span, e.nbytes))
                if 0 < e.nbytes <= self._host.capacity and self.admission.admit(e.key, e.nbytes):
                    admitted.append((e, raw))
            else:
                warm.append(i)
        for _, e, _, _ in cold:
            e.disk_refs += 1
        try:
            if cold:
                await self._nvme.read(jobs, [e.key for _, e, _, _ in cold])
        finally:
            for _, e, _, _ in cold:
                self._unref_disk(e)
        for i, _, value, _ in cold:
            res[i] = value
        self._host.stats["misses"] += len(cold)
        self._nvme.stats["hits"] += len(cold)
        # promotion: a batch larger than the host tier promotes only its last
        # values that fit (the earlier ones would only evict each other)
        room = self._host.capacity
        keep = 0
        for e, _raw in reversed(admitted):
            if round_up(e.nbytes) > room:
                break
            room -= round_up(e.nbytes)
            keep += 1
        for e, raw in admitted[len(admitted) - keep :]:
            await self._promote_from(e, raw)
        if warm:
            # every get ends before this returns or raises: none is left copying into an out= buffer
            got = await asyncio.gather(
                *(self._get_entry(entries[i], str(device), dests[i], deadline) for i in warm),
                return_exceptions=True,
            )
            for r in got:
                if isinstance(r, BaseException):
                    raise r
            for i, v in zip(warm, got):
                res[i] = v
        return res

    # -- attach: read-only values backed by a region of an existing file ----------------------

    async def attach(
        self,
        key: Hashable,
        path: str | os.PathLike[str],
        offset: int,
        shape: Sequence[int],
        dtype: str = "uint8",
        *,
        like: str = "torch",
    ) -> None:
        """Add a read-only value whose NVMe copy is a region of an existing file.

        Parameters
        ----------
        key : hashable
            Its key (an existing key is replaced, as by ``put``).
        path : str or os.PathLike
            The file (a safetensors shard, a raw weight file...). It is opened
            once per store, read only, never written, and not removed by
            :meth:`close`.
        offset : int
            Where the value's bytes start in the file (any offset).
        shape, dtype : sequence of int, str
            The value's shape and dtype name (``"bfloat16"``, ``"float32"``;
            a numpy dtype string with ``like="numpy"``): ``nbytes`` follow.
        like : {'torch', 'numpy'}
            What ``get`` and ``hold`` return.

        Raises
        ------
        AttachError
            A persistent store (``persist=True``), a region past the end of the
            file, or a negative offset. ``OSError`` (with the filename) if the
            file cannot be opened.

        Notes
        -----
        Nothing is copied: the file *is* the key's NVMe tier. ``get``,
        ``get_many``, ``prefetch`` and ``hold`` read it (straight into the
        result, or into the host tier under its capacity and eviction policy,
        as for any key); evicting its host copy drops it, since the file still
        holds the bytes, so an attached value is never written back. The file
        must not change while attached. ``put`` or ``delete`` of the key
        forgets the region (the file is left alone).
        """
        self._enter()
        if self.persist:
            raise AttachError(
                "attach() needs a scratch store (persist=False): its index cannot name other files"
            )
        if like == "torch":
            import torch

            from ._values import torch_dtype

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
        loop = asyncio.get_running_loop()
        fname = os.fspath(path)
        si, size = await loop.run_in_executor(None, self._nvme.source, fname)
        if offset + nbytes > size:
            raise AttachError(
                f"{fname}: the region [{offset}, {offset + nbytes}) is past the end of the file "
                f"({size} bytes)"
            )
        async with self._writer(key):
            e = Entry(key, Meta(like, name, shp, nbytes))
            e.disk = [(si, int(offset), 0, nbytes)] if nbytes else None
            old = self._index.get(key)
            self._index[key] = e
            if old is not None:
                self._retire(old)
            self.admission.forget(key)

    # -- prefetch / hold / evict / delete --------------------------------------------------

    async def prefetch(
        self, keys: Iterable[Hashable], to: str = "host", *, timeout: float | None = None
    ) -> None:
        """Start moving keys into the host (or 'gpu') tier and return at once.

        A ``get`` or ``hold`` of a key in flight waits for it. Missing keys
        raise StoreKeyError before anything starts. Failures of a prefetch
        nobody waited for are kept in ``store.errors``.
        """
        self._enter()
        if to not in ("host", "cpu", "gpu", "cuda"):
            raise ValueError(f"to must be 'host' or 'gpu', got {to!r}")
        gpu = to in ("gpu", "cuda")
        if gpu and self._gpu is None:
            raise DeviceError("prefetch to the GPU tier of a store without one (gpu=None)")
        entries = [self._lookup(k) for k in keys]
        deadline = self._deadline(timeout)
        for e in entries:
            if e.nbytes == 0:
                continue
            if gpu:
                if e.gpu is None and e.nbytes <= self._gpu.capacity:  # type: ignore[union-attr]
                    self._start_load(e, deadline, gpu=True)
            elif e.host is None and 0 < e.nbytes <= self._host.capacity:
                self._start_load(e, deadline)

    def hold(self, key: Hashable, device: str = "cpu", *, timeout: float | None = None) -> _Hold:
        """``async with store.hold(key) as t``: ``t`` views the value in the
        host (or GPU, device='cuda') tier, which cannot be evicted until the
        block exits. No copy is made; do not modify ``t``.

        Waits for room as ``get`` does; a value larger than the tier raises StoreFullError.
        """
        return _Hold(self, key, str(device), timeout)

    async def evict(self, key: Hashable, to: str = "nvme", *, timeout: float | None = None) -> None:
        """Move a key's value colder: to='nvme' leaves only the NVMe copy,
        to='host' drops the GPU copy (keeping a host one). Waits while it is held."""
        self._enter()
        if to not in ("nvme", "host"):
            raise ValueError(f"to must be 'nvme' or 'host', got {to!r}")
        e = self._lookup(key)
        deadline = self._deadline(timeout)
        if e.nbytes == 0:
            return
        if to == "host" or e.gpu is not None:
            while e.gpu is not None and not e.dead:
                if e.gpu_refs == 0 and e.gpu_loading is None:
                    if to == "host" and e.host is None and e.disk is None and self._host.capacity >= e.nbytes:
                        await self._load_host(e, deadline)
                    if e.host is None and e.disk is None:
                        x = await self._nvme.allocate(e.nbytes)
                        await self._nvme.write([(x, e.gpu[: e.nbytes])])
                        if e.dead:
                            self._nvme.free(x)
                        else:
                            e.disk = x
                    if e.gpu_refs == 0:
                        self._drop_gpu(e)
                    continue
                if self._gpu is not None:
                    await self._gpu.wait_change(deadline, f"evicting {key!r}")
        if to == "nvme":
            while e.host is not None and not e.dead:
                if e.refs == 0 and not e.moving and e.loading is None:
                    async with self._host.lock:
                        if e.host is not None and self._evictable(self._host, e):
                            await self._demote_host([e])
                    continue
                if e.loading is not None:
                    await asyncio.shield(e.loading)
                    continue
                await self._host.wait_change(deadline, f"evicting {key!r}")

    async def delete(self, key: Hashable) -> None:
        """Remove a key (StoreKeyError if absent). Reads in flight finish with
        the old bytes; its memory and extents are reused only after them."""
        self._enter()
        async with self._writer(key):
            e = self._lookup(key)
            if self._journal is not None:
                await self._journal.append([{"op": "del", "k": key}])
            if self._index.get(key) is e:
                del self._index[key]
                self._retire(e)
            self.admission.forget(key)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[Hashable]:
        """The keys, in insertion order."""
        return list(self._index)

    def where(self, key: Hashable) -> list[str]:
        """The tiers holding a copy of key right now ('gpu', 'host', 'nvme')."""
        e = self._index.get(key)
        if e is None:
            raise StoreKeyError(key)
        tiers = []
        if e.gpu is not None:
            tiers.append("gpu")
        if e.host is not None:
            tiers.append("host")
        if e.disk is not None:
            tiers.append("nvme")
        return tiers

    # -- compaction -------------------------------------------------------------------

    async def compact(self) -> int:
        """Move values down in the slab files so free space is one piece at the
        end of each. Returns the bytes moved.

        Runs by itself when an allocation finds enough free bytes but no free
        extent large enough. Values being written, read or replaced are
        skipped (tried again next time); with ``persist=True`` each move is
        durable (data fdatasynced, then its journal record) before the old
        extent is reused.
        """
        self._enter()
        return await self._compact()

    async def _compact(self) -> int:
        if self._compact_lock is None:
            self._compact_lock = asyncio.Lock()
        moved = 0
        async with self._compact_lock:
            for si, slab in enumerate(self._nvme.slabs):
                pieces = sorted(
                    (x[1], e) for e in list(self._index.values()) if e.disk for x in e.disk if x[0] == si
                )
                for off, e in pieces:
                    if slab.alloc.free_bytes == slab.alloc.tail_free():
                        break  # no hole left below the end
                    if e.dead or e.moving or e.disk is None or e.key in self._klocks or e.disk_refs:
                        continue  # busy: a put, delete, eviction or read of it is in flight
                    moved += await self._move_piece(e, si, off)
            if moved:
                self._nvme.stats["compactions"] += 1
        return moved

    async def _move_piece(self, e: Entry, si: int, off: int) -> int:
        """Move e's piece at (slab si, off) to the lowest hole below it."""
        old_disk = e.disk
        if old_disk is None:
            return 0
        piece = next((x for x in old_disk if x[0] == si and x[1] == off), None)
        if piece is None:
            return 0
        slab = self._nvme.slabs[si]
        n = piece[3]
        base, sp = span(off, n)  # the allocated extent (a phase-placed value's starts before off)
        phase = off - base
        new = slab.alloc.alloc_below(sp, base)
        if new is None:
            return 0
        async with self._writer(e.key):  # no put or delete of the key meanwhile (journal order)
            if e.dead or e.disk is not old_disk or self._index.get(e.key) is not e:
                slab.alloc.free(new, sp)
                return 0
            bounce = memory.empty(round_up(sp), "uint8")
            e.disk_refs += 1
            try:
                await slab.file.pread(bounce, base)
                await slab.file.pwrite(bounce, new)
                if self.persist:
                    await slab.file.fdatasync()
            except BaseException:
                slab.alloc.free(new, sp)
                raise
            finally:
                e.disk_refs -= 1
            if e.dead or e.disk_refs or e.disk is not old_disk:
                # a read of the old place began meanwhile, or the value went: keep the old place
                slab.alloc.free(new, sp)
                if e.dead and e.disk_refs == 0 and e.disk is not None:
                    self._nvme.free(e.disk)
                    e.disk = None
                return 0
            ext = [(si, new + phase, x[2], x[3]) if x is piece else x for x in old_disk]
            if self._journal is not None:
                try:
                    c = self._nvme.checksum_of(old_disk)  # storetrust: the checksum follows the value
                    await self._journal.append(
                        [{"op": "put", "k": e.key, "m": e.meta.to_json(), "x": ext, "c": c}]
                    )
                except BaseException:
                    slab.alloc.free(new, sp)
                    raise
            self._nvme.moved(old_disk, ext)  # storetrust
            e.disk = ext
            slab.alloc.free(base, sp)
            self._nvme.stats["bytes_in"] += n
            self._nvme.stats["bytes_out"] += n
        return n

    # -- stats / close --------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: ``used``/``capacity`` (bytes), ``entries``, ``hits``,
        ``misses``, ``bytes_in``/``bytes_out``, ``evictions``, ``wait_s``
        (time spent waiting for room). For 'nvme', ``capacity`` is the slabs'
        current size, ``free_extents`` and ``fragmentation`` describe its free space.
        """
        out: dict[str, dict[str, Any]] = {}
        if self._gpu is not None:
            out["gpu"] = {
                "used": self._gpu.used,
                "capacity": self._gpu.capacity,
                "entries": len(self._gpu.entries),
                **self._gpu.stats,
            }
        out["host"] = {
            "used": self._host.used,
            "capacity": self._host.capacity,
            "entries": len(self._host.entries),
            "pinned": self._host.pinned,
            **self._host.stats,
        }
        nv = self._nvme
        out["nvme"] = {
            "used": nv.used,
            "capacity": nv.capacity,
            "entries": sum(1 for e in self._index.values() if e.disk is not None),
            "slabs": [s.path for s in nv.slabs],
            "free_extents": sum(len(s.alloc.extents()) for s in nv.slabs),
            "fragmentation": max((s.alloc.fragmentation() for s in nv.slabs), default=0.0),
            **nv.stats,
        }
        return out

    async def close(self) -> None:
        """Wait for prefetches in flight, write the index (persist=True), close
        the slab files; a scratch store (persist=False) removes them."""
        if self._closed:
            return
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            raise StoreClosedError("close() must run on the store's event loop")
        self._closed = True
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            if self._journal is not None and self._journal.broken is None:
                await asyncio.get_running_loop().run_in_executor(  # storetrust: a full disk warns
                    None, self._journal.final_snapshot, self._slab_paths(), self._index_json()
                )
        finally:
            if self._journal is not None:
                self._journal.close()
            self._nvme.close(remove=not self.persist)
            self._stop_copy_pool()

    def _stop_copy_pool(self) -> None:
        pool, self._copy_pool = self._copy_pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # idle: every copy was awaited

    def close_sync(self) -> None:
        """close() for code without a running loop (no prefetch may be in flight)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._journal is not None and self._journal.broken is None:
                self._journal.final_snapshot(self._slab_paths(), self._index_json())  # storetrust
        finally:
            if self._journal is not None:
                self._journal.close()
            self._nvme.close(remove=not self.persist)
            self._stop_copy_pool()

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or not hasattr(self, "_nvme"):
            return
        warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)
        self._closed = True
        with contextlib.suppress(Exception):
            if self._journal is not None:
                self._journal.close()
            self._nvme.close(remove=not self.persist)  # a scratch store leaves no slab behind

    async def __aenter__(self) -> TieredStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (
            f"<aionvme.TieredStore {self.paths} keys={len(self._index)} host={self._host.used}/"
            f"{self._host.capacity} nvme={self._nvme.used}/{self._nvme.capacity}"
            f"{' persist' if self.persist else ''}{' closed' if self._closed else ''}>"
        )

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._index))


class _Writers:
    """Tickets on the per-key queues of writers; see TieredStore._writer."""

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


class _Hold:
    """The async context manager of :meth:`TieredStore.hold`."""

    def __init__(self, store: TieredStore, key: Hashable, device: str, timeout: float | None) -> None:
        self.store = store
        self.key = key
        self.device = device
        self.timeout = timeout
        self._entry: Entry | None = None
        self._gpu = device.startswith("cuda")

    async def __aenter__(self) -> Any:
        s = self.store
        s._enter()
        deadline = s._deadline(self.timeout)
        while True:
            e = s._lookup(self.key)
            if e.nbytes == 0:
                self._entry = None
                return result_like(e.meta, self.device, aligned=False)[0]
            if self._gpu:
                if s._gpu is None:
                    raise DeviceError("hold(device='cuda') on a store without a GPU tier (gpu=None)")
                if e.nbytes > s._gpu.capacity:
                    raise StoreFullError(f"{self.key!r} ({e.nbytes} bytes) is larger than the GPU tier")
                if e.gpu is None and not await s._join_load(
                    e, s._start_load(e, deadline, gpu=True), gpu=True
                ):
                    continue
                if e.gpu is not None and not e.dead:
                    e.gpu_refs += 1
                    self._entry = e
                    s._gpu.stats["hits"] += 1
                    return view_as(e.gpu, e.meta)
                continue
            if e.nbytes > s._host.capacity:
                raise StoreFullError(f"{self.key!r} ({e.nbytes} bytes) is larger than the host tier")
            if e.replaced is not None:
                await asyncio.shield(e.replaced)  # a put overwriting it in place
                continue
            if e.host is None and not await s._join_load(e, s._start_load(e, deadline)):
                continue
            if e.host is not None and not e.dead:
                e.refs += 1
                self._entry = e
                s._host.stats["hits"] += 1
                s._host.touch(e)
                return view_as(s._host.view(e.host, e.nbytes), e.meta)

    async def __aexit__(self, *exc: object) -> None:
        e, self._entry = self._entry, None
        if e is None:
            return
        if self._gpu:
            self.store._unref_gpu(e)
        else:
            self.store._unref_host(e)
