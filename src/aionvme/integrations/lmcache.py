"""aionvme.integrations.lmcache: aionvme's TieredStore as an LMCache L2 adapter.

LMCache (multi-process mode) keeps KV chunks in host memory (its L1) and
hands them to L2 adapters through a non-blocking interface: submit a store,
a lookup-and-lock or a load; learn of completion on one eventfd per kind;
collect the results. :class:`AionvmeL2Adapter` implements that interface
over a :class:`aionvme.SyncTieredStore` in cache mode: bounded by ``nvme``
(the coldest unpinned chunks are dropped when it is full, and LMCache is told
of each drop), loads go to the disk as one batched O_DIRECT request per slab
straight into LMCache's buffers, every chunk carries a checksum, and a lookup
pins what it found until LMCache unlocks it.

LMCache loads it by module path, with its ``plugin`` adapter type::

    --l2-adapter '{"type": "plugin", "module_path": "aionvme.integrations.lmcache",
                   "class_name": "AionvmeL2Adapter",
                   "adapter_params": {"path": "/nvme/lmcache", "nvme": "2T"}}'

``adapter_params`` are those of :class:`AionvmeL2AdapterConfig` (LMCache finds
the config class by its name). LMCache is imported only here.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

# LMCache ships no type information (no py.typed): its names are Any to mypy.
try:
    from lmcache.lmcache_native import Bitmap  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from lmcache.v1.distributed.internal_api import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        L2StoreResult,
    )
    from lmcache.v1.distributed.l2_adapters.base import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        L2AdapterInterface,
    )
    from lmcache.v1.distributed.l2_adapters.config import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        L2AdapterConfigBase,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"aionvme.integrations.lmcache needs LMCache's L2 adapter interface, which did not import ({e}); "
        "install it with `pip install --no-deps lmcache` and the modules it imports (see the README)"
    ) from e

from ..defaults import parse_size
from ..store import CorruptValueError, SyncTieredStore

__all__ = ["AionvmeL2Adapter", "AionvmeL2AdapterConfig", "object_key_bytes"]

logger = logging.getLogger(__name__)


def object_key_bytes(key: Any) -> bytes:
    """The store key of an LMCache ``ObjectKey``: its fields, then the chunk
    hash's raw bytes (``model@salt@kv_rank@group@hash``). Distinct ObjectKeys
    give distinct keys: ``model_name`` and ``cache_salt`` never hold ``@``
    (ObjectKey refuses them), the ranks are hex, and the hash comes last."""
    return b"%s@%s@%x@%x@%s" % (
        key.model_name.encode(),
        key.cache_salt.encode(),
        key.kv_rank,
        key.object_group_id,
        bytes(key.chunk_hash),
    )


def _byte_view(obj: Any) -> Any:
    """The bytes of a MemoryObj as a flat uint8 tensor sharing its memory
    (``tensor`` is the logical view of the object's buffer, of its used size);
    None for an invalidated object."""
    import torch

    t = obj.tensor
    if t is None:
        return None
    return t.reshape(-1).view(torch.uint8)


class AionvmeL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc,unused-ignore]
    """The settings of :class:`AionvmeL2Adapter` (its ``adapter_params``).

    Parameters
    ----------
    path : str or list of str
        Directory (or directories, one per drive) of the store's slab files.
    nvme : int or str
        Capacity of the NVMe tier (``"2T"``): disk use never exceeds it; when
        it is full the coldest chunks nobody has locked are dropped.
    host : int or str
        A host-memory tier in front of the disk (default 0: none; LMCache's L1
        already is one, and a store then writes each chunk straight from
        LMCache's buffer).
    checksum : bool
        Each chunk's xxh3_64 taken on write and checked on load (default True);
        a chunk that fails its check is a miss, and is dropped.
    """

    def __init__(
        self,
        path: str | Sequence[str],
        nvme: int | str,
        host: int | str = 0,
        checksum: bool = True,
    ) -> None:
        if isinstance(path, str):
            if not path:
                raise ValueError("path must be a non-empty string")
        elif not path or not all(isinstance(p, str) and p for p in path):
            raise ValueError("path must be a directory or a list of directories")
        self.path = path if isinstance(path, str) else list(path)
        self.nvme = _size("nvme", nvme)
        if self.nvme <= 0:
            raise ValueError(f"nvme must be a positive size, got {nvme!r}")
        self.host = _size("host", host)
        if not isinstance(checksum, bool):
            raise ValueError(f"checksum must be true or false, got {checksum!r}")
        self.checksum = checksum

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AionvmeL2AdapterConfig:
        unknown = sorted(set(d) - {"type", "path", "nvme", "host", "checksum"})
        if unknown:
            raise ValueError(f"unknown aionvme adapter settings: {', '.join(unknown)}")
        if "path" not in d or "nvme" not in d:
            raise ValueError("the aionvme adapter needs 'path' and 'nvme' (the disk budget, e.g. '2T')")
        return cls(d["path"], d["nvme"], d.get("host", 0), d.get("checksum", True))

    @classmethod
    def help(cls) -> str:
        return (
            "aionvme L2 adapter (a bounded NVMe KV tier), adapter_params:\n"
            "- path (str or list of str): directory of the slab files, one per drive (required)\n"
            "- nvme (int or str): disk budget, e.g. '2T'; the coldest unlocked chunks are\n"
            "  dropped to stay within it (required)\n"
            "- host (int or str): host-memory tier in front of the disk (default 0)\n"
            "- checksum (bool): xxh3_64 per chunk, checked on load (default true)\n"
            'Example: {"type": "plugin", "module_path": "aionvme.integrations.lmcache", '
            '"class_name": "AionvmeL2Adapter", "adapter_params": {"path": "/nvme/kv", "nvme": "2T"}}'
        )


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be a byte count or a size like '2T', got {value!r}")
    try:
        return parse_size(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from e


class AionvmeL2Adapter(L2AdapterInterface):  # type: ignore[misc,unused-ignore]
    """LMCache's ``L2AdapterInterface`` over a bounded :class:`aionvme.SyncTieredStore`.

    Parameters
    ----------
    config : AionvmeL2AdapterConfig or dict
        The settings (a dict is read with ``AionvmeL2AdapterConfig.from_dict``).
    l1_memory_desc : optional
        LMCache's description of its L1 buffer (unused: loads land in the
        buffers given to :meth:`submit_load_task`, wherever they are).

    Notes
    -----
    Keys: each ObjectKey becomes a bytes key (:func:`object_key_bytes`).
    A key already stored is not written again (the task reports 0 bytes for
    it): a chunk's key names its content.

    Completion: a task's store or load is a job on the store's event loop
    (aionvme's background thread); when it ends, its result is recorded and
    1 is added to the eventfd of its kind. A lookup-and-lock needs no I/O
    (presence and pins are in memory) and completes inside the submit call.

    Locks: a lookup pins each chunk it found (refcounted, per lookup); a pinned
    chunk is never dropped to make room, nor removed by :meth:`delete`, until
    :meth:`submit_unlock` gives the pin back. Only pins this adapter took are
    given back; :meth:`close` returns the rest.

    Events: LMCache's listeners hear of stored chunks, of chunks dropped to
    make room (as deletions) and of loaded chunks from the thread that
    collects the results (``pop_completed_store_tasks``,
    ``query_load_result``) or calls :meth:`delete` or ``get_usage``, in the
    order they happened; never from the store's loop.

    Errors: a store task whose chunks could not all be written reports
    failure (``L2StoreResult``), a load reports a 0 bit for each chunk it did
    not fill (absent, dropped, another size, failed its checksum, an I/O
    error); the reasons go to this module's logger.
    """

    config_class_name = "AionvmeL2AdapterConfig"

    #: Store jobs of load tasks in flight at once; tasks submitted while that
    #: many run wait, and go together as one job when one ends (each job costs
    #: a hop to the store's thread and back). Not fewer: on the virtio disk of
    #: bench/suites/bench_kv_lmcache.py, single-chunk loads of 0.5 MiB, 8 tasks
    #: in flight, ran 0.94 GB/s as 8 jobs and 0.58 GB/s merged into 2 (medians of 3).
    max_reads = 8

    def __init__(
        self, config: AionvmeL2AdapterConfig | Mapping[str, Any], l1_memory_desc: Any = None
    ) -> None:
        if not isinstance(config, AionvmeL2AdapterConfig):
            config = AionvmeL2AdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=config.nvme)
        self.config = config
        self._lock = threading.Lock()  # the tables below
        self._emit_lock = threading.Lock()  # listeners hear stores and deletions in order
        self._next_id = 0
        self._sizes: dict[bytes, tuple[Any, int]] = {}  # what LMCache was told is stored
        self._pinned: dict[bytes, int] = {}  # pins this adapter holds, per key
        self._events: list[tuple[str, list[Any], list[int]]] = []  # not yet told to listeners
        self._corrupt: set[bytes] = set()  # failed their checksum: to delete
        self._stores: dict[int, Any] = {}
        self._lookups: dict[int, Any] = {}
        self._loads: dict[int, Any] = {}
        self._reading = 0  # store jobs of load tasks in flight
        self._queued: list[_Load] = []  # load tasks waiting for one to end
        self._closed = False
        self._store = SyncTieredStore(
            config.path, host=config.host, nvme=config.nvme, on_full="evict", checksum=config.checksum
        )
        self._to = "nvme" if config.host == 0 else None
        flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
        self._efds: list[int] = []
        try:
            for _ in range(3):
                self._efds.append(os.eventfd(0, flags))
        except OSError:
            self._close_fds()
            self._store.close()
            raise
        self._store_efd, self._lookup_efd, self._load_efd = self._efds

    # -- event fds --------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_efd

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd

    def get_load_event_fd(self) -> int:
        return self._load_efd

    def _signal(self, fd: int) -> None:
        """Add 1 to a completion eventfd (under ``_lock``; not once closed, when
        the descriptor may already belong to another file)."""
        if not self._closed:
            os.eventfd_write(fd, 1)

    def _task_id(self) -> int:
        with self._lock:
            tid = self._next_id
            self._next_id += 1
        return tid

    # -- store ------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Write each object's bytes under its key (keys already stored are
        skipped); the result, on the store eventfd, fails if any chunk was not written."""
        _same_length(keys, objects)
        tid = self._task_id()
        batch: list[tuple[bytes, Any, Any]] = []
        seen: set[bytes] = set()
        ok = True
        for key, obj in zip(keys, objects):
            skey = object_key_bytes(key)
            if skey in seen or self._store.contains(skey):
                continue
            seen.add(skey)
            view = _byte_view(obj)
            if view is None or view.numel() > self.config.nvme:
                logger.warning(
                    "aionvme L2: not storing %r (%s)", key, "invalid" if view is None else "too big"
                )
                ok = False
                continue
            batch.append((skey, key, view))
        # A batch's own values cannot be dropped while it is written, so one
        # larger than the tier could never fit: it goes in parts of at most
        # an eighth of the tier, one after the other (each may drop older chunks).
        parts: list[list[tuple[bytes, Any, Any]]] = []
        room = 0
        for item in batch:
            n = int(item[2].numel())
            if not parts or room < n:
                parts.append([])
                room = max(self.config.nvme // 8, n)
            parts[-1].append(item)
            room -= n
        self._put(tid, parts, ok, 0)
        return tid

    def _put(self, tid: int, parts: list[list[tuple[bytes, Any, Any]]], ok: bool, written: int) -> None:
        """Write ``parts[0]``, then the rest (from the completion of each, on the
        store's loop); then record the task's result and signal its eventfd."""
        if not parts:
            self._finish_store(tid, ok, written)
            return
        part = parts[0]
        try:
            fut = self._store.submit_put_many({s: v for s, _, v in part}, to=self._to)
        except Exception as e:  # the store is closed or refused the batch: the task fails
            logger.warning("aionvme L2: store task %d failed: %r", tid, e)
            self._finish_store(tid, False, written)
            return

        def done(f: Future[None]) -> None:
            err = _error(f)
            if err is not None:
                logger.warning("aionvme L2: store task %d failed: %r", tid, err)
                self._finish_store(tid, False, written)
            else:
                self._put(tid, parts[1:], ok, written + self._stored(part))

        fut.add_done_callback(done)

    def _stored(self, part: list[tuple[bytes, Any, Any]]) -> int:
        """Record chunks now in the store that LMCache has not been told of:
        their event is queued; returns their bytes."""
        keys, sizes = [], []
        with self._lock:
            for skey, key, view in part:
                if skey not in self._sizes:
                    size = int(view.numel())
                    self._sizes[skey] = (key, size)
                    keys.append(key)
                    sizes.append(size)
            if keys:
                self._events.append(("stored", keys, sizes))
        return sum(sizes)

    def _finish_store(self, tid: int, ok: bool, written: int) -> None:
        """Record a store task's result after the chunks eviction dropped, then
        signal the store eventfd."""
        with self._lock:
            self._collect_evicted()
            self._stores[tid] = L2StoreResult(ok, written)
            self._signal(self._store_efd)

    def _collect_evicted(self) -> None:
        """Queue a deletion event for the chunks cache mode dropped that LMCache
        knows of and that no later store brought back (under ``_lock``)."""
        if self._closed:
            return
        keys, sizes = [], []
        for skey in self._store.drain_evicted():
            if isinstance(skey, bytes) and skey in self._sizes and not self._store.contains(skey):
                key, size = self._sizes.pop(skey)
                keys.append(key)
                sizes.append(size)
        if keys:
            self._events.append(("deleted", keys, sizes))

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        self._emit()
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # -- lookup and lock ----------------------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        """Pin each key that is present; the bitmap of those found is ready at
        once (no I/O), and the lookup eventfd is signalled before this returns.
        A chunk counts once its store task has completed (LMCache heard of it)."""
        tid = self._task_id()
        skeys = [object_key_bytes(k) for k in keys]
        bitmap = Bitmap(len(keys))
        with self._lock:
            known = [i for i, s in enumerate(skeys) if s in self._sizes] if not self._closed else []
            found = self._store.pin([skeys[i] for i in known]) if known else []
            for i, hit in zip(known, found):
                if hit:
                    self._pinned[skeys[i]] = self._pinned.get(skeys[i], 0) + 1
                    bitmap.set(i)
            self._lookups[tid] = bitmap
            self._signal(self._lookup_efd)
        return tid

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Give back one pin per key this adapter holds a pin on (others are ignored)."""
        with self._lock:
            give = []
            for key in keys:
                skey = object_key_bytes(key)
                n = self._pinned.get(skey, 0)
                if n == 0:
                    continue
                if n == 1:
                    del self._pinned[skey]
                else:
                    self._pinned[skey] = n - 1
                give.append(skey)
            if give and not self._closed:
                self._store.unpin(give)

    # -- load -------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Fill each object with its key's bytes, in one batched read; the
        bitmap on the load eventfd says which were filled."""
        _same_length(keys, objects)
        task = _Load(self._task_id(), keys)
        with self._lock:
            for i, (key, obj) in enumerate(zip(keys, objects)):
                skey = object_key_bytes(key)
                known = self._sizes.get(skey)
                view = _byte_view(obj) if known is not None else None
                if view is None or known is None or int(view.numel()) != known[1]:
                    continue  # absent, or the buffer is not the chunk's size: a miss
                task.want.append((i, skey, view))
            start = self._reading < self.max_reads
            if start:
                self._reading += 1
            else:
                self._queued.append(task)
        if start:
            self._read([task])
        return task.tid

    def _read(self, tasks: list[_Load]) -> None:
        """One store job reading the chunks of ``tasks`` into their buffers; on
        a checksum failure, drop that chunk and read the rest again."""
        want = [(t, i, s, v) for t in tasks for i, s, v in t.want]
        if not want:
            self._read_done(tasks)
            return
        try:
            fut = self._store.submit_get_many([w[2] for w in want], out=[w[3] for w in want], missing="skip")
        except Exception as e:  # the store is closing: these are misses
            logger.warning("aionvme L2: load tasks %s failed: %r", [t.tid for t in tasks], e)
            self._read_done(tasks)
            return

        def done(f: Future[list[bool]]) -> None:
            err = _error(f)
            if err is None:
                for (t, i, _, _), hit in zip(want, f.result()):
                    if hit:
                        t.bitmap.set(i)
            elif isinstance(err, CorruptValueError) and any(w[2] == err.key for w in want):
                bad = next(w[2] for w in want if w[2] == err.key)
                logger.warning("aionvme L2: %s; it is dropped", err)
                with self._lock:
                    self._corrupt.add(bad)
                for t in tasks:
                    t.want = [w for w in t.want if w[1] != bad]
                self._read(tasks)  # the failed job filled no buffer for sure: read them again
                return
            else:
                logger.warning("aionvme L2: load tasks %s failed: %r", [t.tid for t in tasks], err)
            self._read_done(tasks)

        fut.add_done_callback(done)

    def _read_done(self, tasks: list[_Load]) -> None:
        """Record the results of ``tasks`` and signal the load eventfd; then the
        tasks queued meanwhile go as one job (on the store's loop)."""
        with self._lock:
            for t in tasks:
                self._loads[t.tid] = (t.bitmap, [t.keys[i] for i in t.bitmap.get_indices_list()])
            self._signal(self._load_efd)
            queued, self._queued = self._queued, []
            if not queued:
                self._reading -= 1
        if queued:
            self._read(queued)

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            got = self._loads.pop(task_id, None)
        if got is None:
            return None
        bitmap, loaded = got
        self._emit()
        if loaded:
            self._notify_keys_accessed(loaded)
        return bitmap

    # -- deletion, usage, status --------------------------------------------------------------

    def delete(self, keys: list[Any]) -> None:
        """Remove chunks (LMCache's own eviction); a locked chunk stays until unlocked."""
        with self._emit_lock:
            self._emit_locked()
            skeys = [object_key_bytes(k) for k in keys]
            with self._lock:
                drop = [s for s in skeys if s not in self._pinned and s in self._sizes]
            self._drop(drop)

    def _drop(self, skeys: list[bytes]) -> None:
        """Delete ``skeys`` from the store and tell the listeners (under ``_emit_lock``)."""
        if not skeys or self._closed:
            return
        gone: list[tuple[Any, int]] = []
        for skey in skeys:
            try:
                self._store.delete(skey)
            except KeyError:
                pass  # dropped to make room meanwhile: its event is queued
            except Exception as e:
                logger.warning("aionvme L2: could not delete %r: %r", skey, e)
                continue
            with self._lock:
                entry = self._sizes.pop(skey, None)
            if entry is not None:
                gone.append(entry)
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])

    def _emit(self) -> None:
        with self._emit_lock:
            self._emit_locked()

    def _emit_locked(self) -> None:
        """Tell the listeners what happened since the last call, in order, and
        drop chunks that failed their checksum (under ``_emit_lock``)."""
        with self._lock:
            events, self._events = self._events, []
            corrupt, self._corrupt = self._corrupt, set()
        for kind, keys, sizes in events:
            if kind == "stored":
                self._notify_keys_stored(keys, sizes)
            else:
                self._notify_keys_deleted(keys, sizes)
        self._drop(sorted(corrupt))

    def get_usage(self) -> Any:
        self._emit()
        return super().get_usage()

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            chunks, pinned = len(self._sizes), sum(self._pinned.values())
        return {
            "is_healthy": not self._closed,
            "type": "AionvmeL2Adapter",
            "path": self.config.path,
            "capacity_bytes": self.config.nvme,
            "chunks": chunks,
            "locked": pinned,
            "store": None if self._closed else self._store.stats(),
        }

    # -- close -------------------------------------------------------------------------------

    def close(self) -> None:
        """Give back this adapter's pins, close the store (its files go) and the eventfds."""
        with self._emit_lock:
            if self._closed:
                return
            self._emit_locked()
            with self._lock:
                pins = [k for k, n in self._pinned.items() for _ in range(n)]
                self._pinned.clear()
                self._closed = True
            try:
                if pins:
                    self._store.unpin(pins)
            finally:
                try:
                    self._store.close()  # jobs in flight end first; their results are not signalled
                finally:
                    with self._lock:
                        self._close_fds()

    def _close_fds(self) -> None:
        for fd in self._efds:
            os.close(fd)
        self._efds = []


class _Load:
    """A load task: its id, keys, bitmap of chunks filled, and what to read:
    (index in keys, store key, the buffer's bytes)."""

    __slots__ = ("bitmap", "keys", "tid", "want")

    def __init__(self, tid: int, keys: list[Any]) -> None:
        self.tid = tid
        self.keys = keys
        self.bitmap = Bitmap(len(keys))
        self.want: list[tuple[int, bytes, Any]] = []


def _same_length(keys: list[Any], objects: list[Any]) -> None:
    if len(keys) != len(objects):
        raise ValueError(f"{len(keys)} keys for {len(objects)} objects")


def _error(f: Future[Any]) -> BaseException | None:
    if f.cancelled():
        return RuntimeError("cancelled")
    return f.exception()
