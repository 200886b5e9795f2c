"""The store's read paths: get, get_many and hold, over the mover."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ..exceptions import DeviceError
from ._alloc import round_up
from ._errors import StoreFullError, StoreKeyError, StoreTimeoutError
from ._mover import Mover, as_torch, copy_into, read_job
from ._nvme import phase_of
from ._policy import Admission
from ._tiers import GPU, HOST, NVME, Entry, Pins
from ._values import check_out, is_cuda, result_like, result_span, view_as

__all__ = ["Hold", "Reads"]

# a get whose loads keep losing their copies to evictions reads straight into
# its result after this many tries, without promoting
TRIES = 8


class Reads:
    """Reads of one store's values; ``index`` is the store's entries by key."""

    def __init__(self, mover: Mover, index: dict[Hashable, Entry], admission: Admission) -> None:
        self.mover = mover
        self.index = index
        self.admission = admission

    def lookup(self, key: Hashable) -> Entry:
        e = self.index.get(key)
        if e is None:
            self.mover.nvme.stats["misses"] += 1
            raise StoreKeyError(key)
        return e

    def hit_now(self, e: Entry, out: Any) -> Any:
        """A CPU get served from the host tier with no suspension point (so no
        reference count, no task switch, no notify): the value, or None where
        the general path must serve it (not in host memory, a copy large
        enough for threads, a CUDA ``out``)."""
        c = e.copies.get(HOST)  # (not e.host: this is the hot path)
        if c is None:
            return None
        off = c.where
        meta = e.meta
        n = meta.nbytes
        if off is None or n == 0 or n >= self.mover.copy_threshold:
            return None
        h = self.mover.host
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
            copy_into(check_out(out, meta), src)
            value = out
        st = h.stats
        st["hits"] += 1
        st["bytes_out"] += n
        h.touch(e)
        return value

    def _result(self, e: Entry, device: str, out: Any) -> tuple[Any, Any, Any, bool]:
        """(value, its bytes, the whole pages around them or None, cuda) of a get of e."""
        meta = e.meta
        if out is not None:
            return out, check_out(out, meta), None, is_cuda(out)
        if device == "cpu" and meta.nbytes:
            value, raw, span = result_span(meta, phase_of(e.disk))
            return value, raw, span, False
        value, raw = result_like(meta, device, aligned=True, nbytes=round_up(meta.nbytes))
        return value, raw, None, device.startswith("cuda")

    async def get(self, e: Entry, device: str, out: Any, deadline: float | None) -> Any:
        """A get of entry e: from the hottest copy there is, loading it into the
        tier asked for where the admission policy agrees. Where every copy went
        away meanwhile (the key was deleted or replaced), the key's current
        entry is read; where loads keep losing their copies to evictions, the
        value is read straight into the result without promoting."""
        m = self.mover
        value, raw, span, cuda = self._result(e, device, out)
        if e.nbytes == 0:
            return value
        # a hit: the copy in the tier asked for was there, or on its way (a
        # prefetch), when the get began
        if cuda and m.gpu is not None:
            hit = e.gpu is not None or e.loading(GPU) is not None
            m.gpu.stats["hits" if hit else "misses"] += 1
        elif not cuda:
            hit = e.host is not None or e.loading(HOST) is not None
            m.host.stats["hits" if hit else "misses"] += 1
        direct = False  # no promotion into the host tier: read straight into the result
        cuda_direct = False  # no load into the GPU tier
        tries = 0
        while True:
            tries += 1
            if tries > TRIES:
                direct = cuda_direct = True
            if (
                cuda
                and m.gpu is not None
                and e.gpu is None
                and e.loading(GPU) is None
                and not cuda_direct
                and e.nbytes <= m.gpu.capacity
                and self.admission.admit(e.key, e.nbytes)
            ):
                m.start_load(e, GPU, deadline, wait=False)
            if e.gpu is not None:
                with m.pins(GPU, e):
                    raw[: e.nbytes].copy_(e.gpu[: e.nbytes])
                m.gpu.touch(e)  # type: ignore[union-attr]
                return value
            gpu_load = e.loading(GPU)
            if cuda and gpu_load is not None and not cuda_direct:
                if not await m.await_load(e, gpu_load, GPU):
                    cuda_direct = True
                continue
            if (
                e.host is None
                and e.loading(HOST) is None
                and e.disk is not None
                and not cuda
                and not direct
                and 0 < e.nbytes <= m.host.capacity
                and self.admission.admit(e.key, e.nbytes)
            ):
                m.start_load(e, HOST, deadline, wait=False)
            host_load = e.loading(HOST)
            if host_load is not None and e.host is None and not direct:
                if not await m.await_load(e, host_load):
                    direct = True  # no room to promote: read straight into the result
                continue
            if e.host is not None:
                with m.pins(HOST, e):
                    src = m.view(HOST, e)
                    if cuda:
                        as_torch(raw[: e.nbytes]).copy_(as_torch(src))
                    else:
                        await m.copy(raw[: e.nbytes], src)
                m.host.stats["bytes_out"] += e.nbytes
                m.host.touch(e)
                return value
            if e.disk is not None:
                with m.pins(NVME, e):
                    await m.nvme.read([read_job(e.disk, raw, span, e.nbytes)], [e.key])
                m.nvme.stats["hits"] += 1
                return value
            # every copy went away under us: the key was deleted or replaced
            if e.replaced is not None:
                await asyncio.shield(e.replaced)  # a put overwriting it in place
            cur = self.index.get(e.key)
            if cur is None:
                raise StoreKeyError(e.key)
            if cur is not e:
                # a newer value: its own result (its shape may differ), tried afresh
                e = cur
                value, raw, span, cuda = self._result(e, device, out)
                if e.nbytes == 0:
                    return value
                tries = 0
                direct = cuda_direct = False
            else:
                # the same value, whose loads kept losing their copies: read
                # it without loading (others run first, whatever took them)
                direct = cuda_direct = True
                await asyncio.sleep(0)

    async def promote_from(self, e: Entry, raw: Any) -> None:
        """Copy a value just read from NVMe (``raw``, its bytes) into the host
        tier, if room can be made without waiting."""
        m = self.mover
        if e.host is not None or e.loading(HOST) is not None or e.dead:
            return
        try:
            off = await m.make_room(m.host, e.nbytes, None, f"{e.key!r}", wait=False, phase=phase_of(e.disk))
        except (StoreFullError, StoreTimeoutError):
            return  # no room now (or no disk room to evict to): the value stays on NVMe
        try:
            if e.host is not None or e.dead:
                return
            await m.copy(m.host.view(off, e.nbytes), raw[: e.nbytes])
            if e.host is not None or e.dead:
                return
            e.copy(HOST).where, off = off, None
            m.host.add(e)
        finally:
            if off is not None:
                m.host.free(off, e.nbytes)

    async def get_many(
        self, keys: list[Hashable], device: str, out: Sequence[Any] | None, deadline: float | None
    ) -> list[Any]:
        """See :meth:`TieredStore.get_many`."""
        m = self.mover
        entries = [self.lookup(k) for k in keys]
        dests: list[Any] = [None] * len(keys)
        if out is not None:
            dests = list(out)
            if len(dests) != len(keys):
                raise ValueError(f"out has {len(dests)} buffers for {len(keys)} keys")
            for d, e in zip(dests, entries):
                check_out(d, e.meta)
        res: list[Any] = [None] * len(keys)
        cold: list[tuple[int, Entry, Any, Any]] = []
        jobs: list[tuple[Any, ...]] = []  # their NVMe reads
        warm: list[int] = []
        admitted: list[tuple[Entry, Any]] = []
        for i, e in enumerate(entries):
            d = dests[i]
            if (
                device == "cpu"
                and (d is None or not is_cuda(d))
                and e.nbytes > 0
                and e.host is None
                and e.loading(HOST) is None
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
                jobs.append(read_job(e.disk, raw, span, e.nbytes))
                if 0 < e.nbytes <= m.host.capacity and self.admission.admit(e.key, e.nbytes):
                    admitted.append((e, raw))
            else:
                warm.append(i)
        with Pins(NVME, [e for _, e, _, _ in cold], m.unref):
            if cold:
                await m.nvme.read(jobs, [e.key for _, e, _, _ in cold])
        for i, _, value, _ in cold:
            res[i] = value
        m.host.stats["misses"] += len(cold)
        m.nvme.stats["hits"] += len(cold)
        # promotion: a batch larger than the host tier promotes only its last
        # values that fit (the earlier ones would only evict each other)
        room = m.host.capacity
        keep = 0
        for e, _raw in reversed(admitted):
            if round_up(e.nbytes) > room:
                break
            room -= round_up(e.nbytes)
            keep += 1
        for e, raw in admitted[len(admitted) - keep :]:
            await self.promote_from(e, raw)
        if warm:
            # every get ends before this returns or raises: none is left copying into an out= buffer
            got = await asyncio.gather(
                *(self.get(entries[i], device, dests[i], deadline) for i in warm),
                return_exceptions=True,
            )
            for r in got:
                if isinstance(r, BaseException):
                    raise r
            for i, v in zip(warm, got):
                res[i] = v
        return res


class Hold:
    """The async context manager of :meth:`TieredStore.hold`: the owner of the
    reference it takes on the value's copy, given back when the block exits."""

    def __init__(self, store: Any, reads: Reads, key: Hashable, device: str, timeout: float | None) -> None:
        self.store = store
        self.reads = reads
        self.key = key
        self.device = device
        self.timeout = timeout
        self._pins: Pins | None = None
        self._tier = GPU if device.startswith("cuda") else HOST

    async def __aenter__(self) -> Any:
        s = self.store
        m = self.reads.mover
        s._enter()
        deadline = s._deadline(self.timeout)
        tier = self._tier
        while True:
            e = self.reads.lookup(self.key)
            if e.nbytes == 0:
                return result_like(e.meta, self.device, aligned=False)[0]
            t = m.tiers.get(tier)
            if t is None:
                raise DeviceError("hold(device='cuda') on a store without a GPU tier (gpu=None)")
            if e.nbytes > t.capacity:
                name = "GPU" if tier == GPU else "host"
                raise StoreFullError(f"{self.key!r} ({e.nbytes} bytes) is larger than the {name} tier")
            if tier == HOST and e.replaced is not None:
                await asyncio.shield(e.replaced)  # a put overwriting it in place
                continue
            if e.at(tier) is None and not await m.join_load(e, m.start_load(e, tier, deadline), tier):
                continue
            if e.at(tier) is not None and not e.dead:
                self._pins = m.pins(tier, e)
                t.stats["hits"] += 1
                if tier == HOST:
                    t.touch(e)
                return view_as(m.view(tier, e), e.meta)

    async def __aexit__(self, *exc: object) -> None:
        pins, self._pins = self._pins, None
        if pins is not None:
            pins.release()
