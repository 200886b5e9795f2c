"""Handles: one set of I/O knobs applied to every transfer made through it,
from async code (``await h.pread(...)``) and from blocking code
(``h.sync_pread(...)``, no event loop needed).

The knobs are DeepNVMe's (block size, queue depth, single submit, overlap
events, intra-op parallelism) plus O_DIRECT and the backend; a DeepSpeed ZeRO
``"aio"`` section or a config written by ``aionvme tune`` makes a handle
directly (:meth:`Handle.from_config`).

Engines: the per-request knobs (block size, intra-op parallelism, submit
modes, O_DIRECT) need no engine of their own. A handle whose queue depth and
backend match the loop's shared engine uses it, so its transfers are batched
with everything else on that loop (and with the thread's engine for blocking
calls). Otherwise the handle owns engines shaped by its knobs: one per event
loop it is used on and a small pool for blocking calls (one per thread
calling at the same time), made on first use and closed by :meth:`close`.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from . import defaults
from ._runtime import transfer
from ._runtime.engines import HandleEngines
from ._runtime.transfer import FDATASYNC, FSYNC, READ, READROWS, READV, WRITE, WRITEROWS, WRITEV
from .exceptions import BlockingCallError, SettingTypeError
from .file import File, PathLike

__all__ = ["FileLike", "Handle"]

FileLike = File | PathLike | int

# the transfer op -> its name, for the error of a blocking call on a loop thread
_SYNC_NAMES = {
    READ: "pread",
    WRITE: "pwrite",
    READV: "pread_many",
    WRITEV: "pwrite_many",
    READROWS: "pread_rows",
    WRITEROWS: "pwrite_rows",
    FSYNC: "fsync",
    FDATASYNC: "fsync",
}

# Handle's keyword names (public; Settings fields inside: see defaults.ALIASES).
_KNOBS = frozenset(
    {
        "block_size",
        "queue_depth",
        "single_submit",
        "overlap_events",
        "intra_op_parallelism",
        "direct",
        "backend",
    }
)
# What from_config takes from a config: the knobs, and two that shape engines.
_FROM_CONFIG = frozenset(
    {"block_size", "queue_depth", "single_submit", "overlap_events", "max_inflight", "direct", "engine"}
    | {"threads", "ring_reap"}
)


class Handle:
    """Transfers with a fixed set of knobs, async or blocking.

    Parameters
    ----------
    block_size : int or str, optional
        Bytes per chunk a transfer is split into (``"1M"``, ``4 << 20``); a
        multiple of 4096. Default: ``defaults.block_size`` (1 MiB).
    queue_depth : int, optional
        Chunks in flight in the engine serving this handle, all requests
        together. Default: ``defaults.queue_depth`` (128).
    single_submit : bool, optional
        Submit each chunk with its own ``io_submit`` call instead of one call
        per batch (DeepNVMe's ``single_submit``). Default False: a batch goes
        in calls of 4, 8, 16, ... chunks (``defaults.submit_ramp``; 0 there
        for exactly one call per batch).
    overlap_events : bool, optional
        True: a sliding window, a new chunk is submitted as soon as one
        completes. False: batch-and-wait, a window of ``intra_op_parallelism``
        chunks is submitted and all of them are reaped before the next window.
        Default True.
    intra_op_parallelism : int, optional
        Chunks of one request in flight at once; 0 means up to
        ``queue_depth``. Default: ``defaults.max_inflight`` (0).
    direct : bool, optional
        Open paths with O_DIRECT (filesystems that refuse it are served
        buffered). Default: ``defaults.direct`` (True).
    backend : {'auto', 'aio', 'thread'}, optional
        Kernel AIO where available (``auto``), kernel AIO or an error
        (``aio``), or the worker-thread pool only (``thread``). Default:
        ``defaults.engine``.

    Notes
    -----
    ``file`` arguments are paths (opened for the call with this handle's
    ``direct`` and closed after it), :class:`~aionvme.File` objects (opened
    once, as they were opened) or fds (used as they are; the caller keeps
    ownership). Any buffer size, file offset and buffer address works: see
    :func:`aionvme.pread` for alignment, errors and cancellation.

    Defaults are read when the handle is made: ``with defaults.set(...)``
    around the constructor shapes it. Knobs are checked like
    :func:`aionvme.defaults.set` checks them (:class:`~aionvme.InvalidSettingError`,
    :class:`~aionvme.SettingTypeError` for a wrong type), from the constructor.

    The async methods follow :func:`aionvme.pread`: each returns a future
    that is also a coroutine (``await``, ``gather``, ``create_task``,
    ``TaskGroup``, anyio...), and every error, a closed handle's
    EngineClosedError included, arrives at the await. The ``sync_*`` twins
    raise from the call.
    """

    def __init__(
        self,
        block_size: int | str | None = None,
        queue_depth: int | None = None,
        single_submit: bool | None = None,
        overlap_events: bool | None = None,
        intra_op_parallelism: int | None = None,
        direct: bool | None = None,
        backend: str | None = None,
    ) -> None:
        given = {
            "block_size": block_size,
            "queue_depth": queue_depth,
            "single_submit": single_submit,
            "overlap_events": overlap_events,
            "intra_op_parallelism": intra_op_parallelism,
            "direct": direct,
            "backend": backend,
        }
        base = defaults.settings
        s = replace(base, **defaults.Settings.coerce(**{k: v for k, v in given.items() if v is not None}))
        self._setup(s, base)

    def _setup(self, s: defaults.Settings, base: defaults.Settings) -> None:
        """Shape the handle by s; base: the defaults the loops' shared engines have."""
        self._settings = s
        self._mode = transfer.mode_bits(s.single_submit, s.overlap_events)
        # The loop's shared engine can serve us only if it has our shape.
        may_share = (s.queue_depth, s.threads, s.engine, s.ring_reap, s.submit_ramp, s.refill_thread) == (
            base.queue_depth,
            base.threads,
            base.engine,
            base.ring_reap,
            base.submit_ramp,
            base.refill_thread,
        )
        self._engines = HandleEngines(s, may_share)

    # -- construction from configs -------------------------------------------------

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any) -> Handle:
        """A handle from a config dict or JSON file, as :func:`aionvme.defaults.read_config`
        reads it: the file ``aionvme tune`` writes, a DeepSpeed config or its
        ``"aio"`` section as-is. Keyword arguments (this class's knob
        names) override the config. The handle is built from its own
        settings: the process-wide defaults are never changed, not even for a
        moment (``threads`` and ``ring_reap`` of the config shape only this
        handle's engines)."""
        values = defaults.read_config(config)
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(given) - _KNOBS)
        if unknown:
            raise SettingTypeError(f"unknown Handle knobs {unknown}; known: {sorted(_KNOBS)}", value=unknown)
        base = defaults.settings
        # threads and ring_reap shape this handle's engines: applied to its own
        # Settings, never to the process-wide defaults (another thread would see them).
        s = replace(base, **{k: v for k, v in values.items() if k in _FROM_CONFIG})
        s = replace(s, **defaults.Settings.coerce(**given))
        h = cls.__new__(cls)
        h._setup(s, base)
        return h

    def config(self) -> dict[str, Any]:
        """This handle's knobs, as a dict that :meth:`from_config` reads back."""
        s = self._settings
        return {
            "block_size": s.block_size,
            "queue_depth": s.queue_depth,
            "intra_op_parallelism": s.max_inflight,
            "single_submit": s.single_submit,
            "overlap_events": s.overlap_events,
            "direct": s.direct,
            "backend": s.engine,
        }

    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed ZeRO ``"aio"`` section with the same chunks in flight per
        request (DeepSpeed serves one request at a time per handle), with
        exactly the keys DeepSpeed reads."""
        s = self._settings
        per_request = s.queue_depth if s.max_inflight == 0 else min(s.max_inflight, s.queue_depth)
        return {
            "block_size": s.block_size,
            "queue_depth": per_request,
            "intra_op_parallelism": 1,
            "single_submit": s.single_submit,
            "overlap_events": s.overlap_events,
            "use_gds": False,
        }

    # -- knobs -------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._settings.block_size

    @property
    def queue_depth(self) -> int:
        return self._settings.queue_depth

    @property
    def single_submit(self) -> bool:
        return self._settings.single_submit

    @property
    def overlap_events(self) -> bool:
        return self._settings.overlap_events

    @property
    def intra_op_parallelism(self) -> int:
        return self._settings.max_inflight

    @property
    def direct(self) -> bool:
        return self._settings.direct

    @property
    def backend(self) -> str:
        return self._settings.engine

    @property
    def mode(self) -> int:
        """The engine mode bits (MODE_SINGLE_SUBMIT, MODE_NO_OVERLAP) of the knobs."""
        return self._mode

    @property
    def closed(self) -> bool:
        return self._engines.closed

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"<aionvme.Handle {knobs}{' closed' if self.closed else ''}>"

    # -- the dispatch -------------------------------------------------------------------

    def _params(self) -> transfer.Params:
        s = self._settings
        return (s.block_size, s.max_inflight, self._mode)

    def _submit(self, op: int, file: FileLike, data: Any = None, offset: int = 0) -> Awaitable[int]:
        r = self._engines.reactor
        return transfer.submit(r, op, file, data, offset, self._params(), self._settings.direct)

    def _run(self, op: int, file: FileLike, data: Any = None, offset: int = 0) -> int:
        if asyncio._get_running_loop() is not None and not getattr(file, "_loop_ok", False):
            # a blocking call would stall this thread's loop: refused, as sync_load refuses
            name = _SYNC_NAMES[op]
            raise BlockingCallError(f"Handle.sync_{name}", f"Handle.{name}")
        eng, pooled = self._engines.take()
        try:
            return transfer.run(eng, op, file, data, offset, self._params(), self._settings.direct)
        finally:
            if pooled:
                self._engines.give_back(eng)

    # -- async I/O ---------------------------------------------------------------------

    def pread(self, buf: Any, file: FileLike, offset: int = 0) -> Awaitable[int]:
        """Fill all of buf from file at offset; the awaitable gives the byte count.

        Raises ShortReadError if the file ends first, OSError subclasses for I/O
        errors. Cancelling waits for the chunks in flight (see :func:`aionvme.pread`).
        """
        return self._submit(READ, file, buf, offset)

    def pwrite(self, buf: Any, file: FileLike, offset: int = 0) -> Awaitable[int]:
        """Write all of buf to file at offset (a path is created if needed; never truncated)."""
        return self._submit(WRITE, file, buf, offset)

    def pread_many(self, items: Iterable[tuple[Any, int]], file: FileLike) -> Awaitable[int]:
        """Fill each (buffer, offset) pair from file; one awaitable for the batch."""
        return self._submit(READV, file, items)

    def pread_rows(self, buf: Any, offsets: Any, file: FileLike) -> Awaitable[int]:
        """Fill row i of buf from offsets[i] of file (see :meth:`aionvme.File.pread_rows`)."""
        return self._submit(READROWS, file, (buf, offsets))

    def pwrite_many(self, items: Iterable[tuple[Any, int]], file: FileLike) -> Awaitable[int]:
        """Write each (buffer, offset) pair to file; one awaitable for the batch."""
        return self._submit(WRITEV, file, items)

    def pwrite_rows(self, buf: Any, offsets: Any, file: FileLike) -> Awaitable[int]:
        """Write row i of buf at offsets[i] of file (see :meth:`aionvme.File.pwrite_rows`)."""
        return self._submit(WRITEROWS, file, (buf, offsets))

    def fsync(self, file: FileLike, *, datasync: bool = False) -> Awaitable[int]:
        """fsync (or fdatasync) file on a worker thread."""
        return self._submit(FDATASYNC if datasync else FSYNC, file)

    # -- blocking I/O (no event loop needed; waits with the GIL released) --------------

    def sync_pread(self, buf: Any, file: FileLike, offset: int = 0) -> int:
        """Blocking :meth:`pread`: returns the byte count or raises. Usable from any
        thread, with or without an event loop running elsewhere."""
        return self._run(READ, file, buf, offset)

    def sync_pwrite(self, buf: Any, file: FileLike, offset: int = 0) -> int:
        """Blocking :meth:`pwrite`."""
        return self._run(WRITE, file, buf, offset)

    def sync_pread_many(self, items: Iterable[tuple[Any, int]], file: FileLike) -> int:
        """Blocking :meth:`pread_many`."""
        return self._run(READV, file, items)

    def sync_pread_rows(self, buf: Any, offsets: Any, file: FileLike) -> int:
        """Blocking :meth:`pread_rows`."""
        return self._run(READROWS, file, (buf, offsets))

    def sync_pwrite_rows(self, buf: Any, offsets: Any, file: FileLike) -> int:
        """Blocking :meth:`pwrite_rows`."""
        return self._run(WRITEROWS, file, (buf, offsets))

    def sync_pwrite_many(self, items: Iterable[tuple[Any, int]], file: FileLike) -> int:
        """Blocking :meth:`pwrite_many`."""
        return self._run(WRITEV, file, items)

    def sync_fsync(self, file: FileLike, *, datasync: bool = False) -> None:
        """Blocking :meth:`fsync`."""
        self._run(FDATASYNC if datasync else FSYNC, file)

    def open(self, path: PathLike, mode: str = "r") -> File:
        """:func:`aionvme.open` with this handle's ``direct``, block size and
        intra-op parallelism (pass the File to this handle's calls for its
        submit modes too)."""
        s = self._settings
        return File(path, mode, direct=s.direct, block_size=s.block_size, parallelism=s.max_inflight)

    # -- inspection --------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters of the engine serving this handle here: the running loop's,
        or, outside a loop, the engines of blocking calls added up. Includes
        ``queue_depth`` and ``use_aio`` (False: the worker-thread pool serves)."""
        engines = self._engines.serving_here()
        out: dict[str, Any] = {"engines": len(engines), "queue_depth": self._settings.queue_depth}
        for i, eng in enumerate(engines):
            for k, v in eng.stats().items():
                if isinstance(v, bool):
                    out[k] = v if i == 0 else out[k] and v
                elif isinstance(v, int):
                    out[k] = out.get(k, 0) + v
        return out

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the engines this handle owns (shared ones stay): transfers in
        flight are waited for, queued ones fail with EngineClosedError. A loop
        running in another thread closes its engine on its own thread."""
        self._engines.close()

    async def aclose(self) -> None:
        """Close (see :meth:`close`) from async code."""
        self.close()
        await asyncio.sleep(0)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Handle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        engines = getattr(self, "_engines", None)
        if engines is not None and engines.owns_some():
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)
            self.close()
