"""CUDA tensors, the copy streams and the helper thread: the lowest of the
GPU modules, holding the state they share (the lock, the counters).

torch is never imported here unless a CUDA tensor is being moved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import os
import sys
import threading
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

from ..exceptions import DeviceError, NonContiguousBufferError

Params = tuple[int, int, int]  # (block size, chunks in flight per request, engine mode bits)

lock = threading.RLock()  # guards the GPU modules' shared state

stats: dict[str, Any] = dict(
    gds_requests=0,
    gds_bytes=0,
    bounce_requests=0,
    bounce_bytes=0,
    files_refused=0,
    last_refusal=None,
    pinned_unregister_errors=0,
)


def is_cuda(obj: object) -> bool:
    """Whether obj is a torch CUDA tensor (torch is never imported here)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor) and bool(obj.is_cuda)


def any_cuda(items: Sequence[tuple[Any, Any]]) -> bool:
    """Whether any (buffer, offset) pair holds a CUDA tensor."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    tensor = torch.Tensor
    return any(isinstance(b, tensor) and b.is_cuda for b, _ in items)


def require_cuda(what: str) -> Any:
    """The torch module, or DeviceError saying why ``what`` needs CUDA."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        if importlib.util.find_spec("torch") is None:
            raise DeviceError(f"{what} needs torch with CUDA; torch is not installed")
        import torch

    if not torch.cuda.is_available():
        raise DeviceError(
            f"{what} needs CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}; a CPU-only build or no visible GPU)"
        )
    return torch


def flat_bytes(t: Any, what: str) -> Any:
    """t as a flat uint8 tensor over the same memory (contiguous only)."""
    import torch

    if not t.is_contiguous():
        raise NonContiguousBufferError(f"{what}: tensor is not contiguous; pass tensor.contiguous()")
    return t.detach().reshape(-1).view(torch.uint8)


_streams: dict[int, Any] = {}
_waiter: concurrent.futures.ThreadPoolExecutor | None = None
_waiter_pid = 0


def helper() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that wait for CUDA events (and run pageable copies), so the
    loop never blocks on the GPU. torch releases the GIL while it waits."""
    global _waiter, _waiter_pid
    if _waiter is None or _waiter_pid != os.getpid():
        with lock:
            if _waiter is None or _waiter_pid != os.getpid():
                _waiter = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="aionvme-gpu")
                _waiter_pid = os.getpid()
    return _waiter


def stream(torch: Any, device: Any) -> Any:
    """aionvme's copy stream on device (one per device per process)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _streams.get(idx)
    if s is None:
        with lock:
            s = _streams.get(idx)
            if s is None:
                s = torch.cuda.Stream(device=idx)
                _streams[idx] = s
    return s


def wait_event(event: Any) -> Awaitable[Any]:
    """A future done when the CUDA event has completed."""
    loop = asyncio.get_running_loop()
    if event.query():
        fut = loop.create_future()
        fut.set_result(None)
        return fut
    return loop.run_in_executor(helper(), event.synchronize)


async def wait_all(futs: Iterable[asyncio.Future[Any]]) -> None:
    """``asyncio.wait(futs)`` (all of them) for futures that are also
    coroutines, which asyncio.wait refuses. Cancelling the waiting task
    leaves the futures alone, as asyncio.wait does."""
    pending = [f for f in futs if not f.done()]
    if not pending:
        return
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    left = len(pending)

    def one_done(_: asyncio.Future[Any]) -> None:
        nonlocal left
        left -= 1
        if left == 0 and not waiter.done():
            waiter.set_result(None)

    for f in pending:
        f.add_done_callback(one_done)
    try:
        await waiter
    finally:
        for f in pending:
            f.remove_done_callback(one_done)


async def through(fut: Awaitable[Any]) -> Any:
    """Await fut to its end even if the task is cancelled meanwhile (the GPU
    or the kernel is still using memory we must not hand back early), then
    raise the cancellation."""
    f = asyncio.ensure_future(fut)
    cancelled = False
    while not f.done():
        try:
            await wait_all([f])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return f.result()


async def after_current_streams(torch: Any, devices: Iterable[Any]) -> None:
    """Wait (off the loop) for the work queued so far on the current stream of
    each device: cuFile's DMA is not ordered with CUDA streams."""
    for dev in devices:
        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(dev))
        await wait_event(ev)


def _after_fork_in_child() -> None:
    global _waiter, _streams
    _waiter = None
    _streams = {}


os.register_at_fork(after_in_child=_after_fork_in_child)
