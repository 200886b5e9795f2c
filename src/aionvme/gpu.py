"""CUDA tensors to and from files, awaitable.

Two paths, chosen per file:

- **GDS** (cuFile, GPUDirect Storage): the device DMAs straight between the
  NVMe drive and GPU memory. cuFileRead/cuFileWrite block, so the engine runs
  them in chunks of ``gpu_block_size`` on its worker threads, in parallel, and
  they complete through the event loop's eventfd like any transfer. Used when
  libcufile is found, its driver opens with nvidia-fs (or PCIe P2PDMA) behind
  it, and cuFile accepts the file (``cuFileHandleRegister``). A refusal is
  remembered per file, with its reason (:func:`stats`), and the file goes
  the other way.
- **bounce**: kernel AIO with O_DIRECT into a bounded pool of pinned host
  buffers allocated once per process (``pinned_pool`` bytes, slots of
  ``gpu_block_size``), while the slots filled before are copied to the GPU
  on a side stream; writes the reverse. A slot is reused only once its copy
  has completed. Waiting for copies happens on a helper thread, never on the
  loop.

cuFile's *compatibility mode* (the driver opens but nvidia-fs is absent)
stages through cuFile's own host buffers with synchronous POSIX I/O per
call; ``gpu_path='auto'`` prefers the bounce pipeline there, which overlaps
the disk with the copies. ``gpu_path='gds'`` uses cuFile whatever its mode
(or raises where cuFile is unavailable); ``'bounce'`` never uses cuFile.

Semantics are the host path's: every byte or an exception (a short file is
:class:`~aionvme.ShortReadError`); when an awaited call ends, by result,
error or cancellation, nothing touches the tensor any more (chunks and
copies in flight are waited for). Reads and writes are ordered after the
work already queued on the tensor's current CUDA stream, and the data is
complete on the device (for any stream) when the await returns.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import importlib.util
import os
import resource
import sys
import threading
import warnings
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from . import _engine, defaults
from ._engine import AlignedBuffer, Engine, FileHandle, Request, fstatx
from ._runtime.reactor import Reactor
from .exceptions import CuFileError, DeviceError, ShortReadError, os_error

__all__ = [
    "cufile_status",
    "deregister",
    "is_cuda",
    "library_candidates",
    "pin",
    "register",
    "registered",
    "shutdown",
    "stats",
]

Params = tuple[int, int, int]  # (block size, chunks in flight per request, engine mode bits)

_lock = threading.RLock()

# cuFile codes after which a file (or this memory) goes the bounce way
# instead (gpu_path='auto'): cuFile cannot serve it, the data path is fine.
_FALL_BACK = {
    5007,  # CU_FILE_PLATFORM_NOT_SUPPORTED
    5008,  # CU_FILE_IO_NOT_SUPPORTED
    5009,  # CU_FILE_DEVICE_NOT_SUPPORTED
    5012,  # CU_FILE_CUDA_POINTER_INVALID
    5013,  # CU_FILE_CUDA_MEMORY_TYPE_INVALID
    5018,  # CU_FILE_INVALID_FILE_TYPE
    5019,  # CU_FILE_INVALID_FILE_OPEN_FLAG
    5020,  # CU_FILE_DIO_NOT_SET
    5034,  # CU_FILE_IO_DISABLED
}
_REFUSED_MAX = 4096

_stats: dict[str, Any] = dict(
    gds_requests=0,
    gds_bytes=0,
    bounce_requests=0,
    bounce_bytes=0,
    files_refused=0,
    last_refusal=None,
    pinned_unregister_errors=0,
)
_refused: collections.OrderedDict[tuple[Any, int], str] = collections.OrderedDict()


# -- CUDA tensors ---------------------------------------------------------------------


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


def _flat_bytes(t: Any, what: str) -> Any:
    """t as a flat uint8 tensor over the same memory (contiguous only)."""
    import torch

    if not t.is_contiguous():
        from .exceptions import NonContiguousBufferError

        raise NonContiguousBufferError(f"{what}: tensor is not contiguous; pass tensor.contiguous()")
    return t.detach().reshape(-1).view(torch.uint8)


# -- cuFile: library, driver, mode ------------------------------------------------------


def library_candidates() -> list[str]:
    """Where libcufile is looked for, in order: $AIONVME_CUFILE_LIBRARY, the
    dynamic loader's search (``libcufile.so.0``), the CUDA toolkit, then the
    lib folders of the nvidia-cufile / nvidia-cufile-cu12 / -cu13 wheels."""
    out = []
    env = os.environ.get("AIONVME_CUFILE_LIBRARY")
    if env:
        out.append(env)
    out.append("libcufile.so.0")
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
        out.append(os.path.join(d, "libcufile.so.0"))
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cufile", "cu13", "cu12"):
            lib = os.path.join(base, sub, "lib", "libcufile.so.0")
            if os.path.exists(lib):
                out.append(lib)
    return list(dict.fromkeys(out))


def find_library() -> str | None:
    """The first candidate that exists as a file (the loader's own search is
    not run: nothing is loaded), or None."""
    import ctypes.util

    for cand in library_candidates():
        if os.sep in cand:
            if os.path.exists(cand):
                return cand
        elif ctypes.util.find_library("cufile"):
            return cand
    return None


def nvidia_driver_present() -> bool:
    """Whether the NVIDIA kernel driver is here (its device node or /proc entry)."""
    return os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia")


class _Driver:
    """This process's cuFile driver, opened once on first use."""

    def __init__(self) -> None:
        self.ready = False  # open attempted
        self.mode: str | None = None  # 'gds', 'compat', or None: unavailable
        self.reason = "not probed yet"
        self.path: str | None = None
        self.version: int | None = None
        self.properties: dict[str, Any] | None = None
        self.pid = os.getpid()


