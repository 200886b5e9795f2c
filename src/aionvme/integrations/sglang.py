"""SGLang's NVMe KV tier: :class:`AionvmeHiCache`, a ``HiCacheStorage`` over
:class:`aionvme.SyncTieredStore`.

SGLang's hierarchical cache loads a storage backend by module path and class
name (the ``dynamic`` backend), so this one runs without a fork of SGLang::

    --enable-hierarchical-cache --hicache-mem-layout page_first
    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "aionvme",
      "module_path": "aionvme.integrations.sglang", "class_name": "AionvmeHiCache",
      "interface_v1": 1, "file_storage_path": "/nvme/kv", "max_size": "500G"}'

``interface_v1`` makes SGLang call :meth:`~AionvmeHiCache.batch_get_v1` /
:meth:`~AionvmeHiCache.batch_set_v1` with host-pool indices (and hybrid
models ``batch_*_v2``, one transfer per pool): pages go between the host pool
and the NVMe slabs in one batched, checksummed request per call, straight
into the pool where a page is contiguous there (MLA models), through a reused
aligned staging page where it is in two parts (an MHA page's K and V halves).
Each page is one value of a cache-mode store (``on_full="evict"``): the disk
never holds more than ``max_size``; the coldest pages make room.

SGLang is imported only here (``import aionvme`` never loads it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.utils.common import human_readable_int

from ..exceptions import InvalidSettingError
from ..memory import empty
from ..store import CorruptValueError, StoreError, SyncTieredStore

__all__ = ["AionvmeHiCache"]

logger = logging.getLogger(__name__)

STAGING_KEPT = 64 << 20  # most bytes of staging pages per thread (one page, if larger)


@dataclass
class _Metrics:
    """The fields of SGLang's ``StorageMetrics`` (pages per batch, GB/s per
    batch), read by its storage metrics collector."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _storage_metrics() -> Any:
    try:  # the engine's own class where it imports (it pulls in SGLang's model configs)
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:
        return _Metrics()
    return StorageMetrics()


def _max_size(value: Any) -> int:
    """``max_size`` read as HiCacheFile reads it (SGLang's units: "500G" is
    500e9 bytes, "500Gi" 500 GiB; an int is bytes), but required and checked."""
    if value is None:
        raise InvalidSettingError(
            "AionvmeHiCache needs max_size in the backend's extra config (bytes, '500G' or '500Gi')",
            name="max_size",
        )
    try:
        n = (
            value
            if isinstance(value, int) and not isinstance(value, bool)
            else human_readable_int(str(value))
        )
    except (ValueError, argparse.ArgumentTypeError) as err:  # what human_readable_int raises
        raise InvalidSettingError(
            f"max_size {value!r} is not a size: {err}", name="max_size", value=value
        ) from err
    if n <= 0:
        raise InvalidSettingError(f"max_size must be positive, got {value!r}", name="max_size", value=value)
    return int(n)


def _namespace(cfg: HiCacheStorageConfig) -> str:
    """A directory per model and rank, as HiCacheFile's key suffixes: pages of
    one shard never answer for another (the bytes carry no format)."""
    model = re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.model_name or "").strip("-.")[-64:] or "model"
    name = f"{model}_{cfg.tp_rank}_{cfg.tp_size}"
    if cfg.pp_size > 1:
        name += f"_{cfg.pp_size}_{cfg.pp_rank}"
    if cfg.attn_cp_size > 1:
        name += f"_cp{cfg.attn_cp_rank}_{cfg.attn_cp_size}"
    if cfg.dcp_size > 1:
        name += f"_dcp{cfg.dcp_rank}_{cfg.dcp_size}_page{cfg.logical_page_size}"
    if cfg.dp_rank:
        name += f"_dp{cfg.dp_rank}"
    return name


