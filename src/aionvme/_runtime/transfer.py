"""The one dispatch: every transfer of File, Handle, the path functions, the
formats and the DeepSpeed handle goes through :func:`dispatch`, host buffers
to the engine as one request, CUDA tensors to cuFile or the bounce pipeline,
driven by a :class:`Driver`: the loop's reactor (:func:`submit`) or the
calling thread (:func:`run`). The one other entrance is File.pread/pwrite's
common case, in C (a read or write of a host buffer through the File's
Route, cython_ext/aionvme/glue/hub.pxi), whose long way is this dispatch.

The asyncio contract lives here: :func:`submit` returns a future-like
coroutine (a ``Transfer``, see cython_ext/aionvme/glue/transfer.pxi; errors
found before anything was queued come as a failed future that is also a
coroutine, see :class:`~aionvme._runtime.reactor.AsCoroutine`), and never
raises for anything found while setting the transfer up (open failures, a
closed File, a bad buffer or offset, a bad knob): the error is set on the
future and arrives at the await. Called with no event loop running, it
returns a coroutine that starts the transfer once a loop runs it.
"""

from __future__ import annotations

import asyncio
import collections.abc
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .. import defaults
from .._engine import (
    MODE_NO_OVERLAP,
    MODE_SINGLE_SUBMIT,
    Engine,
    FileHandle,
    Request,
    bind_routes,
    gds_refuse_file,
    settings_changed,
)
from ..exceptions import CuFileError, NonContiguousBufferError, ShortReadError, UnsupportedOperation
from . import bounce, cufile, scatter
from .blocking import run as drive_request
from .cuda import Params, any_cuda, helper, is_cuda, require_cuda
from .opening import FileBase, handle_for
from .reactor import REACTOR_ATTR, AsCoroutine, Reactor, failed, get_reactor

__all__ = [
    "BLOCKING",
    "FDATASYNC",
    "FSYNC",
    "ON_LOOP",
    "READ",
    "READROWS",
    "READV",
    "WRITE",
    "WRITEROWS",
    "WRITEV",
    "Driver",
    "Params",
    "dispatch",
    "params",
    "run",
    "run_device",
    "submit",
    "submit_device",
    "submit_file",
    "transfer_device",
]

# What a request does (one name per operation, used by every caller).
READ, WRITE, READV, WRITEV, FSYNC, FDATASYNC, READROWS, WRITEROWS = range(8)
_WRITES = (WRITE, WRITEV, WRITEROWS)
Items = list[tuple[Any, int]]  # (buffer, offset) pairs of a transfer with CUDA tensors

_params_cache: tuple[object, Params] = (None, (0, 0, 0))


def mode_bits(single_submit: bool, overlap_events: bool) -> int:
    """The engine mode bits of the two submit knobs."""
    return (MODE_SINGLE_SUBMIT if single_submit else 0) | (0 if overlap_events else MODE_NO_OVERLAP)


def params(block_size: int | str | None = None, parallelism: int | None = None) -> Params:
    """(chunk size, chunks in flight per request, engine mode bits) of a call,
    its knobs checked by :func:`aionvme.defaults.validate` and the rest from
    the current defaults."""
    global _params_cache
    s = defaults.settings
    if block_size is None and parallelism is None:
        cached_for, p = _params_cache
        if cached_for is s:  # defaults.set() replaces the object: identity is enough
            return p
    block, par = defaults.check_call(block_size, parallelism)
    p = (
        block if block is not None else s.block_size,
        par if par is not None else s.max_inflight,
        mode_bits(s.single_submit, s.overlap_events),
    )
    if block_size is None and parallelism is None:
        _params_cache = (s, p)
    return p


def make(eng: Engine, op: int, fh: FileHandle, data: Any, offset: int, p: Params) -> Request:
    """Queue one request of op on eng."""
    if op == READ:
        return eng.read(fh, data, offset, *p)
    if op == WRITE:
        if fh.direct:
            p = scatter.params_for_one(fh.fd, data, p)
        return eng.write(fh, data, offset, *p)
    if op == READV:
        return eng.readv(fh, data, *p)
    if op == READROWS:
        return eng.readrows(fh, data[0], data[1], *p)
    if op == WRITEROWS:
        if fh.direct:
            p = scatter.params_for_one(fh.fd, data[0], p)
        return eng.writerows(fh, data[0], data[1], *p)
    if op == WRITEV:
        if fh.direct:
            p = scatter.params_for(fh.fd, True, data, p)
        return eng.writev(fh, data, *p)
    return eng.fsync(fh, op == FDATASYNC)