_driver = _Driver()


def _open_driver() -> _Driver:
    """Load libcufile and open its driver (once; thread-safe). Never raises:
    the outcome is in ``mode`` and ``reason``."""
    global _driver
    d = _driver
    if d.ready and d.pid == os.getpid():
        return d
    with _lock:
        if _driver.pid != os.getpid():
            _driver = _Driver()
        d = _driver
        if d.ready:
            return d
        d.ready = True
        path, why = _engine.gds_load(library_candidates())
        if path is None:
            d.reason = f"libcufile.so.0 could not be loaded: {why}"
            return d
        st = _engine.gds_status()
        d.path, d.version = path, st["version"]
        if not os.environ.get("AIONVME_CUFILE_LIBRARY") and not nvidia_driver_present():
            # cuFileDriverOpen needs the GPU driver: without one, cuFile 1.20 was
            # seen to hang in it for minutes (1.15 fails at once).
            d.reason = "no NVIDIA GPU driver here (/dev/nvidiactl and /proc/driver/nvidia are absent)"
            return d
        try:
            _engine.gds_driver_open()
        except CuFileError as e:
            d.reason = f"cuFileDriverOpen failed: {e.strerror}"
            return d
        props = _engine.gds_driver_properties()
        d.properties = props
        if props is None:
            d.mode, d.reason = "gds", "cuFile driver open (no cuFileDriverGetProperties to tell more)"
        elif props["nvfs_major"] or props["nvfs_minor"]:
            d.mode = "gds"
            d.reason = f"nvidia-fs {props['nvfs_major']}.{props['nvfs_minor']} loaded: GPUDirect DMA"
        elif props["nvme_p2p_supported"]:
            d.mode, d.reason = "gds", "PCIe P2PDMA: GPUDirect DMA without nvidia-fs"
        else:
            d.mode = "compat"
            d.reason = (
                "nvidia-fs is not loaded: cuFile runs in compatibility mode (POSIX I/O through its "
                "own bounce buffers)"
            )
        return d


def cufile_status() -> dict[str, Any]:
    """cuFile in this process: library, version, mode ('gds', 'compat' or
    None) and why, driver properties, registrations. Opens the driver if it
    was not open yet (that initialises CUDA)."""
    d = _open_driver()
    st = _engine.gds_status()
    return dict(
        library=d.path,
        version=_version_str(d.version),
        mode=d.mode,
        reason=d.reason,
        properties=d.properties,
        handles=st["handles"],
        buffers=st["buffers"],
        stdin_restored=st["stdin_restored"],
    )


def _version_str(v: int | None) -> str | None:
    # cuFileGetVersion: 1000 * major + 10 * minor (1150 is 1.15)
    return None if not v else f"{v // 1000}.{v % 1000 // 10}"


def probe_main(out_path: str) -> None:
    """Entry point of the probe ``aionvme info`` runs in a child process (so
    the caller's process never initialises CUDA): writes cufile_status() as
    JSON to out_path."""
    import json

    try:
        status = cufile_status()
    except Exception as e:  # reported, not raised: the parent prints it
        status = dict(library=None, version=None, mode=None, reason=f"probe failed: {e!r}")
    with open(out_path, "w") as f:
        json.dump(status, f)


def _file_key(fh: FileHandle) -> tuple[Any, int]:
    st = fstatx(fh.fd)
    return (st["dev"], st["ino"])


