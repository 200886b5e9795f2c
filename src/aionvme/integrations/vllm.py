"""vLLM's NVMe KV tier: :class:`AionvmeTier`, a ``SecondaryTierManager`` over
:class:`aionvme.SyncTieredStore`.

vLLM's multi-tier KV offloading keeps a CPU primary tier and loads secondary
tiers by module path and class name (``SecondaryTierFactory``), so this one
runs without a fork of vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "AionvmeTier",
          "module_path": "aionvme.integrations.vllm",
          "root_dir": "/nvme/kv", "capacity": "500G"}]}}'

Each chunk of the primary tier is one value of a cache-mode store
(``on_full="evict"``): the disk never holds more than ``capacity``; when it is
full the coldest chunks no request is reading are dropped, and reported as
removal events. Stores and loads go from the primary tier's memory straight
to and from the NVMe slabs (O_DIRECT, batched, checksummed), on aionvme's
background loop; vLLM's scheduler thread only submits and polls.

vLLM is imported only here (``import aionvme`` never loads it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from .. import defaults
from ..exceptions import InvalidOffsetError
from ..store import CorruptValueError, SyncTieredStore

__all__ = ["AionvmeTier"]

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    """One submitted transfer: its future and what its result reports."""

    job_id: JobId
    keys: list[OffloadKey]
    req_id: str
    load: bool
    nbytes: int
    t0: float = field(default_factory=time.monotonic)
    fut: concurrent.futures.Future[Any] | None = None


def _namespace(spec: Any, block_bytes: int) -> str:
    """A directory name per model, KV layout and rank: chunks of one run
    configuration never answer lookups of another (the store's bytes carry no
    description of their format)."""
    cfg = getattr(spec, "config", None)
    model = getattr(getattr(cfg, "model", None), "name", "") or "model"
    par = getattr(cfg, "parallel", None)
    fields = ("rank", "world_size", "tp_size", "pp_size", "pcp_size", "dcp_size")
    ranks = None if par is None else [getattr(par, f, None) for f in fields]
    run = {
        "model": model,
        "dtype": getattr(getattr(cfg, "model", None), "dtype", None),
        "tokens_per_hash": getattr(getattr(cfg, "cache", None), "tokens_per_hash", None),
        "blocks_per_chunk": getattr(getattr(cfg, "cache", None), "blocks_per_chunk", None),
        "groups": [int(g.tokens_per_block) for g in getattr(cfg, "groups", ()) or ()],
        "parallel": ranks,
        "kv_cache_layout": getattr(cfg, "kv_cache_layout", None),
        "chunk_bytes": block_bytes,
    }
    digest = hashlib.sha256(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest()[:12]
    rank = ranks[0] if ranks and isinstance(ranks[0], int) else 0
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', str(model)).strip('-.')[-48:] or 'model'}-r{rank}-{digest}"


class AionvmeTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM's class is untyped here
    """A bounded NVMe secondary tier for vLLM's KV offloading.

    Parameters (the tier's entry in ``secondary_tiers``)
    ------------------------------------------------------
    root_dir : str
        Directory on the NVMe drive; the store lives in a subdirectory named
        after the model, KV layout and rank.
    capacity : int or str
        Most bytes the tier keeps on disk (``"500G"``), preallocated.
    host : int or str
        A host-memory tier of the store in front of NVMe (default 0: vLLM's
        primary tier already is the host tier).
    persist : bool
        Keep the chunks across restarts (each store is durable before it is
        reported done); default False (the store's files go at shutdown).
    enable_kv_events : bool
        Report stored chunks, and the ones the capacity bound dropped, as KV
        events (effective when vLLM's KV cache events are on).
    locality : {"LOCAL", "REMOTE"} or None
        Reported with the events.

    Notes
    -----
    A chunk a request was told is here (``lookup`` HIT) is pinned in the store
    until that request has loaded it or finished, so eviction cannot take it in
    between. Every chunk read back is checked against the checksum taken when
    it was written: a damaged one fails its load (vLLM recomputes it) and is
    dropped from the store.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        capacity: int | str,
        host: int | str = 0,
        persist: bool = False,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning(
                    "enable_kv_events is set on tier %r but KV cache events are off in vLLM: no events",
                    tier_type,
                )
        self._chunk = int(self.block_size_bytes)
        # the primary tier as bytes: chunk c is _slots[c*chunk:(c+1)*chunk]
        self._slots = np.frombuffer(primary_kv_view, dtype=np.uint8)
        self._nchunks = self._slots.size // self._chunk if self._chunk else 0
        self.path = os.path.join(os.fspath(root_dir), _namespace(offloading_spec, self._chunk))
        os.makedirs(self.path, exist_ok=True)
        self.store = SyncTieredStore(
            self.path,
            host=host,
            nvme=defaults.parse_size(capacity, "capacity"),
            persist=bool(persist),
            on_full="evict",
            checksum=True,
        )
        # in flight, in submission order. vLLM calls a tier under its manager's
        # lock (never two calls at once), so the tier's state needs no lock of its own.
        self._jobs: dict[JobId, _Job] = {}
        self._pinned: dict[str, set[OffloadKey]] = {}  # per request: keys its lookups pinned

    # -- lookups ---------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        mine = self._pinned.get(req_context.req_id)
        if mine is not None and key in mine:
            return LookupResult.HIT
        if not self.store.pin([key])[0]:
            return LookupResult.MISS
        self._pinned.setdefault(req_context.req_id, set()).add(key)
        return LookupResult.HIT

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Chunks vLLM used again: the last to be dropped when the tier is full."""
        self.store.touch(list(keys))

    def on_request_finished(self, req_context: ReqContext) -> None:
        keys = self._pinned.pop(req_context.req_id, None)
        if keys:
            self.store.unpin(list(keys))

    # -- transfers -------------------------------------------------------------------------

    def _views(self, chunk_ids: Any) -> list[np.ndarray[Any, Any]]:
        n, c = self._nchunks, self._chunk
        views = []
        for cid in np.asarray(chunk_ids, dtype=np.int64).tolist():
            if not 0 <= cid < n:
                raise InvalidOffsetError(f"chunk id {cid} is outside the primary tier's {n} chunks")
            views.append(self._slots[cid * c : (cid + 1) * c])
        return views

    def _track(self, job: _Job, fut: concurrent.futures.Future[Any] | None) -> None:
        job.fut = fut
        self._jobs[job.job_id] = job

    def submit_store(self, job_metadata: TransferJob) -> None:
        pairs = [
            (k, v)
            for k, v in zip(job_metadata.keys, self._views(job_metadata.chunk_ids))
            if not self.store.contains(k)  # already here: nothing to write
        ]
        job = _Job(job_metadata.job_id, [k for k, _ in pairs], job_metadata.req_context.req_id, False, 0)
        job.nbytes = len(pairs) * self._chunk
        self._track(job, self.store.submit_put_many(dict(pairs)) if pairs else None)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        views = self._views(job_metadata.chunk_ids)
        job = _Job(job_metadata.job_id, keys, job_metadata.req_context.req_id, True, len(keys) * self._chunk)
        fut = self.store.submit_get_many(keys, out=views, missing="skip") if keys else None
        self._track(job, fut)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        # the jobs are few (one per request and step): a scan of their futures
        # is cheaper than a completion queue fed from the store's loop
        done = [j for j in self._jobs.values() if j.fut is None or j.fut.done()]
        for job in done:
            del self._jobs[job.job_id]
        evicted = self.store.drain_evicted()  # drained always: the store keeps them until asked
        if self.events is not None and evicted:
            self.events.append(
                OffloadingEvent(keys=list(evicted), medium=self.medium, removed=True, locality=self.locality)
            )
        return [self._result(job) for job in done]

    def _result(self, job: _Job) -> JobResult:
        took = time.monotonic() - job.t0
        err = None if job.fut is None else job.fut.exception()
        if err is not None:
            logger.warning(
                "aionvme KV tier: %s of %d chunks failed: %s",
                "load" if job.load else "store",
                len(job.keys),
                err,
            )
            if isinstance(err, CorruptValueError):
                self._drop(err.key)
        if not job.load:
            if err is None and self.events is not None and job.keys:
                kept = [k for k in job.keys if self.store.contains(k)]
                if kept:
                    self.events.append(
                        OffloadingEvent(keys=kept, medium=self.medium, removed=False, locality=self.locality)
                    )
            return JobResult(job.job_id, err is None, None, took, job.nbytes)
        self._release(job.req_id, job.keys)
        hits: list[bool] = (
            [False] * len(job.keys) if err is not None else (job.fut.result() if job.fut else [])
        )
        ok = all(hits)
        partial = tuple(k for k, h in zip(job.keys, hits) if h) if not ok and any(hits) else None
        return JobResult(job.job_id, ok, partial, took, sum(hits) * self._chunk)

    def _release(self, req_id: str, keys: Collection[OffloadKey]) -> None:
        """A loaded chunk is in the primary tier now: its lookup pin can go."""
        mine = self._pinned.get(req_id)
        if not mine:
            return
        gone = [k for k in keys if k in mine]
        if gone:
            mine.difference_update(gone)
            self.store.unpin(gone)

    def _drop(self, key: Any) -> None:
        """A chunk that failed its checksum is removed (later lookups miss and vLLM recomputes)."""
        with contextlib.suppress(KeyError):
            self.store.delete(key)

    # -- events, draining, shutdown ----------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is not None:
            yield from self.events
            self.events.clear()

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        concurrent.futures.wait([j.fut for j in self._jobs.values() if j.fut is not None])

    def shutdown(self) -> None:
        self.drain_jobs()
        for keys in self._pinned.values():
            if keys:
                self.store.unpin(list(keys))
        self._pinned.clear()
        self.store.close()