def _cuda_items(op: int, data: Any, offset: int) -> list[tuple[Any, int]] | None:
    """The (buffer, offset) items of a transfer holding CUDA tensors, else None."""
    if op in (READ, WRITE):
        return [(data, offset)] if is_cuda(data) else None
    if op in (READV, WRITEV):
        return data if any_cuda(data) else None
    if op in (READROWS, WRITEROWS) and is_cuda(data[0]):
        return _row_items(*data)
    return None


def _row_items(buf: Any, offsets: Any) -> list[tuple[Any, int]]:
    """A CUDA tensor's rows as (view, offset) items: its bytes split into
    len(offsets) equal rows, as the engine splits a host buffer."""
    if not buf.is_contiguous():
        raise NonContiguousBufferError("tensor is not contiguous; pass tensor.contiguous()")
    offs = [int(o) for o in offsets]
    flat = buf.view(-1)
    if not offs:
        if flat.numel():
            raise ValueError(f"no offsets for a buffer of {flat.numel() * flat.element_size()} bytes")
        return []
    if flat.numel() % len(offs):
        nbytes = flat.numel() * flat.element_size()
        raise ValueError(f"a buffer of {nbytes} bytes does not split into {len(offs)} rows of equal size")
    r = flat.numel() // len(offs)
    return [(flat[i * r : (i + 1) * r], o) for i, o in enumerate(offs)]


def _named(exc: Exception, fh: FileHandle | None) -> Exception:
    """exc with the file named where the engine could not (UnsupportedOperation)."""
    if fh is not None and isinstance(exc, UnsupportedOperation) and exc.filename is None:
        exc.filename = fh.path
    return exc


# -- the one dispatch -------------------------------------------------------------------------


class Driver:
    """What drives a dispatched transfer: the loop's reactor (:data:`ON_LOOP`,
    an awaitable back, errors at the await) or this thread (:data:`BLOCKING`,
    the byte count back, errors raised). ``ctx`` is the reactor or the engine."""

    __slots__ = ()

    def engine(self, ctx: Any) -> Engine:
        raise NotImplementedError

    def start(self, ctx: Any, req: Request) -> Any:
        raise NotImplementedError

    def device(self, ctx: Any, fh: FileHandle, temporary: bool, write: bool, items: Items, p: Params) -> Any:
        raise NotImplementedError

    def fail(self, ctx: Any, exc: Exception) -> Any:
        raise NotImplementedError


class _OnLoop(Driver):
    __slots__ = ()

    def engine(self, ctx: Reactor) -> Engine:
        return ctx.engine

    def start(self, ctx: Reactor, req: Request) -> Awaitable[int]:
        return ctx.submit(req)

    def device(
        self, ctx: Reactor, fh: FileHandle, temporary: bool, write: bool, items: Items, p: Params
    ) -> Awaitable[int]:
        return submit_device(ctx, fh, temporary, write, items, p)

    def fail(self, ctx: Reactor, exc: Exception) -> Awaitable[int]:
        return failed(exc, ctx.loop)


class _Blocking(Driver):
    __slots__ = ()

    def engine(self, ctx: Engine) -> Engine:
        return ctx

    def start(self, ctx: Engine, req: Request) -> int:
        return drive_request(req, ctx)

    def device(
        self, ctx: Engine, fh: FileHandle, temporary: bool, write: bool, items: Items, p: Params
    ) -> int:
        return run_device(ctx, fh, temporary, write, items, p)

    def fail(self, ctx: Engine, exc: Exception) -> int:
        raise exc


ON_LOOP: Driver = _OnLoop()
BLOCKING: Driver = _Blocking()