def _refuse(fh: FileHandle, why: str) -> str:
    key = _file_key(fh)
    with _lock:
        if key not in _refused:
            _stats["files_refused"] += 1
        _refused[key] = why
        _refused.move_to_end(key)
        while len(_refused) > _REFUSED_MAX:
            _refused.popitem(last=False)
        _stats["last_refusal"] = f"{fh.path}: {why}"
    return why


def gds_choice(fh: FileHandle) -> str | None:
    """None if fh's CUDA transfers go through cuFile, else why not (they go
    through the bounce buffers). The driver must have been opened.

    Raises
    ------
    CuFileError, DeviceError
        ``gpu_path='gds'`` and cuFile cannot serve this file.
    """
    want = defaults.settings.gpu_path
    if want == "bounce":
        return "gpu_path='bounce'"
    if fh.gds_refused is not None and want == "auto":
        return str(fh.gds_refused.strerror)
    if _engine.gds_file_registered(fh):
        return None
    d = _driver
    if d.mode is None:
        if want == "gds":
            raise DeviceError(f"gpu_path='gds' but cuFile is unavailable: {d.reason}")
        return d.reason
    if d.mode == "compat" and want == "auto":
        return (
            "cuFile is in compatibility mode (no GPUDirect DMA): the pinned bounce pipeline overlaps better"
        )
    if want == "auto":
        why = _refused.get(_file_key(fh))
        if why is not None:
            return why
        if not fh.direct:
            return _refuse(fh, "the file is not open with O_DIRECT (its filesystem refuses it)")
    try:
        _engine.gds_register_file(fh)
    except CuFileError as e:
        if want == "gds":
            raise
        return _refuse(fh, f"cuFileHandleRegister refused it: {e.strerror}")
    return None


# -- registered buffers -------------------------------------------------------------------

_registered: dict[int, tuple[int, Any]] = {}  # base address -> (nbytes, tensor kept alive)
_registered_bases: list[int] = []


def register(tensor: Any) -> bool:
    """Register a CUDA tensor's memory with cuFile (``cuFileBufRegister``) for
    buffers reused across many transfers (streaming), so each cuFile call
    skips mapping it. Returns False (and does nothing) where transfers do not
    go through cuFile.

    The tensor is kept alive until :func:`deregister`; transfers into any
    part of it use the registration.
    """
    torch = require_cuda("register()")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise DeviceError("register() takes a CUDA tensor (host memory needs no cuFile registration)")
    if defaults.settings.gpu_path == "bounce":
        return False
    d = _open_driver()
    if d.mode is None or (d.mode == "compat" and defaults.settings.gpu_path == "auto"):
        return False
    flat = _flat_bytes(tensor, "register()")
    base, n = flat.data_ptr(), flat.numel()
    with _lock:
        if base in _registered:
            return True
        with torch.cuda.device(tensor.device):
            _engine.gds_buf_register(base, n, 0)
        _registered[base] = (n, tensor)
        bisect.insort(_registered_bases, base)
    return True


def deregister(tensor: Any) -> bool:
    """Undo :func:`register`; returns whether the tensor was registered."""
    if not is_cuda(tensor):
        return False
    base = tensor.data_ptr()
    with _lock:
        if base not in _registered:
            return False
        import torch

        with torch.cuda.device(tensor.device):
            _engine.gds_buf_deregister(base)
        del _registered[base]
        _registered_bases.remove(base)
    return True


@contextlib.contextmanager
def registered(tensor: Any) -> Iterator[bool]:
    """``with registered(t):`` registers t for the block (see :func:`register`)."""
    done = register(tensor)
    try:
        yield done
    finally:
        if done:
            deregister(tensor)


def _cufile_base(ptr: int, n: int) -> tuple[int, int]:
    """(base, offset) to give cuFile for [ptr, ptr+n): a registered buffer
    holding the range, else the memory itself."""
    i = bisect.bisect_right(_registered_bases, ptr) - 1
    if i >= 0:
        base = _registered_bases[i]
        size = _registered[base][0]
        if ptr + n <= base + size:
            return base, ptr - base
    return ptr, 0


def shutdown() -> None:
    """Deregister every buffer, close the cuFile driver (files still
    registered keep it open until they close) and forget the pinned pool.
    The next GPU transfer starts afresh. Also run at exit."""
    global _driver, _pool
    with _lock:
        if os.getpid() == _driver.pid:
            for base in list(_registered):
                with contextlib.suppress(CuFileError):
                    _engine.gds_buf_deregister(base)
            if _driver.mode is not None:
                with contextlib.suppress(CuFileError):
                    _engine.gds_driver_close()
        _registered.clear()
        _registered_bases.clear()
        _driver = _Driver()
        _pool = None
        _refused.clear()


