"""TieredStore: tensors by key in GPU memory, host memory and NVMe slabs.

The façade: it opens and closes the store (journal replay, slab files) and
hands each call to the part that does it: :mod:`._mover` (loads, demotions,
room over the tiers), :mod:`._reads` (get, get_many, hold), :mod:`._writes`
(put), :mod:`._cleaner` (write-behind), :mod:`._compact` (compaction).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from .. import defaults
from ..exceptions import DeviceError
from ._cleaner import Cleaner
from ._compact import Compactor
from ._errors import AttachError, JournalError, StoreClosedError, StoreKeyError
from ._journal import Journal, load_index
from ._kv import Evictor, Jobs, PinTable, cache_capacity
from ._kvapi import KVCalls
from ._lock import own_dirs
from ._memtier import GpuTier, HostTier
from ._mover import Mover
from ._nvme import NvmeTier
from ._policy import Admission, EvictionPolicy, make_admission, make_policy
from ._reads import Hold, Reads
from ._tiers import GPU, HOST, NVME, Entry, Writers
from ._values import Meta
from ._writes import Writes

# a mapping's key type is invariant: put_many takes dict[str, Tensor] through a TypeVar
K = TypeVar("K", bound=Hashable)

__all__ = ["TieredStore"]

BASENAME = "aionvme-store"


def _sizes(value: int | str | None) -> int | None:
    return None if value is None else defaults.parse_size(value)


class TieredStore(KVCalls):
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
        close or a crash, gives back every key with its bytes. Keys must be
        str, bytes or int (each kept with its type: "1", b"1" and 1 differ).
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
    on_full : {'raise', 'evict'}
        What a put does when the NVMe tier is full: raise StoreFullError
        (default), or, as a cache, drop the coldest values (by last put or
        get) that nobody pins, reads or holds, from every tier, until it fits
        (needs ``nvme=``, which then bounds the slabs' disk use: they hold
        1/256 less, room for the filesystem's own blocks of them). Dropped
        keys are listed by :meth:`drain_evicted` (the newest ``evicted_max``, 65536
        by default, None: all); with ``persist=True`` each drop is journaled as a delete.

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
        on_full: str = "raise",
        evicted_max: int | None = 1 << 16,
    ) -> None:
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        if not paths:
            raise ValueError("TieredStore needs at least one directory")
        nvme_b = cache_capacity(on_full, nvme, _sizes(nvme), len(paths))
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        self.persist = bool(persist)
        self.timeout = timeout
        factory = make_policy(policy)
        self.admission = make_admission(admit)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._home: asyncio.AbstractEventLoop | None = None  # submit_*'s loop until bound (SyncTieredStore)
        self._index: dict[Hashable, Entry] = {}
        self._klocks: dict[Hashable, collections.deque[asyncio.Future[None]]] = {}
        host_b = defaults.parse_size(host)
        gpu_b = _sizes(gpu)
        gpu_tier: GpuTier | None = None
        cuda = False
        if gpu_b:
            import torch

            if not torch.cuda.is_available():
                raise DeviceError("gpu= needs CUDA, which is not available here (pass gpu=None)")
            gpu_tier = GpuTier(gpu_b, factory, "cuda")
            cuda = True
        else:
            import sys

            if "torch" in sys.modules:
                import torch

                cuda = bool(torch.cuda.is_available())
        self._gpu = gpu_tier
        self._host = HostTier(host_b, factory, pinned=cuda and host_b > 0)
        self._journal: Journal | None = None
        self.recovered: dict[str, Any] | None = None  # what recover=True dropped (see the README)
        self._nvme = self._open(nvme_b, defaults.parse_size(stripe), checksum, recover, mode)
        self._mover = Mover(self._host, self._gpu, self._nvme)
        self._mover.copy_threads = min(8, os.cpu_count() or 1)  # slices of a large copy run in parallel
        self._cleaner = Cleaner(self._mover, enabled=not self.persist)
        self._reads = Reads(self._mover, self._index, self.admission)
        self._writes = Writes(
            self._mover, self._cleaner, self._index, self._klocks, self._journal, self.persist, self.admission
        )
        self._compactor = Compactor(self._mover, self._index, self._klocks, self._journal, self.persist)
        self._nvme.compactor = self._compactor.run
        self._pins = PinTable(self._mover, self._index, lambda: self._loop, evicted_max)
        self._jobs = Jobs()
        kv = (self._mover, self._index, self._klocks, self._journal, self._pins, self.admission)
        self._evictor = Evictor(*kv) if on_full == "evict" else None

    # -- open -----------------------------------------------------------------------------

    def _open(self, nvme: int | None, stripe: int, checksum: bool, recover: bool, mode: int) -> NvmeTier:
        """Open the NVMe tier's slab files; with persist=True, take the
        directory (one owner: StoreLockedError), check (or, with recover=True,
        salvage) its index and journal, replay them into ``_index`` and open
        the journal."""
        entries: dict[Hashable, list[Any]] = {}
        lock = None
        if self.persist:
            lock = own_dirs(self.paths, mode)
            snap = os.path.join(self.paths[0], f"{BASENAME}.index")
            jpath = os.path.join(self.paths[0], f"{BASENAME}.journal")
            try:
                idx = load_index(snap, jpath, recover)
                gen, slabs, entries, valid = idx.generation, idx.slabs, idx.entries, idx.valid
                self.recovered = idx.recovered
                if slabs is not None and [os.path.dirname(s) for s in slabs] != self.paths:
                    raise JournalError(
                        f"the store in {self.paths[0]} was made with directories "
                        f"{[os.path.dirname(s) for s in slabs]}, not {self.paths}"
                    )
            except BaseException:
                lock.release()
                raise
        try:
            tier = NvmeTier(
                self.paths, nvme, persist=self.persist, stripe=stripe, mode=mode, checksum=checksum
            )
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        if self.persist:
            try:
                for k, (m, x, c) in entries.items():
                    e = Entry(k, Meta.from_json(m))
                    ext = [tuple(int(v) for v in piece) for piece in x]
                    if ext:
                        tier.reserve(ext, c)  # type: ignore[arg-type]
                        e.copy(NVME).where = ext
                    self._index[k] = e
                self._journal = Journal(snap, jpath, gen, valid, lock=lock, mode=mode)
                if slabs is None or idx.rewrite:  # a new store, a format-1 store, a recovery
                    self._journal.write_snapshot([s.path for s in tier.slabs], self._index_json(tier))
            except BaseException:
                tier.close(remove=False)
                if self._journal is not None:
                    self._journal.close()  # and with it the lock
                    self._journal = None
                elif lock is not None:
                    lock.release()
                raise
        return tier

    # -- plumbing ---------------------------------------------------------------------

    def _slab_paths(self) -> list[str]:
        return [s.path for s in self._nvme.slabs]

    def _index_json(self, tier: NvmeTier | None = None) -> dict[Hashable, list[Any]]:
        """The index snapshot: per key its meta, its extents and its checksum."""
        nv = self._nvme if tier is None else tier
        return {k: [e.meta.to_json(), e.disk or [], nv.checksum_of(e.disk)] for k, e in self._index.items()}

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

    def _writer(self, *keys: Hashable) -> Writers:
        """See :class:`_tiers.Writers`."""
        return Writers(self._klocks, keys)

    # settings of the parts, as attributes of the store

    @property
    def copy_threshold(self) -> int:
        """Copies of this many bytes or more run on the store's threads (default 8 MiB)."""
        return self._mover.copy_threshold

    @copy_threshold.setter
    def copy_threshold(self, n: int) -> None:
        self._mover.copy_threshold = n

    @property
    def copy_threads(self) -> int:
        """Threads of a large copy (its parallel slices)."""
        return self._mover.copy_threads

    @copy_threads.setter
    def copy_threads(self, n: int) -> None:
        self._mover.copy_threads = n

    @property
    def copy_slice(self) -> int:
        """The smallest slice of a large copy (bytes)."""
        return self._mover.copy_slice

    @copy_slice.setter
    def copy_slice(self, n: int) -> None:
        self._mover.copy_slice = n

    @property
    def clean_batch(self) -> int:
        """Bytes per write-behind batch (several in flight)."""
        return self._cleaner.batch

    @clean_batch.setter
    def clean_batch(self, n: int) -> None:
        self._cleaner.batch = n

    @property
    def errors(self) -> list[BaseException]:
        """Failures of prefetches and write-behind batches nobody awaited (the last 16)."""
        return self._mover.errors

    @property
    def _tasks(self) -> set[asyncio.Task[Any]]:
        return self._mover.tasks

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
        await self._writes.put_many(items, to, self._deadline(timeout))
        if self._evictor is not None:
            self._evictor.touch(items)

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
        e = self._reads.lookup(key)
        if self._evictor is not None:
            self._evictor.touch((key,))
        if device == "cpu":
            value = self._reads.hit_now(e, out)
            if value is not None:
                return value
        return await self._reads.get(e, str(device), out, self._deadline(timeout))

    async def get_many(
        self,
        keys: Iterable[Hashable],
        device: str = "cpu",
        *,
        out: Sequence[Any] | None = None,
        missing: str = "raise",
        timeout: float | None = None,
    ) -> list[Any]:
        """get of each key, in order (``out``: fill these arrays or tensors,
        one per key, as ``get(out=)`` does, and return them).

        ``missing``: 'raise' (default): StoreKeyError if a key is absent.
        'skip': absent keys are misses; returns, per key, True (its ``out``
        buffer filled) or False (absent, buffer untouched), or without
        ``out`` the value or None. In cache mode (and with 'skip') the values
        found are pinned until the call ends: an eviction meanwhile never
        turns a hit into an error.

        Values only on NVMe are read straight into their results, all in one
        request per slab; then, where the admission policy agrees, the last
        of them that fit in the host tier are copied into it (promotion that
        never waits for room: a batch larger than the tier does not evict its
        own values one by one).
        """
        if missing not in ("raise", "skip"):
            raise ValueError(f"missing must be 'raise' or 'skip', got {missing!r}")
        self._enter()
        keys = list(keys)
        deadline = self._deadline(timeout)
        if missing == "raise" and self._evictor is None:
            return await self._reads.get_many(keys, str(device), out, deadline)
        return await self._get_found(keys, str(device), out, missing == "skip", deadline)

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
        await self._writes.attach(key, path, offset, shape, dtype, like)

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
        tier = GPU if to in ("gpu", "cuda") else HOST
        if tier == GPU and self._gpu is None:
            raise DeviceError("prefetch to the GPU tier of a store without one (gpu=None)")
        entries = [self._reads.lookup(k) for k in keys]
        deadline = self._deadline(timeout)
        cap = self._mover.tiers[tier].capacity
        for e in entries:
            if 0 < e.nbytes <= cap and e.at(tier) is None:
                self._mover.start_load(e, tier, deadline)

    def hold(self, key: Hashable, device: str = "cpu", *, timeout: float | None = None) -> Hold:
        """``async with store.hold(key) as t``: ``t`` views the value in the
        host (or GPU, device='cuda') tier, which cannot be evicted until the
        block exits. No copy is made; do not modify ``t``.

        Waits for room as ``get`` does; a value larger than the tier raises StoreFullError.
        """
        return Hold(self, self._reads, key, str(device), timeout)

    async def evict(self, key: Hashable, to: str = "nvme", *, timeout: float | None = None) -> None:
        """Move a key's value colder: to='nvme' leaves only the NVMe copy,
        to='host' drops the GPU copy (keeping a host one). Waits while it is held."""
        self._enter()
        if to not in ("nvme", "host"):
            raise ValueError(f"to must be 'nvme' or 'host', got {to!r}")
        e = self._reads.lookup(key)
        deadline = self._deadline(timeout)
        if e.nbytes == 0:
            return
        m = self._mover
        colder = [GPU] if to == "host" else [GPU, HOST]
        for tier in colder:
            t = m.tiers.get(tier)
            while t is not None and e.at(tier) is not None and not e.dead:
                c = e.copies[tier]
                if c.loading is not None:
                    # its end, however it ends (a prefetch's error is not this
                    # evict's); wait() yields even for a load already done,
                    # whose done callback (that clears it) is still to run
                    await asyncio.wait([c.loading])
                    continue
                if not m.evictable(t, e):
                    await t.wait_change(deadline, f"evicting {key!r}")
                    continue
                async with t.lock:
                    if e.at(tier) is not None and m.evictable(t, e):
                        if to == "host" and e.host is None and e.disk is None:
                            with m.pins(GPU, e):
                                if e.nbytes <= self._host.capacity:
                                    await m.load(e, HOST, deadline)
                        await m.demote(t, [e], deadline)

    async def delete(self, key: Hashable) -> None:
        """Remove a key (StoreKeyError if absent). Reads in flight finish with
        the old bytes; its memory and extents are reused only after them."""
        self._enter()
        async with self._writer(key):
            e = self._reads.lookup(key)
            if self._journal is not None:
                await self._journal.append([{"op": "del", "k": key}])
            if self._index.get(key) is e:
                del self._index[key]
                self._mover.retire(e)
                if self._evictor is not None:
                    self._evictor.lru.pop(key, None)
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
        return [t for t in (GPU, HOST, NVME) if e.at(t) is not None]

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
        return await self._compactor.run()

    # -- stats / close --------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: ``used``/``capacity`` (bytes), ``entries``, ``hits``,
        ``misses``, ``bytes_in``/``bytes_out``, ``evictions``, ``wait_s``
        (time spent waiting for room). For 'nvme', ``capacity`` is the slabs'
        current size, ``free_extents`` and ``fragmentation`` describe its free space.
        """
        return self._mover.stats(sum(1 for e in self._index.values() if e.disk is not None))

    async def close(self) -> None:
        """Wait for prefetches in flight, write the index (persist=True), close
        the slab files; a scratch store (persist=False) removes them."""
        if self._closed:
            return
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            raise StoreClosedError("close() must run on the store's event loop")
        self._closed = True
        await self._jobs.close()  # submitted jobs finish, or fail with StoreClosedError if not started
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._cleaner.stopped = True
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._snapshot)
        finally:
            self._close_files()

    def close_sync(self) -> None:
        """close() for code without a running loop (no prefetch may be in flight)."""
        if self._closed:
            return
        self._closed = True
        self._cleaner.stopped = True
        try:
            self._snapshot()
        finally:
            self._close_files()

    def _snapshot(self) -> None:
        """persist=True: write the index snapshot (the journal restarts from it)."""
        if self._journal is not None and self._journal.broken is None:
            self._journal.final_snapshot(self._slab_paths(), self._index_json())  # a full disk warns

    def _close_files(self) -> None:
        """Close the journal and the slab files (a scratch store removes its slabs)."""
        if self._journal is not None:
            self._journal.close()
        self._nvme.close(remove=not self.persist)
        self._mover.stop_copies()
        self._jobs.close_fd()

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
            self._jobs.close_fd()

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