def dispatch(
    driver: Driver,
    ctx: Any,
    op: int,
    file: Any,
    data: Any = None,
    offset: int = 0,
    p: Params | None = None,
    direct: bool | None = None,
) -> Any:
    """The one dispatch: op on file (a path, opened with ``direct`` for this
    request and closed after it; an aionvme File; an engine handle; an fd),
    host buffers as one engine request, CUDA tensors to cuFile or the bounce
    pipeline, driven by ``driver`` on ``ctx``. ``p``: :func:`params` (None:
    the defaults). Every error of the setup goes through ``driver.fail``."""
    fh: FileHandle | None = None
    temporary = False
    try:
        if p is None:
            p = params()
        fh, temporary = handle_for(file, op in _WRITES, direct)
        if op <= WRITE:  # one buffer, the common case
            items = [(data, offset)] if is_cuda(data) else None
        else:
            if op in (READV, WRITEV):
                data = list(data)
            items = _cuda_items(op, data, offset)
        if items is not None:
            temporary, t = False, temporary  # the device transfer closes it
            return driver.device(ctx, fh, t, op in _WRITES, items, p)
        req = make(driver.engine(ctx), op, fh, data, offset, p)
    except Exception as e:
        return driver.fail(ctx, _named(e, fh))
    finally:
        if temporary and fh is not None:
            fh.close()  # deferred by the engine until the request has finished
    return driver.start(ctx, req)


def submit(
    reactor_of: Callable[[], Reactor],
    op: int,
    file: Any,
    data: Any = None,
    offset: int = 0,
    p: Params | None = None,
    direct: bool | None = None,
) -> Awaitable[int]:
    """:func:`dispatch` on the reactor ``reactor_of()`` gives, starting now;
    the awaitable gives the byte count or raises. Called outside an event
    loop (``asyncio.run(nvme.pread(...))``): a coroutine that starts the
    transfer once a loop runs it."""
    try:
        r = reactor_of()
    except Exception as e:
        if isinstance(e, RuntimeError) and asyncio._get_running_loop() is None:
            return _when_awaited(reactor_of, op, file, data, offset, p, direct)
        return failed(e)
    aw: Awaitable[int] = dispatch(ON_LOOP, r, op, file, data, offset, p, direct)
    return aw


def submit_file(op: int, file: FileBase, data: Any, offset: int, p: Params | None) -> Awaitable[int]:
    """File.pread/pwrite's long way (no running loop or reactor yet, a closed
    File, a CUDA tensor, a bad buffer: their common case is in C, through the
    File's Route); errors arrive at the await."""
    return submit(get_reactor, op, file, data, offset, p)


async def _when_awaited(reactor_of: Callable[[], Reactor], *args: Any) -> int:
    n: int = await submit(reactor_of, *args)
    return n


def run(
    eng: Engine,
    op: int,
    file: Any,
    data: Any = None,
    offset: int = 0,
    p: Params | None = None,
    direct: bool | None = None,
) -> int:
    """:func:`dispatch` driven by this thread on eng: the byte count, or the
    error raised here."""
    n: int = dispatch(BLOCKING, eng, op, file, data, offset, p, direct)
    return n


# The C side of File.pread/pwrite (the Route, see cython_ext/aionvme/glue/hub.pxi)
# takes its parameters and its long way from here, and follows the defaults.
bind_routes(REACTOR_ATTR, params, submit_file, READ)
defaults.on_change(settings_changed)


# -- CUDA tensors -----------------------------------------------------------------------------


class _DeviceTransfer(AsCoroutine, asyncio.Task):  # type: ignore[type-arg]
    """The Task of a transfer with CUDA tensors, also usable as a coroutine."""

    _it: Any = None


collections.abc.Coroutine.register(_DeviceTransfer)


def _fallback(fh: FileHandle, e: CuFileError) -> None:
    """After cuFile refused a transfer: re-raise unless the bounce path may
    take it (gpu_path='auto' and a code that means "not this file")."""
    if e.code not in cufile.FALL_BACK or defaults.settings.gpu_path == "gds":
        raise e
    cufile.refuse(fh, f"cuFile refused a transfer: {e.strerror}")
    gds_refuse_file(fh, e)


