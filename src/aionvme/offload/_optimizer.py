"""A torch optimizer whose state lives on NVMe between steps, updated chunk
by chunk with the reads and writes of neighbouring chunks overlapped."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..defaults import parse_size
from ..memory import empty
from ._chunks import (
    LOW,
    MASTER,
    Chunk,
    Layout,
    check_saved,
    cut,
    join_pieces,
    layout_of,
    pages,
    param_bytes,
    piece_views,
    settle,
    size_text,
    smallest_budget,
    spec_of,
    split_pieces,
    view,
)
from ._loop import LoopThread
from ._pipeline import Job, Pipeline
from ._planner import BudgetError, Ledger
from ._state import BlobStore, open_blob_store

__all__ = ["Optimizer"]

_DEPTH = 6  # chunks the streaming room is sized for: 2-3 read ahead, 1 stepped, 2 written behind
_ROOM = 64 << 20  # default streaming room (a quarter of the budget when that is more): bytes in flight


class Optimizer(torch.optim.Optimizer):
    """Wrap a torch optimizer so that its state lives on NVMe between steps.

    Parameters
    ----------
    optimizer_class : type
        A ``torch.optim.Optimizer`` subclass (AdamW, Adam, SGD with momentum,
        ...) that keeps per-parameter state and updates each parameter from
        its own gradient and state. Its math is used as it is, so results
        equal the same optimizer run in memory, bit for bit.
    params : iterable
        Parameters or parameter groups, as for ``optimizer_class``.
    path : str or os.PathLike
        Directory for the state file (removed by :meth:`close`).
    budget : int or str
        Host memory for the state, e.g. ``"1G"``: the chunks kept resident
        (all of them when the state fits, so no I/O at all after the first
        step) and the buffers the other chunks stream through. Measured in
        :meth:`stats` (``peak_memory_bytes``). It must hold the largest
        chunk's state whole: a smaller one raises :class:`BudgetError`
        (with the smallest budget that works) here, or at the first step
        after :meth:`add_param_group`.
    chunk_size : int or str, optional
        Parameter bytes per chunk (a chunk never mixes groups). Default:
        budget / 8 when the state fits the budget, else ``stream_room`` / 12
        (six chunks of Adam's state, two states per parameter).
    stream_room : int or str, optional
        When the state does not fit the budget: the part of the budget the
        chunks that are not kept resident stream through (reads ahead, the
        chunk being updated, writes behind); the rest keeps chunks resident.
        More room keeps more bytes in flight (the device's bandwidth wants
        tens of MiB), less keeps more chunks resident (each resident byte
        saves two of I/O per step). Default: a quarter of the budget, at
        least 64 MiB, at most the budget.
    threads : int, optional
        torch's intra-op threads for the math of a step that streams state
        (set on the calling thread for the step, restored after; the results
        do not depend on it: the optimizers' updates are elementwise).
        Default: one less than torch's setting (at least one), leaving a
        core to the I/O thread: an OpenMP team one of whose threads loses its
        core waits at every operation's barrier (``aionvme bench -w offload``'s
        step in memory, 4M parameters on 2 vCPUs with the other core busy:
        0.06 s on one thread, 0.81 s on two). 0: torch's setting as it is.
    backend : {"auto", "store", "file"}
        Where streamed state goes: the NVMe tier of an
        :class:`aionvme.TieredStore` (``"store"``, and ``"auto"``), or one
        preallocated O_DIRECT file (``"file"``). Either way reads and writes
        go straight between the device and the buffers the math updates.
    master_weights : bool
        Keep an fp32 master copy of every bf16/fp16 parameter in its state,
        next to ``exp_avg``/``exp_avg_sq`` (so on NVMe too), as
        mixed-precision trainers do: ``step()`` runs the optimizer on the
        fp32 master with the gradient cast to fp32, and writes the master
        rounded to the parameter's dtype into the parameter. The optimizer's
        state is then fp32 as well. fp32 parameters are not affected.
    **kwargs
        The wrapped optimizer's arguments (lr, weight_decay, amsgrad, ...).

    Notes
    -----
    ``step()`` goes over the chunks in order, updating each with torch's
    optimizer run on that chunk alone, its state swapped in as views of one
    page-aligned buffer. The state of the chunks ahead is read into free
    buffers as far as the budget allows while a chunk is updated, and the
    chunks behind are written back from the same buffers meanwhile (reads and
    writes run on aionvme's background event-loop thread, the math on the
    caller's): nothing is copied between the device and the math. Buffers are
    kept from step to step. Chunks kept resident are chosen once, in order,
    at the first step (for a cyclic pass, pinning beats any recency cache:
    an LRU cache smaller than the state would miss on every chunk).

    The budget is kept by waiting: a read ahead starts only when its buffer
    fits. A parameter of more than two chunks' bytes is split into pieces of
    about ``chunk_size`` (flat ranges of its elements, multiples of 1024),
    each a chunk of its own: torch's update is elementwise, so stepping the
    pieces gives the whole parameter's result bit for bit, and
    :meth:`state_dict` joins their state into the parameter's. A chunk whose
    state alone is larger than the budget (a non-contiguous parameter, which
    cannot be cut, or a budget too small to cut pieces of 1024 elements from)
    would have to be stepped over the budget: the constructor raises
    :class:`BudgetError` instead, from the state's layout measured by one
    step of the wrapped optimizer on a 2048-element parameter. State that
    grows past that layout later is stepped anyway, counted as an
    ``overdraft`` in ``stats()`` and warned about once (``RuntimeWarning``).
    The optimizer's own
    fresh state at a chunk's first step (made by torch, then packed) is
    transient memory outside the budget.
    ``param_groups`` are the wrapped optimizer's (LR schedulers work);
    ``state`` stays empty, since the state is not in memory: use
    :meth:`state_dict`, which reads it all and has the in-memory optimizer's
    layout (and :meth:`load_state_dict` takes one).

    With ``master_weights=True`` the result equals, bit for bit, the
    in-memory recipe: ``master = p.float()`` once, then at every step
    ``master.grad = p.grad.float()``, the optimizer's step on ``master``,
    ``p.copy_(master)``. :meth:`state_dict` gives each such parameter's
    master under the key ``"master"`` (fp32) and its other state in fp32;
    :meth:`load_state_dict` keeps fp32 values for them (torch's own loader
    would cast them to the parameter's dtype). A parameter whose state has no
    master gets one from its current value at its next step. The fp32
    gradient copies are transient memory outside the budget.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any],
        path: str | os.PathLike[str],
        *,
        budget: int | str = "1G",
        chunk_size: int | str | None = None,
        stream_room: int | str | None = None,
        threads: int | None = None,
        backend: str = "auto",
        master_weights: bool = False,
        **kwargs: Any,
    ) -> None:
        self._ready = False
        self.master_weights = bool(master_weights)
        self._inner = optimizer_class(params, **kwargs)
        super().__init__(self._inner.param_groups, self._inner.defaults)
        self.param_groups = self._inner.param_groups
        self._make = lambda groups: optimizer_class(groups, **kwargs)  # probes the state's layout
        self.budget = parse_size(budget)
        self._room = None if stream_room is None else parse_size(stream_room)
        if self._room is not None and self._room <= 0:
            raise ValueError(f"stream_room must be positive, got {stream_room!r}")
        self._chunk = None if chunk_size is None else parse_size(chunk_size)
        self.stream_room, self.chunk_size = self._sizes(self.budget)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
            raise ValueError(f"threads must be a non-negative int or None, got {threads!r}")
        self.threads = threads
        self._check_budget()
        self._warned = False  # about an overdraft (see _check_budget)
        self._loop = LoopThread("optimizer")
        self._store: BlobStore = open_blob_store(os.fspath(path), backend)
        self._chunks: list[Chunk] = []
        self._plan: list[int] | None = None  # residency sums: state (estimated), largest chunk, resident
        self._chunked_groups: list[list[tuple[int, int]]] = []
        # Counts the state bytes in memory (peak in stats()): resident chunks and the
        # pipeline's buffers. The pipeline keeps it within the budget by waiting.
        self.ledger = Ledger(1 << 62)
        self._lock = threading.Lock()
        self._pipe = Pipeline(self._store, self.ledger, self._lock, self.budget)
        self.io_wait_s = 0.0
        self.compute_s = 0.0
        self.steps = 0
        self.timeline: list[tuple[str, str, float, float]] = []
        self._closed = False
        self._ready = True

    # -- groups and chunks ---------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_ready", False):  # torch's __init__ registers the inner groups
            super().add_param_group(param_group)
            return
        self._inner.add_param_group(param_group)
        self.param_groups = self._inner.param_groups

    def _sizes(self, budget: int) -> tuple[int, int]:
        """The streaming room and the chunk size of a budget (see the class docstring)."""
        room = min(budget, self._room if self._room is not None else max(budget // 4, _ROOM))
        if self._chunk is not None:
            return room, self._chunk
        # Adam keeps two states per parameter; an fp32 master and fp32 state
        # for a bf16 parameter: ~6x its bytes.
        ps = [p for g in self.param_groups for p in g["params"]]
        ratio = 2 * (3 if any(self._is_low(p) for p in ps) else 1)
        if ratio * sum(p.numel() * p.element_size() for p in ps) <= budget:
            return room, max(1, budget // (4 * ratio))
        return room, max(1, room // (_DEPTH * ratio))

    def _check_budget(self) -> None:
        """BudgetError when the largest chunk's state does not fit the budget:
        a chunk is stepped whole in memory, so such a step would go over it.
        The state's layout is the wrapped optimizer's own, measured on a small
        parameter per group and dtype (see :func:`layout_of`)."""
        layouts: dict[tuple[int, torch.dtype, torch.device], Layout] = {}

        def state_bytes(gi: int, p: torch.Tensor) -> int:
            low = self._is_low(p)
            key = (gi, torch.float32 if low else p.dtype, p.device)
            if key not in layouts:
                layouts[key] = layout_of(self._make, self.param_groups[gi], *key[1:])
            n = layouts[key].nbytes(p.numel())
            return n + Layout((4,), 0).nbytes(p.numel()) if low else n  # the fp32 master

        need, smallest, which = smallest_budget(
            self.param_groups, self.chunk_size, lambda b: self._sizes(b)[1], state_bytes, self.budget
        )
        if need <= self.budget or which is None:
            return
        p = which.parent if which.parent is not None else which.params[0][1]
        what = f"a {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')} parameter"
        if which.parent is not None:
            what = f"a piece of {what}"
        elif len(which.params) > 1:
            what = f"{len(which.params)} parameters, the first {what}"
        elif not p.is_contiguous():
            what += " (not contiguous: it cannot be cut into pieces)"
        fixed = "" if self._chunk is None else " at this chunk_size; or a smaller chunk_size"
        raise BudgetError(
            f"budget={self.budget} bytes cannot hold the optimizer state of the largest chunk "
            f"({what}: {need} bytes, whole in memory while it is stepped); "
            f"the smallest budget that works for these parameters is {smallest} bytes "
            f"({size_text(smallest)!r}{fixed})"
        )

    def _rechunk(self) -> None:
        """Chunks of ~chunk_size parameter bytes per group (made again when the
        groups change; state already stored is moved to the new chunks)."""
        # sizes too: a resized parameter is cut into pieces again
        shape = [[(id(p), p.numel()) for p in g["params"]] for g in self.param_groups]
        if shape == self._chunked_groups:
            return
        self._check_budget()  # groups added since: before anything changes
        if self._chunks:
            self._gather_state()
        chunks = cut(self.param_groups, self.chunk_size)
        with self._lock:
            for c in self._chunks:
                if c.resident is not None:
                    self.ledger.release(id(c))
        self._loop.run(self._pipe.trim())  # buffers were sized for the old chunks
        self._chunks = chunks
        self._plan = None
        self._chunked_groups = shape
        if self._inner.state:
            self._scatter_state()

    # -- the step ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter with a gradient, chunk by chunk (see the class Notes)."""
        if self._closed:
            raise RuntimeError("this optimizer is closed")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._rechunk()
        piece_views(self._chunks, grads=True)
        try:
            return self._step(loss)
        finally:
            piece_views(self._chunks, grads=False)

    def _step(self, loss: float | None) -> float | None:
        todo = [c for c in self._chunks if any(p.grad is not None for _, p in c.params)]
        check_saved(todo)
        pipe = self._pipe
        jobs: dict[int, Job] = {}
        for i, c in enumerate(todo):
            if c.resident is None:
                key = c.key if c.stored else None
                jobs[i] = Job(i, key, c.nbytes, concurrent.futures.Future())
        writes: list[tuple[Chunk, concurrent.futures.Future[None]]] = []
        held: list[torch.Tensor] = []  # pipeline buffers this thread holds now
        taken: set[int] = set()
        t_origin = time.perf_counter()
        threads = torch.get_num_threads()
        want = self.threads if self.threads is not None else max(1, threads - 1)
        if jobs and want and want != threads:
            torch.set_num_threads(want)  # the calling thread's setting, restored below
        else:
            threads = 0
        try:
            self._loop.run(pipe.start(list(jobs.values())))
            for i, c in enumerate(todo):
                job = jobs.get(i)
                blob = c.resident
                if job is not None and job.key is not None:
                    t0 = time.perf_counter()
                    buf = job.done.result()
                    taken.add(i)
                    held.append(buf)
                    blob = buf[: c.nbytes]
                    self.io_wait_s += time.perf_counter() - t0
                    self._mark(c.key, "read-wait", t0, t_origin)
                t0 = time.perf_counter()
                self._install(c, blob)
                try:
                    stepped = self._to_masters(c)
                    try:
                        self._run_inner(c, stepped)
                    finally:
                        self._from_masters(c, stepped)
                    blob = self._pack(c, blob, held)
                except BaseException:
                    for _, p in c.params:  # no views of a buffer the pipeline takes back
                        self._inner.state.pop(p, None)
                    raise
                self.compute_s += time.perf_counter() - t0
                self._mark(c.key, "update", t0, t_origin)
                if job is not None and job.key is None:
                    self._loop.loop.call_soon_threadsafe(pipe.advance, i)
                if c.resident is not None:
                    continue  # updated in place (a new layout gives up residency in _pack)
                buf = held.pop()
                if self._may_keep(c):
                    self._loop.run(pipe.keep(buf, id(c)))
                    self._kept(c, blob, buf.numel())
                    continue
                writes.append((c, self._loop.submit(pipe.write(c.key, buf, c.nbytes))))
                c.stored = True
        finally:
            # An error leaves nothing in flight: reads and writes are awaited,
            # and the buffers go back to the pipeline. A chunk whose write
            # failed is marked lost, whatever else went wrong.
            try:
                self._loop.run(pipe.finish(held, taken))
            finally:
                if threads:
                    torch.set_num_threads(threads)
                failed = settle(writes)
        if failed is not None:
            raise failed
        self.steps += 1
        if self._pipe.overdrafts and not self._warned:
            self._warned = True
            warnings.warn(
                f"aionvme.offload.Optimizer went over its budget ({self.budget} bytes): "
                f"{self.ledger.peak} bytes at peak, {self._pipe.overdrafts} overdraft(s); the state grew "
                "past what the budget was checked for at the start: raise the budget",
                RuntimeWarning,
                stacklevel=3,
            )
        return loss

    def _may_keep(self, c: Chunk) -> bool:
        """Keep a chunk's state in memory (pinned) when all the state fits the
        budget, or when what stays leaves the streaming room (chunks not yet
        stepped are estimated from the state/parameter ratio seen so far).
        The sums are made once and kept until a chunk's size changes: this
        runs for every streamed chunk at every step."""
        if self._plan is None:
            known = [x for x in self._chunks if x.spec]
            ratio = max((x.nbytes / max(1, param_bytes(x)) for x in known), default=2.0)
            sizes = [x.nbytes if x.spec else pages(int(ratio * param_bytes(x))) for x in self._chunks]
            with self._lock:
                kept = sum(self.ledger.held.get(id(x), 0) for x in self._chunks)
            self._plan = [sum(sizes), max(sizes, default=0), kept]
        total, largest, kept = self._plan
        if total <= self.budget:
            return True
        return kept + c.nbytes + max(3 * largest, self.stream_room) <= self.budget

    def _kept(self, c: Chunk, blob: torch.Tensor, nbytes: int) -> None:
        """``blob`` (``nbytes`` in the ledger) is the chunk's resident state from now on."""
        c.resident = blob
        c.stored = False
        c.lost = None
        if self._plan is not None:
            self._plan[2] += nbytes

    def _install(self, c: Chunk, blob: torch.Tensor | None) -> None:
        """Put the chunk's state into the wrapped optimizer as views of ``blob``."""
        state = self._inner.state
        for i, (_, p) in enumerate(c.params):
            st: dict[str, Any] = dict(c.extra.get(i, {}))
            state[p] = st
        if blob is None:
            return
        for i, k, dtype, shape, pos in c.spec:
            state[c.params[i][1]][k] = view(blob, dtype, shape, pos)
        for _, p in c.params:
            if not state[p]:
                del state[p]

    def _is_low(self, p: torch.Tensor) -> bool:
        return self.master_weights and p.dtype in LOW

    def _to_masters(self, c: Chunk) -> list[torch.Tensor]:
        """The tensors the wrapped optimizer steps for this chunk: each
        parameter, or its fp32 master (a view of the blob, or made from the
        parameter) with the gradient cast to fp32; its state moves to the master."""
        state = self._inner.state
        out = []
        for _, p in c.params:
            if not self._is_low(p):
                out.append(p)
                continue
            st = state.pop(p, {})
            m = st.pop(MASTER, None)
            if m is None:
                m = p.detach().float()
            m.grad = None if p.grad is None else p.grad.detach().float()
            if st:
                state[m] = st
            out.append(m)
        return out

    def _from_masters(self, c: Chunk, stepped: list[torch.Tensor]) -> None:
        """Round each updated master into its parameter and give the state
        (the master included) back to the parameter's key."""
        state = self._inner.state
        for (_, p), m in zip(c.params, stepped, strict=True):
            if m is p:
                continue
            m.grad = None
            p.copy_(m)
            st = state.pop(m, {})
            st[MASTER] = m
            state[p] = st

    def _run_inner(self, c: Chunk, tensors: list[torch.Tensor] | None = None) -> None:
        """torch's step on this chunk's parameters (or ``tensors`` in their
        place, one each) alone."""
        groups = self._inner.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = []
            for (gi, _p), t in zip(c.params, tensors or [q for _, q in c.params], strict=True):
                groups[gi]["params"].append(t)
            self._inner.step()
        finally:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = ps

    def _pack(self, c: Chunk, blob: torch.Tensor | None, held: list[torch.Tensor] | None) -> torch.Tensor:
        """Take the chunk's state out of the wrapped optimizer into its blob:
        ``blob`` untouched when the state was updated in place (the usual
        case), else a new blob (the chunk's first step, or a layout that
        changed) from the pipeline's buffers (``held``: the buffers this
        thread holds, ``blob``'s last, exchanged for the new one) or, with
        ``held`` None, fresh memory."""
        state = self._inner.state
        states = [state.pop(p, {}) for _, p in c.params]
        spec, pos = spec_of(states)
        c.extra = {
            i: {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
            for i, st in enumerate(states)
            if any(not isinstance(v, torch.Tensor) for v in st.values())
        }
        if blob is not None and spec == c.spec:
            for i, k, dtype, shape, at in spec:
                v = states[i][k]
                dst = view(blob, dtype, shape, at)
                if v.data_ptr() != dst.data_ptr() or v.stride() != dst.stride():
                    dst.copy_(v)  # replaced (not updated in place) by the optimizer
            return blob
        nbytes = pages(pos)
        old = None
        if held is None:
            new: torch.Tensor = empty(nbytes, "uint8", like="torch")
        else:
            if blob is not None and c.resident is None:
                old = held.pop()  # the buffer ``blob`` views
            new = self._loop.run(self._pipe.acquire(nbytes, step=True))
            held.append(new)
        for i, k, dtype, shape, at in spec:
            view(new, dtype, shape, at).copy_(states[i][k])
        if old is not None:
            self._loop.loop.call_soon_threadsafe(self._pipe.release, old)
        if c.resident is not None:
            with self._lock:
                self.ledger.release(id(c))
            c.resident = None
        c.spec, c.nbytes, c.stored = spec, nbytes, False
        self._plan = None  # sizes changed: the residency sums are made again
        return new[:nbytes]

    # -- reading it all ------------------------------------------------------------

    def _gather_state(self) -> None:
        """Every chunk's state into the wrapped optimizer's ``state`` (read whole)."""
        check_saved(self._chunks)
        futs = {
            i: self._loop.submit(self._store.read(c.key, c.nbytes))
            for i, c in enumerate(self._chunks)
            if c.stored and c.resident is None
        }
        for i, c in enumerate(self._chunks):
            blob = futs[i].result() if i in futs else c.resident
            if blob is not None and c.resident is not None:
                blob = blob.clone()  # the caller's copy must not change with later steps
            if blob is not None or c.extra:
                self._install(c, blob)
        join_pieces(self._inner.state, self._chunks)

    def _scatter_state(self) -> None:
        """The wrapped optimizer's ``state`` out to the chunks (resident or written)."""
        split_pieces(self._inner.state, self._chunks)
        futs: list[tuple[Chunk, concurrent.futures.Future[None]]] = []
        for c in self._chunks:
            if not any(p in self._inner.state for _, p in c.params):
                continue
            c.spec = ()
            blob = self._pack(c, None, None)  # gives back the chunk's resident blob, if any
            if self._may_keep(c):
                with self._lock:
                    self.ledger.reserve(id(c), blob.numel())
                self._kept(c, blob, blob.numel())
            else:
                futs.append((c, self._loop.submit(self._store.write(c.key, blob))))
                c.stored = True
        failed = settle(futs)
        self._inner.state.clear()
        if failed is not None:
            raise failed

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``, with all state read back:
        the same layout as the optimizer run in memory."""
        self._rechunk()
        try:
            self._gather_state()
            return self._inner.state_dict()
        finally:
            self._inner.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` (ours or the in-memory optimizer's) and
        write its state out to the chunks."""
        self._rechunk()
        self._plan = None
        for c in self._chunks:
            if c.resident is not None:
                with self._lock:
                    self.ledger.release(id(c))
            c.resident, c.stored, c.spec, c.nbytes, c.extra, c.lost = None, False, (), 0, {}, None
        self._inner.load_state_dict(state_dict)
        self.param_groups = self._inner.param_groups
        if self.master_weights:
            self._keep_fp32(state_dict)
        self._chunked_groups = []  # the group dicts are new objects
        self._rechunk()
        self._scatter_state()

    def _keep_fp32(self, state_dict: dict[str, Any]) -> None:
        """Put back the fp32 state (and masters) of low-precision parameters,
        which torch's loader cast to the parameter's dtype. Saved ids map to
        parameters in order, as torch's loader maps them."""
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self._inner.param_groups for p in g["params"]]
        for i, p in zip(saved, params, strict=True):
            st = state_dict["state"].get(i)
            if st is None or not self._is_low(p) or p not in self._inner.state:
                continue
            for k, v in st.items():
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                    self._inner.state[p][k] = v.detach().to(device=p.device)

    # -- reporting and closing -----------------------------------------------------

    def _mark(self, name: str, kind: str, t0: float, origin: float) -> None:
        if len(self.timeline) < 100_000:
            self.timeline.append((name, kind, t0 - origin, time.perf_counter() - origin))

    def stats(self) -> dict[str, Any]:
        """Bytes read from and written to NVMe, seconds waiting for I/O and
        computing, state bytes held in memory now and at peak (resident chunks
        and the pipeline's buffers), chunks resident."""
        return {
            "steps": self.steps,
            "chunks": len(self._chunks),
            "resident_chunks": sum(c.resident is not None for c in self._chunks),
            "state_bytes": sum(c.nbytes for c in self._chunks),
            "bytes_read": self._store.bytes_read,
            "bytes_written": self._store.bytes_written,
            "io_wait_s": self.io_wait_s,
            "compute_s": self.compute_s,
            "memory_bytes": self.ledger.used,  # chunks resident, and the pipeline's buffers
            "peak_memory_bytes": self.ledger.peak,
            "budget": self.budget,
            "overdrafts": self._pipe.overdrafts,  # buffers allocated past the budget (see the Notes)
            "buffer_allocations": self._pipe.allocations,  # pipeline buffers allocated (kept for reuse)
            "buffers_in_use": self._pipe.busy,  # being read, updated or written: 0 between steps
            "max_reads_in_flight": self._pipe.max_reads,  # chunks read ahead at once, at most
        }

    def close(self) -> None:
        """Drop the state and remove its file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._pipe.close())
            self._loop.run(self._store.close())
        finally:
            self._loop.close()
            for c in self._chunks:
                c.resident = None

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"aionvme.offload.Optimizer({self._inner!r}, budget={self.budget})"
