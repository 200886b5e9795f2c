"""cuFile (GPUDirect Storage): the library, its driver and mode, which files
it serves, registered buffers, and the cuFile transfer itself."""

from __future__ import annotations

import bisect
import collections
import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

from .. import defaults
from .._engine import (
    Engine,
    FileHandle,
    fstatx,
    gds_buf_deregister,
    gds_buf_register,
    gds_driver_close,
    gds_driver_open,
    gds_driver_properties,
    gds_file_registered,
    gds_forget,
    gds_load,
    gds_register_file,
    gds_status,
    gds_submit,
)
from ..exceptions import CuFileError, DeviceError
from . import cuda
from .blocking import run as drive_request
from .cuda import Params, flat_bytes, is_cuda, require_cuda
from .reactor import Reactor

# cuFile codes after which a file (or this memory) goes the bounce way
# instead (gpu_path='auto'): cuFile cannot serve it, the data path is fine.
FALL_BACK = {
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

_refused: collections.OrderedDict[tuple[Any, int], str] = collections.OrderedDict()


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


def open_driver() -> _Driver:
    """Load libcufile and open its driver (once; thread-safe). Never raises:
    the outcome is in ``mode`` and ``reason``."""
    global _driver
    d = _driver
    if d.ready and d.pid == os.getpid():
        return d
    with cuda.lock:
        if _driver.pid != os.getpid():
            _driver = _Driver()
        d = _driver
        if d.ready:
            return d
        d.ready = True
        path, why = gds_load(library_candidates())
        if path is None:
            d.reason = f"libcufile.so.0 could not be loaded: {why}"
            return d
        st = gds_status()
        d.path, d.version = path, st["version"]
        if not os.environ.get("AIONVME_CUFILE_LIBRARY") and not nvidia_driver_present():
            # cuFileDriverOpen needs the GPU driver: without one, cuFile 1.20 was
            # seen to hang in it for minutes (1.15 fails at once).
            d.reason = "no NVIDIA GPU driver here (/dev/nvidiactl and /proc/driver/nvidia are absent)"
            return d
        try:
            gds_driver_open()
        except CuFileError as e:
            d.reason = f"cuFileDriverOpen failed: {e.strerror}"
            return d
        props = gds_driver_properties()
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
    d = open_driver()
    st = gds_status()
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


def refuse(fh: FileHandle, why: str) -> str:
    key = _file_key(fh)
    with cuda.lock:
        if key not in _refused:
            cuda.stats["files_refused"] += 1
        _refused[key] = why
        _refused.move_to_end(key)
        while len(_refused) > _REFUSED_MAX:
            _refused.popitem(last=False)
        cuda.stats["last_refusal"] = f"{fh.path}: {why}"
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
    if gds_file_registered(fh):
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
            return refuse(fh, "the file is not open with O_DIRECT (its filesystem refuses it)")
    try:
        gds_register_file(fh)
    except CuFileError as e:
        if want == "gds":
            raise
        return refuse(fh, f"cuFileHandleRegister refused it: {e.strerror}")
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
    d = open_driver()
    if d.mode is None or (d.mode == "compat" and defaults.settings.gpu_path == "auto"):
        return False
    flat = flat_bytes(tensor, "register()")
    base, n = flat.data_ptr(), flat.numel()
    with cuda.lock:
        if base in _registered:
            return True
        with torch.cuda.device(tensor.device):
            gds_buf_register(base, n, 0)
        _registered[base] = (n, tensor)
        bisect.insort(_registered_bases, base)
    return True


def deregister(tensor: Any) -> bool:
    """Undo :func:`register`; returns whether the tensor was registered."""
    if not is_cuda(tensor):
        return False
    base = tensor.data_ptr()
    with cuda.lock:
        if base not in _registered:
            return False
        import torch

        with torch.cuda.device(tensor.device):
            gds_buf_deregister(base)
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
    """Deregister every buffer and close the cuFile driver (files still
    registered keep it open until they close)."""
    global _driver
    with cuda.lock:
        if os.getpid() == _driver.pid:
            for base in list(_registered):
                with contextlib.suppress(CuFileError):
                    gds_buf_deregister(base)
            if _driver.mode is not None:
                with contextlib.suppress(CuFileError):
                    gds_driver_close()
        _registered.clear()
        _registered_bases.clear()
        _driver = _Driver()
        _refused.clear()


def driver_ready() -> bool:
    """Whether this process has opened (or tried to open) the cuFile driver."""
    return _driver.ready and _driver.pid == os.getpid()


def describe() -> dict[str, Any]:
    """This module's part of :func:`aionvme.gpu.stats` (call with cuda.lock held)."""
    d = _driver
    return dict(
        cufile_mode=d.mode if d.ready else None,
        cufile_reason=d.reason,
        files_remembered=len(_refused),
        registered_buffers=len(_registered),
    )


def _after_fork_in_child() -> None:
    global _driver
    gds_forget()
    _driver = _Driver()
    _registered.clear()
    _registered_bases.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the cuFile transfer -------------------------------------------------------------------------


def _gds_items(items: list[tuple[Any, int]]) -> tuple[list[Any], list[tuple[Any, int, int, int, int]]]:
    flats = [flat_bytes(t, "GPU transfer") for t, _ in items]
    out = []
    for f, (_, off) in zip(flats, items):
        n = f.numel()
        base, boff = _cufile_base(f.data_ptr(), n) if n else (f.data_ptr(), 0)
        out.append((f, base, boff, n, off))
    return flats, out


def _gds_block() -> int:
    return defaults.settings.gpu_block_size


async def gds(r: Reactor, fh: FileHandle, write: bool, items: list[tuple[Any, int]], params: Params) -> int:
    import torch

    flats, gitems = _gds_items(items)
    await cuda.after_current_streams(torch, {f.device for f in flats})
    req = gds_submit(r.engine, fh, gitems, write, _gds_block(), params[1])
    n: int = await r.submit(req)
    cuda.stats["gds_requests"] += 1
    cuda.stats["gds_bytes"] += n
    return n


def gds_sync(eng: Engine, fh: FileHandle, write: bool, items: list[tuple[Any, int]], params: Params) -> int:
    """The blocking twin of :func:`gds`."""
    torch = require_cuda("a CUDA tensor transfer")
    flats, gitems = _gds_items(items)
    for d in {f.device for f in flats}:
        torch.cuda.current_stream(d).synchronize()
    n = drive_request(gds_submit(eng, fh, gitems, write, _gds_block(), params[1]), eng)
    cuda.stats["gds_requests"] += 1
    cuda.stats["gds_bytes"] += n
    return n