async def _device_part(
    r: Reactor, fh: FileHandle, write: bool, items: list[tuple[Any, int]], p: Params
) -> int:
    if not cufile.driver_ready() and defaults.settings.gpu_path != "bounce":
        # opening the driver initialises CUDA: off the loop
        await asyncio.get_running_loop().run_in_executor(helper(), cufile.open_driver)
    if cufile.gds_choice(fh) is None:
        try:
            return await cufile.gds(r, fh, write, items, p)
        except CuFileError as e:
            _fallback(fh, e)
    return await bounce.bounce(r, fh, write, items, p)


def _device_sync(eng: Engine, fh: FileHandle, write: bool, items: list[tuple[Any, int]], p: Params) -> int:
    require_cuda("a CUDA tensor transfer")
    if defaults.settings.gpu_path != "bounce":
        cufile.open_driver()
    if cufile.gds_choice(fh) is None:
        try:
            return cufile.gds_sync(eng, fh, write, items, p)
        except CuFileError as e:
            _fallback(fh, e)
    return bounce.bounce_sync(eng, fh, write, items, p)


async def transfer_device(
    r: Reactor, fh: FileHandle, temporary: bool, write: bool, items: list[tuple[Any, int]], p: Params
) -> int:
    """Move items (buffer, offset), some of them CUDA tensors, to or from
    fh; returns the byte count. Host buffers go through the engine as usual,
    in one request beside the GPU part."""
    try:
        dev = [i for i, (b, _) in enumerate(items) if is_cuda(b)]
        host = [i for i, (b, _) in enumerate(items) if not is_cuda(b)]
        parts: list[tuple[list[int], Awaitable[int]]] = []
        if host:
            make_v = r.engine.writev if write else r.engine.readv
            parts.append((host, r.submit(make_v(fh, [items[i] for i in host], *p))))
        parts.append((dev, _device_part(r, fh, write, [items[i] for i in dev], p)))
        futs = [asyncio.ensure_future(op) for _, op in parts]
        await bounce.all_done(futs)
        total = 0
        for (index, _), f in zip(parts, futs):
            if f.cancelled():
                raise asyncio.CancelledError
            exc = f.exception()
            if exc is not None:
                raise _renumbered(exc, index, len(items))
            total += f.result()
        return total
    finally:
        if temporary:
            fh.close()


def _renumbered(exc: BaseException, index: Sequence[int], nitems: int) -> BaseException:
    """A ShortReadError of a sub-request, naming the item of the whole batch."""
    if isinstance(exc, ShortReadError):
        seg = exc.segment if exc.segment is not None else 0
        if nitems > 1:
            return ShortReadError(exc.filename, exc.offset, exc.expected, exc.received, segment=index[seg])
    return exc


def submit_device(
    r: Reactor, fh: FileHandle, temporary: bool, write: bool, items: list[tuple[Any, int]], p: Params
) -> Awaitable[int]:
    """Start a transfer with CUDA tensors now, as a Task that is also a
    coroutine; like the host path, it starts without waiting for the caller
    to await it, and a setup error (no CUDA) arrives at the await."""
    try:
        require_cuda("a CUDA tensor transfer")
    except Exception as e:
        if temporary:
            fh.close()
        return failed(e, r.loop)
    return _DeviceTransfer(transfer_device(r, fh, temporary, write, items, p), loop=r.loop)


def run_device(
    eng: Engine, fh: FileHandle, temporary: bool, write: bool, items: list[tuple[Any, int]], p: Params
) -> int:
    """The blocking twin of :func:`submit_device` (no event loop needed)."""
    try:
        require_cuda("a CUDA tensor transfer")
        dev = [i for i, (b, _) in enumerate(items) if is_cuda(b)]
        host = [i for i, (b, _) in enumerate(items) if not is_cuda(b)]
        total = 0
        if host:
            make_v = eng.writev if write else eng.readv
            try:
                total += drive_request(make_v(fh, [items[i] for i in host], *p), eng)
            except ShortReadError as e:
                raise _renumbered(e, host, len(items)) from None
        try:
            return total + _device_sync(eng, fh, write, [items[i] for i in dev], p)
        except ShortReadError as e:
            raise _renumbered(e, dev, len(items)) from None
    finally:
        if temporary:
            fh.close()