def stats() -> dict[str, Any]:
    """Counters of this process's GPU transfers and the state of both paths."""
    with _lock:
        out = dict(_stats)
        d = _driver
        out.update(
            cufile_mode=d.mode if d.ready else None,
            cufile_reason=d.reason,
            files_remembered=len(_refused),
            registered_buffers=len(_registered),
            pool=_pool.describe() if _pool is not None else None,
        )
    return out


def _after_fork_in_child() -> None:
    global _driver, _pool, _waiter, _streams
    _engine.gds_forget()
    _driver = _Driver()
    _pool = None
    _waiter = None
    _streams = {}
    _registered.clear()
    _registered_bases.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- pinned host memory ---------------------------------------------------------------------


def _host_unregister(address: int) -> None:
    # An AlignedBuffer's release hook: runs from its deallocator, so it must
    # not raise; a failure (at exit CUDA may be gone already) is counted.
    torch = sys.modules.get("torch")
    try:
        rc = int(torch.cuda.cudart().cudaHostUnregister(address)) if torch is not None else -1
    except Exception:  # reported through stats, never raised from a deallocator
        rc = -1
    if rc != 0:
        _stats["pinned_unregister_errors"] += 1


def pin(buf: AlignedBuffer) -> None:
    """Page-lock buf for CUDA (``cudaHostRegister``, portable to every device)
    until it is freed: it is unregistered just before its pages are unmapped.

    Raises DeviceError without CUDA, OSError (ENOMEM) when CUDA refuses.
    """
    torch = require_cuda("pinned memory")
    n = max(len(buf), 1)
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.address, n, 1))  # 1: cudaHostRegisterPortable
    if rc != 0:
        import errno

        raise os_error(errno.ENOMEM, None, nbytes=n, op=f"cudaHostRegister (cudaError {rc})")
    buf.set_release_hook(_host_unregister)


def _locked_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def memlock_budget() -> int | None:
    """Bytes this process may still page-lock, or None when unbounded
    (RLIMIT_MEMLOCK unlimited, or CAP_IPC_LOCK)."""
    from .diagnostics import _has_cap_ipc_lock

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _has_cap_ipc_lock():
        return None
    return max(0, soft - _locked_bytes())


class _Slot:
    __slots__ = ("array", "index", "tensor")

    def __init__(self, index: int, array: np.ndarray, tensor: Any) -> None:
        self.index = index
        self.array = array  # uint8 numpy view: what the engine reads into / writes from
        self.tensor = tensor  # the same memory as a torch uint8 tensor (copies)


class _Waiter:
    """A blocking acquirer's place in the queue."""

    __slots__ = ("event", "slot")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.slot: _Slot | None = None


class PinnedPool:
    """A fixed set of page-aligned host buffers (slots) shared by every
    transfer of the process, pinned once. Waiters are served in order;
    async waiters on any loop, blocking ones on any thread.

    Parameters
    ----------
    slot_size, nslots : int
    pin : callable or None
        Called with the AlignedBuffer holding every slot (``gpu.pin`` for
        CUDA); None leaves it pageable.
    """

    def __init__(self, slot_size: int, nslots: int, pin: Callable[[AlignedBuffer], None] | None) -> None:
        import torch

        self.slot_size = slot_size
        self.nslots = nslots
        self.pid = os.getpid()
        self.buffer = AlignedBuffer(slot_size * nslots)
        self.pinned = False
        self.why_not_pinned: str | None = "not requested"
        if pin is not None:
            try:
                pin(self.buffer)
                self.pinned, self.why_not_pinned = True, None
            except (OSError, DeviceError) as e:
                self.why_not_pinned = str(e)
        whole = np.frombuffer(memoryview(self.buffer), dtype=np.uint8)
        whole_t = torch.from_numpy(whole)
        self._free: collections.deque[_Slot] = collections.deque(
            _Slot(i, whole[i * slot_size : (i + 1) * slot_size], whole_t[i * slot_size : (i + 1) * slot_size])
            for i in range(nslots)
        )
        self._waiters: collections.deque[asyncio.Future[_Slot] | _Waiter] = collections.deque()
        self._mu = threading.Lock()

    def describe(self) -> dict[str, Any]:
        return dict(
            slot_size=self.slot_size,
            slots=self.nslots,
            free=len(self._free),
            pinned=self.pinned,
            why_not_pinned=self.why_not_pinned,
        )

    async def acquire(self) -> _Slot:
        loop = asyncio.get_running_loop()
        with self._mu:
            if self._free and not self._waiters:
                return self._free.popleft()
            fut: asyncio.Future[_Slot] = loop.create_future()
            self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            with self._mu:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                    raise
            # a slot was handed over as the wait was cancelled: pass it on
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            raise

    def acquire_blocking(self) -> _Slot:
        with self._mu:
            if self._free and not self._waiters:
                return self._free.popleft()
            w = _Waiter()
            self._waiters.append(w)
        w.event.wait()
        if w.slot is None:
            raise RuntimeError("pinned pool handed over no slot")
        return w.slot

    def release(self, slot: _Slot) -> None:
        """Give slot to the first waiter, or back to the free list."""
        with self._mu:
            while self._waiters:
                w = self._waiters.popleft()
                if isinstance(w, _Waiter):
                    w.slot = slot
                    w.event.set()
                    return
                if w.done():
                    continue  # cancelled while waiting
                w.get_loop().call_soon_threadsafe(self._hand_over, w, slot)
                return
            self._free.append(slot)

    def _hand_over(self, fut: asyncio.Future[_Slot], slot: _Slot) -> None:
        if fut.done():
            self.release(slot)  # its waiter was cancelled meanwhile
        else:
            fut.set_result(slot)


