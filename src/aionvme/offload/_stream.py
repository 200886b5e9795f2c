"""Layer-streamed inference: a model's weights read from safetensors on
NVMe block by block, just before each block runs, under a memory budget."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..defaults import parse_size
from ..file import File
from ..file import open as nvme_open
from ..memory import empty
from ..store import StoreTimeoutError, TieredStore
from ._index import WeightIndex, read_index
from ._loop import LoopThread
from ._planner import BudgetError, InferenceOnlyError, Ledger, ResidencyPlan, plan_residency, upcoming
from ._units import (
    ABSENT,
    ALIGN,
    LOADING,
    READY,
    Group,
    Unit,
    build_units,
    itemsize,
    needs_copy,
    placeholder,
    round_up,
)

__all__ = ["Streamer", "start_streamer", "stream", "streamer_of"]

_ATTR = "_aionvme_streamer"
_TIMELINE_MAX = 100_000


class Streamer:
    """The state of a streamed model: units, residency, hooks and counters.

    Made by :func:`stream`; reach it with :func:`streamer_of`.
    """

    def __init__(
        self,
        model: nn.Module,
        index: WeightIndex,
        loop: LoopThread,
        *,
        budget: int,
        device: torch.device,
        prefetch: int,
        dtype: torch.dtype | None,
        source: str,
        bind: bool = True,
        groups: list[Group] | None = None,
    ) -> None:
        self.model = model
        # bind=False: the tensors are not put into the model; a caller's own
        # hooks fetch them from ``loaded`` while the unit is resident (the
        # accelerate integration: accelerate's AlignDevicesHook places them)
        self.bind = bind
        self.loaded: dict[int, dict[int, torch.Tensor]] = {}
        self.index = index
        self.device = device
        self.prefetch = prefetch
        self.budget = budget
        self._loop = loop
        self._files: dict[str, File] = {}
        self._hooks: list[Any] = []
        self._closed = False
        self.loads = 0
        self.hits = 0
        self.misses = 0
        self.wait_s = 0.0
        self.passes = 0
        self.timeline: list[tuple[str, str, float, float]] = []
        self._t0 = time.perf_counter()
        self.direct_loads = 0
        self.direct_bytes = 0
        self._outside = 0  # bytes of weights held outside the store's host tier now (under _lock)
        self._lock = threading.Lock()
        self.peak_memory = 0  # sampled at every hook: store host tier + bytes outside it
        self._evict_released = False  # True when blocks are converted: copies live outside the store
        self.units = build_units(model, index, dtype, device, source, groups)
        self.schedule: list[int] = [u.id for u in self.units]
        self._recording: list[int] | None = None
        self._pos = 0
        self.ledger = Ledger(budget)
        self.plan = self._replan()
        # The weights' home: a TieredStore whose host tier is the budget and whose
        # NVMe tier is the checkpoint itself (attach: nothing is copied). Its own
        # slab directory stays empty (nothing is put) and goes on close().
        self._scratch = tempfile.mkdtemp(prefix="aionvme-stream-")
        self._store = TieredStore(self._scratch, host=budget, persist=False)
        if any(needs_copy(sl, self.device) for u in self.units for sl in u.slots):
            self._evict_released = True
        try:
            self._loop.run(self._attach_all())
        except BaseException:
            self._loop.run(self._store.close())
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise
        # Everything is checked: only now is the model changed.
        if bind:
            self._detach_weights()
        self._install_hooks()
        # Pinned blocks are read now, in order, so that they lie packed at the
        # start of the store's host tier and leave its rest in one piece for
        # the blocks that stream (the forward waits for them as for any read).
        for uid in dict.fromkeys(self.schedule):
            if uid in self.plan.pinned:
                self._start_load(self.units[uid])

    # -- construction ------------------------------------------------------------

    async def _attach_all(self) -> None:
        for u in self.units:
            for key, (path, off, length, _pos) in zip(u.keys, u.extents, strict=True):
                await self._store.attach(key, path, off, (length,), "uint8")

    def _replan(self) -> ResidencyPlan:
        return plan_residency([u.nbytes for u in self.units], self.schedule, self.budget, self.prefetch)

    def _detach_weights(self) -> None:
        """Every streamed tensor becomes a placeholder: one new Parameter per
        distinct parameter (shared by all the modules that tie it), whose
        ``.data`` is swapped between the placeholder and the loaded view."""
        for u in self.units:
            for s in u.slots:
                ph = placeholder(s.shape, s.target, self.device)
                if s.is_param:
                    s.param = nn.Parameter(ph, requires_grad=False)
                    for m, name in s.buffer_refs:
                        m._parameters[name] = s.param
                else:
                    for m, name in s.buffer_refs:
                        m._buffers[name] = ph

    def _install_hooks(self) -> None:
        for u in self.units:
            for root in u.roots:
                self._hooks.append(root.register_forward_pre_hook(self._pre_hook(u)))
                self._hooks.append(root.register_forward_hook(self._post_hook(u), always_call=True))
        # The pass begins before a unit rooted at the model itself is acquired
        # (prepend), and ends after it is done (registered last): its uses are recorded.
        self._hooks.append(self.model.register_forward_pre_hook(self._pass_begin, prepend=True))
        self._hooks.append(self.model.register_forward_hook(self._pass_end, always_call=True))

    def _pre_hook(self, u: Unit) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.acquire(u)

        return hook

    def _post_hook(self, u: Unit) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            self.done(u)

        return hook

    # -- a pass --------------------------------------------------------------------

    def _pass_begin(self, module: nn.Module, args: Any) -> None:
        if self._closed:
            raise RuntimeError("this model's streamer is closed")
        _inference_only()
        self._recording = []
        self._pos = 0
        self._top_up()

    def _pass_end(self, module: nn.Module, args: Any, out: Any) -> None:
        rec, self._recording = self._recording, None
        if rec is None:
            return  # refused as it began (always_call runs this hook even then)
        self.passes += 1
        if rec and rec != self.schedule:
            # The first pass tells the real order (the module order was a guess).
            self.schedule = rec
            self.plan = self._replan()
            for u in self.units:
                if u.state == READY and u.active == 0 and not self._keep(u):
                    self._release(u)
        self._pos = 0
        self._top_up()  # the next pass's first blocks, read while the caller works

    def acquire(self, u: Unit) -> None:
        """Make ``u`` resident and bound to the model (pre-forward)."""
        _inference_only()  # a block called on its own, outside a pass
        if self._recording is not None and (not self._recording or self._recording[-1] != u.id):
            self._recording.append(u.id)
        n = len(self.schedule)
        for k in range(n):
            if self.schedule[(self._pos + k) % n] == u.id:
                self._pos = (self._pos + k + 1) % n
                break
        t0 = time.perf_counter()
        if u.state == ABSENT:
            self.misses += 1
            self._make_room(u)
            self._start_load(u)
        else:
            self.hits += 1
        if u.state == LOADING:
            self._finish_load(u)
        self.wait_s += time.perf_counter() - t0
        self._sample()
        u.active += 1
        self._top_up()
        self._mark(u.name, "wait", t0)

    def done(self, u: Unit) -> None:
        """``u`` has run (post-forward): release it unless it is kept."""
        u.active = max(0, u.active - 1)
        self._mark(u.name, "compute", self._last_mark)
        if u.active == 0 and u.state == READY and not self._keep(u):
            self._release(u)
        self._top_up()
        self._sample()

    def _sample(self) -> None:
        """Weight bytes in memory now: the store's host tier and what is outside it."""
        used = int(self._store.stats()["host"]["used"]) + self._outside
        self.peak_memory = max(self.peak_memory, used)

    def _keep(self, u: Unit) -> bool:
        return u.id in self.plan.pinned or u.id in upcoming(self.schedule, self._pos, self.prefetch)

    def _make_room(self, u: Unit) -> None:
        """Free read-ahead that is not needed before ``u`` so that ``u`` fits."""
        if self.ledger.fits(u.nbytes):
            return
        for v in reversed(upcoming(self.schedule, self._pos, len(self.schedule))):
            if self.ledger.fits(u.nbytes):
                break
            if v == u.id or v in self.plan.pinned or self.units[v].active:
                continue
            w = self.units[v]
            if w.state == LOADING:
                self._finish_load(w)
            if w.state == READY:
                self._release(w)
        if not self.ledger.fits(u.nbytes):
            raise BudgetError(
                f"block {u.name} needs {u.nbytes} bytes but only {self.budget - self.ledger.used} of the "
                f"budget ({self.budget}) are free while the blocks running hold the rest"
            )

    def _top_up(self) -> None:
        """Start reading the next ``prefetch`` blocks that fit in the budget, in order."""
        if self.prefetch <= 0:
            return
        for v in upcoming(self.schedule, self._pos, self.prefetch):
            w = self.units[v]
            if w.state != ABSENT:
                continue
            if not self.ledger.fits(w.nbytes):
                break
            self._start_load(w)

    # -- loading -----------------------------------------------------------------

    def _start_load(self, u: Unit) -> None:
        self.ledger.reserve(u.id, u.nbytes)
        u.state = LOADING
        u.future = self._loop.submit(self._read(u))

    def _finish_load(self, u: Unit) -> None:
        fut = u.future
        if fut is None:
            raise RuntimeError(f"block {u.name} has no load in flight")
        try:
            tensors = fut.result()
        except BaseException:
            u.state = ABSENT
            u.future = None
            self.ledger.release(u.id)
            raise
        u.future = None
        if not self.bind:
            self.loaded[u.id] = tensors
        else:
            for k, s in enumerate(u.slots):
                if s.param is not None:
                    s.param.data = tensors[k]
                else:
                    for m, name in s.buffer_refs:
                        m._buffers[name] = tensors[k]
        u.state = READY
        self.loads += 1

    def _release(self, u: Unit) -> None:
        self.loaded.pop(u.id, None)
        if self.bind:
            for s in u.slots:
                ph = placeholder(s.shape, s.target, self.device)
                if s.param is not None:
                    s.param.data = ph
                else:
                    for m, name in s.buffer_refs:
                        m._buffers[name] = ph
        u.state = ABSENT
        holds, u.holds = u.holds, []
        fut = self._loop.submit(self._unhold(u, holds))
        if self._evict_released or self._outside > 0:
            # the bytes must have left the store before the budget counts them free
            fut.result()
        # else: the holds end on the loop thread before any read submitted after
        # this one starts (the loop runs them in order), with no round trip here
        with self._lock:
            self._outside -= u.outside
            u.outside = 0
        self.ledger.release(u.id)

    async def _unhold(self, u: Unit, holds: list[Any]) -> None:
        """End a unit's holds. Its bytes stay in the store's host tier (a later
        load is a hit) until the store evicts them for another unit; unless
        weights live outside the store too, which the budget must then cover:
        the released bytes are dropped at once (they are never written back).
        Runs on the loop thread, as every read, so no read slips in between."""
        for h in holds:
            await h.__aexit__(None, None, None)
        if self._evict_released or self._outside > u.outside:
            for k in u.keys:
                if "host" in self._store.where(k):
                    await self._store.evict(k)

    def _file(self, path: str) -> File:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = nvme_open(path, "r")
        return f

    async def _hold_all(self, u: Unit) -> list[torch.Tensor | None]:
        """Hold every read of ``u`` in the store's host tier (loaded from the
        checkpoint on a miss, all at once): views of the store's memory. None
        for a read the tier has no room for without waiting: the ledger keeps
        the held bytes within the budget, so its free space is in pieces."""
        holds = [self._store.hold(k, timeout=0) for k in u.keys]
        got = await asyncio.gather(*(h.__aenter__() for h in holds), return_exceptions=True)
        other = [g for g in got if isinstance(g, BaseException) and not isinstance(g, StoreTimeoutError)]
        if other:
            for h in holds:
                await h.__aexit__(None, None, None)  # a hold that failed has nothing to end
            raise other[0]
        u.holds = [h for h, g in zip(holds, got, strict=True) if not isinstance(g, BaseException)]
        return [None if isinstance(g, BaseException) else g for g in got]

    def _add_outside(self, u: Unit, nbytes: int) -> None:
        with self._lock:
            u.outside += nbytes
            self._outside += nbytes

    async def _read_direct(self, u: Unit, views: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """The reads the store could not place, into memory of the unit's own
        (one batched request per file): the fallback when the store's host tier
        is too fragmented. Cached, unheld units are dropped from the store
        first, and at every release while it is resident, so that the store's
        host tier and this memory together stay within the budget."""
        missing = [j for j, v in enumerate(views) if v is None]
        size = sum(round_up(u.extents[j][2], ALIGN) for j in missing)
        # Counted before anything is awaited: a unit released from now on drops
        # its bytes from the store (see _release/_unhold) instead of leaving them
        # cached while the budget already counts them free. Counted after the
        # read, as before, a release during it let the store keep those bytes
        # next to this memory (peak 1.3-1.4x the budget in test_offload_stream).
        self._add_outside(u, size)
        try:
            for v in self.units:
                if v is not u and v.state == ABSENT:
                    for k in v.keys:
                        if "host" in self._store.where(k):
                            await self._store.evict(k)  # waits for a hold that is still ending
            buf = empty(size, "uint8", like="torch")
            by_file: dict[str, list[tuple[Any, int]]] = {}
            out = list(views)
            pos = 0
            for j in missing:
                path, off, length, _ = u.extents[j]
                out[j] = buf[pos : pos + length]
                by_file.setdefault(path, []).append((out[j], off))
                pos += round_up(length, ALIGN)
            # every file's reads end before buf is let go, even when one fails
            results = await asyncio.gather(
                *(self._file(p).pread_many(items) for p, items in by_file.items()), return_exceptions=True
            )
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        except BaseException:
            self._add_outside(u, -size)  # nothing of it is held now
            raise
        self.direct_loads += 1
        self.direct_bytes += sum(u.extents[j][2] for j in missing)
        return [v for v in out if v is not None]

    async def _read(self, u: Unit) -> dict[int, torch.Tensor]:
        """On the loop thread: the unit's reads held in the store (or read
        directly, see _read_direct); the tensors are views of them."""
        t0 = time.perf_counter()
        held = await self._hold_all(u)
        if any(v is None for v in held):
            views = await self._read_direct(u, held)
        else:
            views = [v for v in held if v is not None]
        self._mark(u.name, "io", t0)
        out: dict[int, torch.Tensor] = {}
        copies: list[int] = []
        for k, s in enumerate(u.slots):
            e = s.entry
            stored = getattr(torch, e.dtype)
            raw = views[s.run][s.pos : s.pos + e.nbytes]
            if s.pos % itemsize(e.dtype) == 0:
                out[k] = raw.view(stored).view(e.shape)
            else:
                out[k] = raw.clone().view(stored).view(e.shape)
                self._add_outside(u, e.nbytes)
            if needs_copy(s, self.device):
                copies.append(k)
        if copies:
            # Conversions and device copies are real work: off the loop thread.
            def convert() -> None:
                for k in copies:
                    out[k] = out[k].to(device=self.device, dtype=u.slots[k].target)

            await asyncio.to_thread(convert)
            self._add_outside(
                u, sum(out[k].numel() * out[k].element_size() for k in copies if out[k].device.type == "cpu")
            )
        return out

    # -- reporting ---------------------------------------------------------------

    _last_mark = 0.0

    def _mark(self, name: str, kind: str, t0: float) -> None:
        t1 = time.perf_counter()
        if kind != "io":
            self._last_mark = t1
        if len(self.timeline) < _TIMELINE_MAX:
            self.timeline.append((name, kind, t0 - self._t0, t1 - self._t0))

    @property
    def bytes_read(self) -> int:
        """Bytes read from the checkpoint (through the store, and direct reads)."""
        return int(self._store.stats()["nvme"]["bytes_out"]) + self.direct_bytes

    def stats(self) -> dict[str, Any]:
        """Counters: bytes read, loads, hits and misses at the hooks, seconds
        the forward waited for reads, resident bytes now and at peak (as
        reserved by the planner, and as measured: the store's host tier plus
        copies outside it, sampled at every hook), the budget."""
        st = self._store.stats()
        return {
            "bytes_read": self.bytes_read,
            "store_host_bytes": int(st["host"]["used"]),
            "store_evictions": int(st["host"]["evictions"]),
            "direct_loads": self.direct_loads,
            "peak_memory_bytes": self.peak_memory,
            "loads": self.loads,
            "hits": self.hits,
            "misses": self.misses,
            "wait_s": self.wait_s,
            "passes": self.passes,
            "resident_bytes": self.ledger.used,
            "peak_resident_bytes": self.ledger.peak,
            "budget": self.budget,
            "units": len(self.units),
            "pinned_units": len(self.plan.pinned),
            "model_bytes": sum(u.nbytes for u in self.units),
        }

    def iter_units(self) -> Iterator[tuple[str, int, bool]]:
        """(name, bytes, pinned) per unit, in schedule order."""
        for uid in dict.fromkeys(self.schedule):
            u = self.units[uid]
            yield u.name, u.nbytes, uid in self.plan.pinned

    def close(self) -> None:
        """Remove the hooks, wait for reads in flight, release every block and
        its share of the background loop. The model's weights are placeholders afterwards."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        for u in self.units:
            if u.future is not None:
                with contextlib.suppress(Exception):  # closing: the read's outcome no longer matters
                    u.future.result()
                u.future = None
                u.state = READY
            if u.state == READY:
                self._release(u)
        files = list(self._files.values())
        self._files.clear()

        async def close_files() -> None:
            try:
                await self._store.close()
            finally:
                for f in files:
                    await f.aclose()

        try:
            self._loop.run(close_files())
        finally:
            self._loop.close()
            shutil.rmtree(self._scratch, ignore_errors=True)
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)


def _inference_only() -> None:
    """InferenceOnlyError unless autograd is off: a pass under grad mode would
    build a graph over weights released as soon as their block has run, and
    ``backward()`` would fail on torch's "does not require grad" (or, with an
    input that requires grad, read weights that are gone)."""
    if torch.is_grad_enabled():
        raise InferenceOnlyError(
            "aionvme.offload.stream() runs models for inference only (each block's weights are released "
            "once it has run, so there is no backward pass through them); autograd is on: run the model "
            "under torch.inference_mode() or torch.no_grad()"
        )


def stream(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    budget: int | str,
    device: str | torch.device = "cpu",
    prefetch: int = 2,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Run ``model`` with its weights streamed from safetensors under a memory budget.

    Parameters
    ----------
    model : torch.nn.Module
        Built on the meta device (``with torch.device("meta")`` or
        ``accelerate.init_empty_weights()``) or with its weights present (they
        are dropped). Its parameter and buffer names must match the
        checkpoint's tensor names; tied weights are read once.
    path : str or os.PathLike
        A ``save_pretrained`` directory (sharded with
        ``model.safetensors.index.json``, or one ``model.safetensors``), an
        index file, or one safetensors file (e.g. from
        :func:`aionvme.save_safetensors`).
    budget : int or str
        Bytes the streamed weights may occupy at once, e.g. ``"2G"``: resident
        blocks and reads in flight together. Activations are not counted.
    device : str or torch.device
        Where the weights are used: ``"cpu"``, or ``"cuda"`` (read to host,
        then copied; unverified without a GPU).
    prefetch : int
        Blocks read ahead while the current one computes.
    dtype : torch.dtype, optional
        Convert floating-point weights to this dtype (a copy per read).
        Without it, a floating-point weight is converted only where the
        model's parameter has another dtype than the checkpoint.

    Returns
    -------
    The same module, with hooks: ``model(inputs)`` gives the same outputs as
    the model held in memory. :func:`streamer_of` gives its counters and
    ``close()``.

    Raises
    ------
    BudgetError
        The budget cannot hold the largest block.
    InferenceOnlyError
        Later, from ``model(inputs)`` under grad mode (not raised by ``stream``).
    TensorNotFoundError
        A meta-device parameter or buffer has no tensor in the checkpoint.

    Notes
    -----
    Blocks are the children of the model's largest ``nn.ModuleList`` (its
    repeated layers); the rest of the model forms one unit per top-level
    submodule (modules sharing tied weights form one). The weights live in an
    :class:`aionvme.TieredStore` whose host tier is ``budget`` and whose NVMe
    tier is the checkpoint itself (:meth:`~aionvme.TieredStore.attach`: no
    copy on disk; its own slab, in a temporary directory, stays empty): each
    run of a block's tensors in a file is one key, held in the host tier while
    the block is resident and used in place (no copy unless a dtype or device
    change is needed). A released block stays in the host tier until the
    store evicts it for another (a later pass may find it there); evicting
    never writes. When the tier's free space is too fragmented to place a
    read, that read goes to memory of its own instead (``direct_loads`` in
    :meth:`Streamer.stats`), counted in the same budget, and released blocks
    are dropped at once while it is resident. Reads run on aionvme's
    background event-loop thread, so the forward (synchronous) computes
    while the next ``prefetch`` blocks are read. The
    first pass records the order in which blocks run; the residency plan
    pins as many blocks as the budget allows (all of them when the model
    fits, so later passes do no I/O). Streaming is for inference: parameters
    are set to ``requires_grad=False``, and a forward with autograd on raises
    :class:`InferenceOnlyError` before anything is read; run under
    ``torch.no_grad()`` or ``torch.inference_mode()``.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from ..exceptions import DeviceError

        raise DeviceError(f"device={device!r} needs CUDA, but torch.cuda.is_available() is False")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("this model is already streamed; close its streamer first")
    nbytes = parse_size(budget)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        # transformers models built empty (init_empty_weights) hold untied
        # meta copies of tied weights until this runs; the checkpoint has one.
        tie()
    s = start_streamer(
        model, path, budget=nbytes, device=dev, prefetch=prefetch, dtype=dtype, source=os.fspath(path)
    )
    setattr(model, _ATTR, s)
    return model


def start_streamer(
    model: nn.Module, index: WeightIndex | str | os.PathLike[str], *, name: str = "streamer", **kw: Any
) -> Streamer:
    """A :class:`Streamer` on a share of the background loop of its own, given to it, or
    closed again when the streamer cannot be made. ``index``: a checkpoint's path (its
    headers are read here) or its :class:`WeightIndex`; ``kw``: Streamer's keywords."""
    loop = LoopThread(name)
    try:
        if not isinstance(index, WeightIndex):
            index = loop.run(read_index(index))
        return Streamer(model, index, loop, **kw)
    except BaseException:
        loop.close()
        raise


def streamer_of(model: nn.Module) -> Streamer:
    """The :class:`Streamer` of a model returned by :func:`stream`."""
    s = getattr(model, _ATTR, None)
    if not isinstance(s, Streamer):
        raise ValueError("this model is not streamed (see aionvme.offload.stream)")
    return s