class AionvmeHiCache(HiCacheStorage):  # type: ignore[misc]  # SGLang's class is untyped here
    """A bounded NVMe L3 tier for SGLang's hierarchical cache.

    Configuration (``--hicache-storage-backend-extra-config``, HiCacheFile's
    names where it has one)
    ------------------------------------------------------------------------
    file_storage_path : str
        Directory on the NVMe drive (default ``/tmp/hicache``); each rank's
        store lives in a subdirectory named after the model and the rank.
    max_size : int or str
        Most bytes the tier keeps on disk, preallocated; required. In SGLang's
        units, as HiCacheFile reads it: ``"500G"`` is 500e9 bytes, ``"500Gi"``
        500 GiB.
    host : int or str
        A host-memory tier of the store in front of NVMe (default 0: SGLang's
        host pool already is the host tier).
    persist : bool
        Keep the pages across restarts (each write durable before it is
        reported stored); default False.

    Notes
    -----
    Every page read back is checked against the checksum taken when it was
    written: a damaged page is reported missing (SGLang recomputes it) and is
    dropped from the store. Calls may come from several SGLang threads at once.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        extra.update(kwargs or {})
        cap = _max_size(extra.get("max_size"))
        root = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or extra.get(
            "file_storage_path", "/tmp/hicache"
        )
        self.config = storage_config
        self.path = os.path.join(os.fspath(root), _namespace(storage_config))
        os.makedirs(self.path, exist_ok=True)
        self.store = SyncTieredStore(
            self.path,
            host=extra.get("host", 0),
            nvme=cap,
            persist=bool(extra.get("persist", False)),
            on_full="evict",
            checksum=True,
            evicted_max=0,  # SGLang hears of no drops: keep no list of them
        )
        self._metrics_on = bool(storage_config.enable_storage_metrics)
        self._mlock = threading.Lock()
        self._metrics = _Metrics()
        self._stage = threading.local()  # each SGLang thread's staging pages

    # -- presence --------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return bool(self.store.contains(key))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return int(self.store.count_prefix(keys))

    # -- zero-copy batches (interface_v1): pages of the registered host pool ------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._get_pages(self.mem_pool_host, keys, host_indices)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._set_pages(self.mem_pool_host, keys, host_indices)

    # -- the pools of hybrid models (KV plus Mamba/SWA/indexer... pools): batch_*_v2 ------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest KV prefix present, cut to what every extra pool can
        restore under its hit policy (as HiCacheFile's)."""
        contains = self.store.contains
        kv_pages = self.store.count_prefix(keys)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            have = [contains(_pool_key(t.name, keys[i])) for i in range(kv_pages)]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = have.index(False) if False in have else kv_pages
                ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                tail = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - tail) : n])}
                boundary = max(ok, default=0)
            else:
                raise ValueError(f"AionvmeHiCache: unsupported pool hit policy {t.hit_policy!r}")
            if boundary:
                hits[t.name] = boundary
            restorable &= ok
        done = sorted(restorable)
        return PoolTransferResult(done[-1] if done else 0, hits, done)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {t.name: self._v2(t, self._get_pages) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {t.name: self._v2(t, self._set_pages) for t in transfers}

    def _v2(self, t: PoolTransfer, op: Any) -> list[bool]:
        """One pool's pages of a v2 batch; a transfer whose host indices do not
        cover its pages fails whole, as in HiCacheFile."""
        pool = self.registered_pools[t.name]
        keys = [_pool_key(t.name, k) for k in t.keys or []]
        need = len(keys) * int(getattr(pool, "page_size", 1) or 1)
        got = 0 if t.host_indices is None else int(t.host_indices.numel())
        if got != need:
            logger.error("aionvme HiCache: %s host indices for %s pages of pool %s", got, len(keys), t.name)
            return [False] * len(keys)
        result: list[bool] = op(pool, keys, t.host_indices)
        return result

    # -- pages of a host pool ------------------------------------------------------------------

    def _starts(self, pool: Any, host_indices: Any, n: int) -> list[int]:
        ps = int(getattr(pool, "page_size", 1) or 1)
        if host_indices is None or len(host_indices) < n * ps:
            got = 0 if host_indices is None else len(host_indices)
            raise ValueError(f"{got} host indices for {n} pages of {ps} tokens")
        return [int(host_indices[i * ps]) for i in range(n)]

    def _get_pages(self, pool: Any, skeys: list[str], host_indices: Any) -> list[bool]:
        """Read the pages stored under ``skeys`` into ``pool`` at ``host_indices``:
        True per page filled, False for a miss (its slot untouched)."""
        if not skeys:
            return []
        starts = self._starts(pool, host_indices, len(skeys))
        pages = [pool.get_data_page(s, flat=False) for s in starts]
        outs: list[Any] = [p.view(-1) if p.is_contiguous() else None for p in pages]
        t0 = time.perf_counter()
        staged = [i for i, o in enumerate(outs) if o is None]
        if not staged:  # every page contiguous in the pool (MLA models): read in place
            hits = self._read(skeys, outs)
        else:
            # a page in two parts (MHA: its K and V halves) is read into an
            # aligned staging page, then copied into the pool: in groups of at
            # most STAGING_KEPT bytes of staging, each one batched read
            page = pages[staged[0]]
            per = max(1, STAGING_KEPT // (page.numel() * page.element_size()))
            hits = []
            for g in range(0, len(skeys), per):
                part = range(g, min(g + per, len(skeys)))
                mine = [i for i in part if outs[i] is None]
                stage = self._staging(len(mine), page.numel(), page.dtype)
                bufs = {i: stage[j] for j, i in enumerate(mine)}
                got = self._read([skeys[i] for i in part], [bufs.get(i, outs[i]) for i in part])
                for i, ok in zip(part, got):
                    if ok and i in bufs:
                        pool.set_from_flat_data_page(starts[i], bufs[i])
                hits += got
        self._note(True, hits, pages, t0)
        return hits

    def _set_pages(self, pool: Any, skeys: list[str], host_indices: Any) -> list[bool]:
        """Write the pages of ``pool`` at ``host_indices`` under ``skeys`` (a key
        already stored names the same bytes: not rewritten)."""
        if not skeys:
            return []
        starts = self._starts(pool, host_indices, len(skeys))
        values = {
            k: pool.get_data_page(s, flat=True) for k, s in zip(skeys, starts) if not self.store.contains(k)
        }
        t0 = time.perf_counter()
        ok = self._write(values)
        self._note(False, [ok] * len(values), list(values.values()), t0)
        return [ok or k not in values for k in skeys]

    def _staging(self, n: int, numel: int, dtype: Any) -> Any:
        """n aligned staging pages of this thread, kept between calls (a fresh
        mmap each call would be faulted in, page by page, by the read)."""
        buf = getattr(self._stage, "buf", None)
        if buf is None or buf.dtype != dtype or buf.numel() < n * numel:
            buf = self._stage.buf = empty(n * numel, dtype=dtype, like="torch")
        return buf[: n * numel].view(n, numel)

    # -- the per-page calls (the generic path, and SGLang's own tests) --------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        if target_location is None:
            try:
                got = self.store.submit_get_many([key], missing="skip").result()
            except (StoreError, OSError) as err:
                return self._failed(err)
            return got[0]
        return target_location if self._read([key], [target_location])[0] else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        if target_locations is None:
            return [self.get(k) for k in keys]
        hits = self._read(list(keys), list(target_locations))
        return [t if ok else None for t, ok in zip(target_locations, hits)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if self.store.contains(key):
            return True
        return self._write({key: value})

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        return self._write({k: v for k, v in zip(keys, values) if not self.store.contains(k)})

    # -- the store calls ----------------------------------------------------------------------

    def _read(self, keys: list[str], outs: list[Any]) -> list[bool]:
        """Fill ``outs`` with the pages of ``keys``: True per page filled, False for a miss.
        A failed batch (an I/O error, a damaged page) is all False."""
        try:
            return [bool(h) for h in self.store.submit_get_many(keys, out=outs, missing="skip").result()]
        except (StoreError, OSError) as err:
            self._failed(err)
            return [False] * len(keys)

    def _write(self, values: dict[str, Any]) -> bool:
        if not values:
            return True
        try:
            self.store.submit_put_many(values).result()
        except (StoreError, OSError) as err:
            logger.warning("aionvme HiCache: a write of %d pages failed: %s", len(values), err)
            return False
        return True

    def _failed(self, err: BaseException) -> None:
        logger.warning("aionvme HiCache: a read failed: %s", err)
        if isinstance(err, CorruptValueError):
            with contextlib.suppress(KeyError):  # later lookups miss: SGLang recomputes the page
                self.store.delete(err.key)

    def _note(self, load: bool, oks: list[bool], bufs: list[Any], t0: float) -> None:
        if not self._metrics_on:
            return
        dt = time.perf_counter() - t0
        n = sum(1 for ok in oks if ok)
        nbytes = sum(int(b.numel()) * int(b.element_size()) for b, ok in zip(bufs, oks) if ok)
        with self._mlock:
            m = self._metrics
            (m.prefetch_pgs if load else m.backup_pgs).append(n)
            (m.prefetch_bandwidth if load else m.backup_bandwidth).append(
                nbytes / 1e9 / dt if dt > 0 else 0.0
            )

    # -- housekeeping ---------------------------------------------------------------------------

    def get_stats(self) -> Any:
        with self._mlock:
            mine, self._metrics = self._metrics, _Metrics()
        out = _storage_metrics()
        out.prefetch_pgs.extend(mine.prefetch_pgs)
        out.backup_pgs.extend(mine.backup_pgs)
        out.prefetch_bandwidth.extend(mine.prefetch_bandwidth)
        out.backup_bandwidth.extend(mine.backup_bandwidth)
        return out

    def clear(self) -> bool:
        for key in self.store.keys():  # noqa: SIM118 (a list, taken before the deletes)
            with contextlib.suppress(KeyError):
                self.store.delete(key)
        return True

    def close(self) -> None:
        self.store.close()


def _pool_key(pool: Any, key: str) -> str:
    """A page of an extra pool is stored under ``key.<pool>`` (HiCacheFile's
    names); the KV pool's under ``key``."""
    return key if pool == PoolName.KV else f"{key}.{pool}"