_pool: PinnedPool | None = None


def pool() -> PinnedPool:
    """The process's bounce buffers, made on first use: ``pinned_pool`` bytes
    in slots of ``gpu_block_size``, fewer where RLIMIT_MEMLOCK is lower (at
    least two). Without room for two pinned slots, or when CUDA refuses to
    pin, the slots stay pageable and a RuntimeWarning says so."""
    global _pool
    p = _pool
    if p is not None and p.pid == os.getpid():
        return p
    with _lock:
        if _pool is not None and _pool.pid == os.getpid():
            return _pool
        s = defaults.settings
        slot = s.gpu_block_size
        nslots = max(2, s.pinned_pool // slot)
        budget = memlock_budget()
        pin_it: Callable[[AlignedBuffer], None] | None = pin
        why = None
        if budget is not None:
            if budget < 2 * slot:
                pin_it = None
                why = f"RLIMIT_MEMLOCK leaves {budget} bytes, less than two {slot}-byte buffers"
            else:
                nslots = min(nslots, budget // slot)
        p = PinnedPool(slot, nslots, pin_it)
        if why is not None:
            p.why_not_pinned = why
        if not p.pinned:
            warnings.warn(
                f"aionvme: the GPU bounce buffers are not pinned ({p.why_not_pinned}); copies to and "
                "from the GPU run synchronously on a helper thread and are slower",
                RuntimeWarning,
                stacklevel=3,
            )
        _pool = p
        return p


# -- streams, events and the helper thread ---------------------------------------------------

_streams: dict[int, Any] = {}
_waiter: concurrent.futures.ThreadPoolExecutor | None = None
_waiter_pid = 0


def _helper() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that wait for CUDA events (and run pageable copies), so the
    loop never blocks on the GPU. torch releases the GIL while it waits."""
    global _waiter, _waiter_pid
    if _waiter is None or _waiter_pid != os.getpid():
        with _lock:
            if _waiter is None or _waiter_pid != os.getpid():
                _waiter = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="aionvme-gpu")
                _waiter_pid = os.getpid()
    return _waiter


def _stream(torch: Any, device: Any) -> Any:
    """aionvme's copy stream on device (one per device per process)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _streams.get(idx)
    if s is None:
        with _lock:
            s = _streams.get(idx)
            if s is None:
                s = torch.cuda.Stream(device=idx)
                _streams[idx] = s
    return s


def _wait_event(event: Any) -> Awaitable[Any]:
    """A future done when the CUDA event has completed."""
    loop = asyncio.get_running_loop()
    if event.query():
        fut = loop.create_future()
        fut.set_result(None)
        return fut
    return loop.run_in_executor(_helper(), event.synchronize)


async def _through(fut: Awaitable[Any]) -> Any:
    """Await fut to its end even if the task is cancelled meanwhile (the GPU
    or the kernel is still using memory we must not hand back early), then
    raise the cancellation."""
    f = asyncio.ensure_future(fut)
    cancelled = False
    while not f.done():
        try:
            await asyncio.wait([f])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return f.result()


async def _after_current_streams(torch: Any, devices: Iterable[Any]) -> None:
    """Wait (off the loop) for the work queued so far on the current stream of
    each device: cuFile's DMA is not ordered with CUDA streams."""
    for dev in devices:
        ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(dev))
        await _wait_event(ev)


# -- planning the bounce pipeline -------------------------------------------------------------


class _Piece:
    """One slot's worth of an item: ``n`` of its bytes starting ``upos`` into
    it, at file offset ``fpos + skip``. ``fpos`` is aligned; the slot holds
    the bytes at ``[skip, skip + n)``, so slot addresses and file offsets
    agree modulo the alignment and the engine moves them zero-copy (a read
    fills ``[0, skip + n)`` from ``fpos``: the head bytes it reads on the way
    are not copied)."""

    __slots__ = ("fpos", "item", "n", "skip", "upos")

    def __init__(self, item: int, fpos: int, skip: int, n: int, upos: int) -> None:
        self.item = item
        self.fpos = fpos
        self.skip = skip
        self.n = n
        self.upos = upos


def plan_pieces(items: Sequence[tuple[int, int]], slot: int, align: int) -> list[_Piece]:
    """Cut (nbytes, file offset) items into pieces of one slot each, at
    aligned file boundaries: only an item's first piece starts unaligned
    (``skip`` > 0) and only its last ends unaligned."""
    out = []
    for i, (n, off) in enumerate(items):
        if n <= 0:
            continue
        end = off + n
        pos = off - off % align
        while pos < end:
            stop = min(pos + slot, end)
            first = max(pos, off)
            out.append(_Piece(i, pos, first - pos, stop - first, first - off))
            pos = stop
    return out


# -- the transfers ------------------------------------------------------------------------------


class _Job:
    """One request of the GPU path: its items and what went wrong."""

    def __init__(self, fh: FileHandle, write: bool, items: list[tuple[Any, int]]) -> None:
        self.fh = fh
        self.write = write
        self.items = items
        self.errors: list[tuple[int, BaseException]] = []  # (item, error)
        self.stop = False

    def setup(
        self, torch: Any
    ) -> tuple[PinnedPool, list[Any], list[int], list[int], dict[Any, Any], list[_Piece]]:
        """(pool, flat uint8 views of the tensors, file offsets, sizes, copy
        stream per device, pieces) for a bounce transfer; the copy streams
        are ordered after the work queued so far on the tensors' current streams."""
        p = pool()
        flats = [_flat_bytes(t, "pwrite" if self.write else "pread") for t, _ in self.items]
        offsets = [int(off) for _, off in self.items]
        sizes = [int(f.numel()) for f in flats]
        streams = {d: _stream(torch, d) for d in {f.device for f in flats}}
        for d, s in streams.items():
            s.wait_stream(torch.cuda.current_stream(d))
        pieces = plan_pieces(list(zip(sizes, offsets)), p.slot_size, max(self.fh.align, 1))
        return p, flats, offsets, sizes, streams, pieces

    def fail(self, item: int, exc: BaseException) -> None:
        self.errors.append((item, exc))
        self.stop = True

    def finish(self, offsets: Sequence[int], sizes: Sequence[int]) -> int:
        """The byte count of a bounce request that ended, or its error."""
        self.raise_errors(offsets, sizes, range(len(self.items)))
        total = sum(sizes)
        _stats["bounce_requests"] += 1
        _stats["bounce_bytes"] += total
        return total

    def raise_errors(self, offsets: Sequence[int], sizes: Sequence[int], index: Sequence[int]) -> None:
        """Raise the first error: a short read as ShortReadError of the item
        (bytes contiguous from its offset), anything else as it came."""
        if not self.errors:
            return
        shorts = [(i, e) for i, e in self.errors if isinstance(e, ShortReadError)]
        if len(shorts) < len(self.errors):
            raise next(e for _, e in self.errors if not isinstance(e, ShortReadError))
        best: tuple[int, int] | None = None
        for i, e in shorts:
            got = max(0, e.offset + e.received - offsets[i])
            if best is None or (i, got) < best:
                best = (i, got)
        if best is not None:
            i, got = best
            seg = index[i] if len(self.items) > 1 else None
            raise ShortReadError(self.fh.path, offsets[i], sizes[i], got, segment=seg)


async def _bounce(
    r: Reactor, fh: FileHandle, write: bool, items: list[tuple[Any, int]], params: Params
) -> int:
    """The pinned bounce pipeline for CUDA tensors (async)."""
    import torch

    job = _Job(fh, write, items)
    p, flats, offsets, sizes, streams, pieces = job.setup(torch)
    block, maxinf, mode = params
    it = iter(pieces)

    async def copy(dst: Any, src: Any, stream: Any) -> None:
        if p.pinned:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            ev.record(stream)
            await _through(_wait_event(ev))
        else:

            def run() -> None:
                with torch.cuda.stream(stream):
                    dst.copy_(src)
                stream.synchronize()

            await _through(asyncio.get_running_loop().run_in_executor(_helper(), run))

    async def worker() -> None:
        for pc in it:
            if job.stop:
                return
            slot = await p.acquire()
            try:
                flat = flats[pc.item]
                user = flat[pc.upos : pc.upos + pc.n]
                held = slot.array[pc.skip : pc.skip + pc.n]
                if write:
                    await copy(slot.tensor[pc.skip : pc.skip + pc.n], user, streams[flat.device])
                    await r.submit(r.engine.write(fh, held, pc.fpos + pc.skip, block, maxinf, mode))
                else:
                    span = slot.array[: pc.skip + pc.n]
                    await r.submit(r.engine.read(fh, span, pc.fpos, block, maxinf, mode))
                    await copy(user, slot.tensor[pc.skip : pc.skip + pc.n], streams[flat.device])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # kept for the request's error, raised below
                job.fail(pc.item, e)
            finally:
                p.release(slot)

    await _workers(min(len(pieces), p.nslots), worker)
    return job.finish(offsets, sizes)


async def _all_done(futs: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every one of futs is done. If the waiting task is cancelled,
    cancel them all and still wait for all of them (each finishes what it has
    in flight), then raise the cancellation."""
    try:
        await asyncio.wait(futs)
    except asyncio.CancelledError:
        for f in futs:
            f.cancel()
        while not all(f.done() for f in futs):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(futs)
        raise


async def _call(worker: Callable[[], Awaitable[None]]) -> None:
    await worker()


async def _workers(n: int, worker: Callable[[], Awaitable[None]]) -> None:
    """Run n copies of worker; on cancellation cancel them all and wait for
    them (each finishes what is in flight) before raising."""
    if n <= 1:
        await worker()
        return
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = [loop.create_task(_call(worker)) for _ in range(n)]
    await _all_done(tasks)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


def _gds_items(items: list[tuple[Any, int]]) -> tuple[list[Any], list[tuple[Any, int, int, int, int]]]:
    flats = [_flat_bytes(t, "GPU transfer") for t, _ in items]
    out = []
    for f, (_, off) in zip(flats, items):
        n = f.numel()
        base, boff = _cufile_base(f.data_ptr(), n) if n else (f.data_ptr(), 0)
        out.append((f, base, boff, n, off))
    return flats, out


def _gds_block() -> int:
    return defaults.settings.gpu_block_size


async def _gds(r: Reactor, fh: FileHandle, write: bool, items: list[tuple[Any, int]], params: Params) -> int:
    import torch

    flats, gitems = _gds_items(items)
    await _after_current_streams(torch, {f.device for f in flats})
    req = _engine.gds_submit(r.engine, fh, gitems, write, _gds_block(), params[1])
    n: int = await r.submit(req)
    _stats["gds_requests"] += 1
    _stats["gds_bytes"] += n
    return n


async def _device_part(
    r: Reactor, fh: FileHandle, write: bool, items: list[tuple[Any, int]], params: Params
) -> int:
    stale = not _driver.ready or _driver.pid != os.getpid()
    if stale and defaults.settings.gpu_path != "bounce":  # opening initialises CUDA: off the loop
        await asyncio.get_running_loop().run_in_executor(_helper(), _open_driver)
    why = gds_choice(fh)
    if why is None:
        try:
            return await _gds(r, fh, write, items, params)
        except CuFileError as e:
            if e.code not in _FALL_BACK or defaults.settings.gpu_path == "gds":
                raise
            _refuse(fh, f"cuFile refused a transfer: {e.strerror}")
            _engine.gds_refuse_file(fh, e)
    return await _bounce(r, fh, write, items, params)


async def transfer(
    r: Reactor, fh: FileHandle, temporary: bool, write: bool, items: list[tuple[Any, int]], params: Params
) -> int:
    """Move items (buffer, offset), some of them CUDA tensors, to or from
    fh; returns the byte count. Host buffers go through the engine as usual,
    in one request beside the GPU part."""
    try:
        dev = [i for i, (b, _) in enumerate(items) if is_cuda(b)]
        host = [i for i, (b, _) in enumerate(items) if not is_cuda(b)]
        parts: list[tuple[list[int], Awaitable[int]]] = []
        if host:
            make = r.engine.writev if write else r.engine.readv
            parts.append((host, r.submit(make(fh, [items[i] for i in host], *params))))
        parts.append((dev, _device_part(r, fh, write, [items[i] for i in dev], params)))
        futs = [asyncio.ensure_future(op) for _, op in parts]
        await _all_done(futs)
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


def submit(
    r: Reactor, fh: FileHandle, temporary: bool, write: bool, items: list[tuple[Any, int]], params: Params
) -> asyncio.Task[int]:
    """Start :func:`transfer` now, as a Task (a Future: awaitable, cancellable,
    ``gather``-able); like the host path, the transfer starts without waiting
    for the caller to await it."""
    try:
        require_cuda("a CUDA tensor transfer")
    except BaseException:
        if temporary:
            fh.close()
        raise
    return r.loop.create_task(transfer(r, fh, temporary, write, items, params))


# -- blocking twins -------------------------------------------------------------------------


def _run(eng: Engine, req: Request) -> int:
    eng.run(req)
    if req.ok:
        n: int = req.nbytes
        return n
    exc = req.exception()
    raise exc if exc is not None else RuntimeError("request ended without a result")


def _bounce_sync(
    eng: Engine, fh: FileHandle, write: bool, items: list[tuple[Any, int]], params: Params
) -> int:
    import torch

    job = _Job(fh, write, items)
    p, flats, offsets, sizes, streams, pieces = job.setup(torch)
    block, maxinf, mode = params
    pending: collections.deque[tuple[_Slot, Any]] = collections.deque()  # read copies in flight
    depth = min(2, p.nslots)
    try:
        for pc in pieces:
            if job.stop:
                break
            while len(pending) >= depth:
                s, ev = pending.popleft()
                ev.synchronize()
                p.release(s)
            slot = p.acquire_blocking()
            flat = flats[pc.item]
            stream = streams[flat.device]
            user = flat[pc.upos : pc.upos + pc.n]
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            try:
                if write:
                    with torch.cuda.stream(stream):
                        slot.tensor[pc.skip : pc.skip + pc.n].copy_(user, non_blocking=p.pinned)
                    ev.record(stream)
                    ev.synchronize()
                    held = slot.array[pc.skip : pc.skip + pc.n]
                    _run(eng, eng.write(fh, held, pc.fpos + pc.skip, block, maxinf, mode))
                    p.release(slot)
                else:
                    _run(eng, eng.read(fh, slot.array[: pc.skip + pc.n], pc.fpos, block, maxinf, mode))
                    with torch.cuda.stream(stream):
                        user.copy_(slot.tensor[pc.skip : pc.skip + pc.n], non_blocking=p.pinned)
                    ev.record(stream)
                    pending.append((slot, ev))
            except Exception as e:  # kept for the request's error, raised below
                job.fail(pc.item, e)
                p.release(slot)
    finally:
        while pending:
            s, ev = pending.popleft()
            ev.synchronize()
            p.release(s)
    return job.finish(offsets, sizes)


def run_sync(
    eng: Engine, fh: FileHandle, temporary: bool, write: bool, items: list[tuple[Any, int]], params: Params
) -> int:
    """The blocking twin of :func:`transfer` (no event loop needed)."""
    try:
        require_cuda("a CUDA tensor transfer")
        dev = [i for i, (b, _) in enumerate(items) if is_cuda(b)]
        host = [i for i, (b, _) in enumerate(items) if not is_cuda(b)]
        total = 0
        if host:
            make = eng.writev if write else eng.readv
            try:
                total += _run(eng, make(fh, [items[i] for i in host], *params))
            except ShortReadError as e:
                raise _renumbered(e, host, len(items)) from None
        try:
            return total + _device_sync(eng, fh, write, [items[i] for i in dev], params)
        except ShortReadError as e:
            raise _renumbered(e, dev, len(items)) from None
    finally:
        if temporary:
            fh.close()


def _device_sync(eng: Engine, fh: FileHandle, write: bool, dev: list[tuple[Any, int]], params: Params) -> int:
    """The CUDA items of run_sync: cuFile where it serves the file, else bounce."""
    torch = require_cuda("a CUDA tensor transfer")
    if defaults.settings.gpu_path != "bounce":
        _open_driver()
    why = gds_choice(fh)
    if why is None:
        flats, gitems = _gds_items(dev)
        for d in {f.device for f in flats}:
            torch.cuda.current_stream(d).synchronize()
        try:
            n = _run(eng, _engine.gds_submit(eng, fh, gitems, write, _gds_block(), params[1]))
            _stats["gds_requests"] += 1
            _stats["gds_bytes"] += n
            return n
        except CuFileError as e:
            if e.code not in _FALL_BACK or defaults.settings.gpu_path == "gds":
                raise
            _refuse(fh, f"cuFile refused a transfer: {e.strerror}")
            _engine.gds_refuse_file(fh, e)
    return _bounce_sync(eng, fh, write, dev, params)


def _at_exit() -> None:
    with contextlib.suppress(Exception):
        shutdown()


import atexit  # noqa: E402 - with the hooks below: files still registered keep the driver open

atexit.register(_at_exit)
