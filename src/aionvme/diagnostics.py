"""What this machine offers aionvme, as a dict (``aionvme info`` prints it).

Probes are cheap and side-effect free: io_setup/io_destroy of one event,
io_uring_setup of one entry, a 4 KiB O_DIRECT write and read of a temporary
file in the given directory (removed after). CUDA is never initialised in
the calling process: cuFile's driver is opened by a child process (unless
this process has opened it already), the GPU is listed through torch if it
is importable, else /proc/driver/nvidia.
"""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import os
import platform
import resource
import sys
import tempfile
from typing import Any

from . import defaults, gpu
from ._engine import aio_probe, fs_type, fstatx, uring_probe
from ._runtime.cufile import driver_ready, find_library, library_candidates, nvidia_driver_present
from ._runtime.opening import fs_name
from ._runtime.pinned import has_cap_ipc_lock, memlock_budget
from ._version import __version__
from .file import File
from .memory import empty

__all__ = ["info"]


_AIO_HINTS = {
    errno.ENOSYS: "the kernel has no AIO (CONFIG_AIO=n) or a seccomp filter/gVisor refuses io_setup",
    errno.EPERM: "a seccomp filter (container runtime) refuses io_setup",
    errno.EAGAIN: "fs.aio-max-nr is exhausted: raise it (sysctl fs.aio-max-nr=1048576)",
    errno.ENOMEM: "the kernel could not allocate an AIO context",
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def kernel_aio() -> dict[str, Any]:
    """Whether io_setup works here, and if not, the error and what it means."""
    err = aio_probe()
    if err is None:
        return {"available": True, "error": None, "hint": None}
    return {
        "available": False,
        "error": f"{errno.errorcode.get(err.errno or 0, err.errno)}: {err.strerror}",
        "hint": _AIO_HINTS.get(err.errno or 0),
    }


def engine_choice(aio_available: bool, uring_available: bool | None = None) -> dict[str, str]:
    """Which engine a new event loop would get under the current defaults, and why."""
    want = defaults.settings.engine
    if want == "thread":
        return {"engine": "thread", "reason": "defaults.engine is 'thread' (AIONVME_ENGINE)"}
    if want == "uring":
        if uring_available:
            return {
                "engine": "io_uring",
                "reason": "defaults.engine is 'uring': every transfer through io_uring",
            }
        return {
            "engine": "none",
            "reason": "defaults.engine is 'uring' but io_uring_setup fails: transfers will raise",
        }
    ring = (
        "; files served buffered (no O_DIRECT) go through io_uring, so page-cache hits complete at once"
        if want == "auto" and uring_available
        else ""
    )
    if aio_available:
        refill = (
            "; a C thread per engine refills the device while requests wait for slots (refill_thread)"
            if defaults.settings.refill_thread
            else "; the event loop does every refill (refill_thread off)"
        )
        return {
            "engine": "aio",
            "reason": "kernel AIO works (io_setup succeeded) and serves O_DIRECT" + ring + refill,
        }
    if want == "aio":
        return {
            "engine": "none",
            "reason": "defaults.engine is 'aio' but io_setup fails: transfers will raise",
        }
    return {
        "engine": "thread",
        "reason": "io_setup fails: the C worker-thread pool serves O_DIRECT transfers" + ring,
    }


def io_uring() -> dict[str, Any]:
    """Whether this process can set up an io_uring instance the way the engine
    does (IORING_OP_READ/WRITE, a registered eventfd), and if not why: ENOSYS
    (no io_uring), EPERM (a seccomp filter, as in Docker's default profile, or
    kernel.io_uring_disabled), EOPNOTSUPP (older than 5.6)."""
    disabled = _read_int("/proc/sys/kernel/io_uring_disabled")
    out: dict[str, Any] = {"io_uring_disabled": disabled}
    err = uring_probe()
    if err is None:
        out.update(available=True, error=None)
    else:
        e = err.errno or errno.ENOSYS
        out.update(available=False, error=f"{errno.errorcode.get(e, e)}: {os.strerror(e)}")
    return out


def path_info(path: str) -> dict[str, Any]:
    """Filesystem, O_DIRECT support and alignment for files created in path."""
    out: dict[str, Any] = {"path": os.path.abspath(path)}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        out["error"] = f"{path}: {e.strerror}"
        return out
    try:
        fst = fs_type(fd)
    finally:
        os.close(fd)
    out["filesystem"] = fs_name(fst)
    try:
        out.update(_probe_direct(path))
    except OSError as e:
        out["error"] = f"cannot probe a file in {path}: {e.strerror or e}"
    return out


def _probe_direct(path: str) -> dict[str, Any]:
    fd, name = tempfile.mkstemp(prefix=".aionvme-info-", dir=path)
    os.close(fd)
    try:
        st = fstatx_path(name)
        with File(name, "r+", direct=True) as f:
            f._loop_ok = True  # a 4 KiB probe: info() may be called from async code
            buf = empty(4096)
            buf[:] = 0xA5
            f.sync_pwrite(buf, 0)
            back = empty(4096)
            f.sync_pread(back, 0)
            info = f.info
        return {
            "o_direct": info.direct,
            "how": info.reason,
            "offset_align": info.align,
            "mem_align": info.mem_align,
            "statx_dioalign": (
                {"offset_align": st["dio_offset_align"], "mem_align": st["dio_mem_align"]}
                if st["dio_reported"]
                else None
            ),
            "roundtrip_ok": bool((back == buf).all()),
        }
    finally:
        os.unlink(name)


def fstatx_path(name: str) -> dict[str, Any]:
    fd = os.open(name, os.O_RDONLY)
    try:
        return fstatx(fd)
    finally:
        os.close(fd)


def limits() -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    max_nr, nr = _read_int("/proc/sys/fs/aio-max-nr"), _read_int("/proc/sys/fs/aio-nr")
    return {
        "aio_max_nr": max_nr,
        "aio_nr": nr,
        "aio_free": None if max_nr is None or nr is None else max_nr - nr,
        "memlock_soft": None if soft == resource.RLIM_INFINITY else soft,
        "memlock_hard": None if hard == resource.RLIM_INFINITY else hard,
        "cap_ipc_lock": has_cap_ipc_lock(),
    }


def cufile(probe: bool = True) -> dict[str, Any]:
    """libcufile: where it is, its version, and the mode transfers of CUDA
    tensors would get: 'gds' (GPUDirect DMA), 'compat' (cuFile's
    compatibility mode: aionvme's pinned bounce pipeline serves instead) or
    None (unavailable), with the reason.

    Opening the cuFile driver initialises CUDA, so unless this process has
    already opened it, the probe runs in a child process (with cuFile's log
    in a temporary file, whose last lines are reported).
    """
    found = find_library()
    out: dict[str, Any] = {
        "library": found,
        "available": found is not None,
        "candidates": library_candidates(),
        "version": None,
        "mode": None,
        "reason": "libcufile.so.0 not found" if found is None else "not probed",
        "probed": None,
    }
    if driver_ready():
        st = gpu.cufile_status()
        out.update(
            library=st["library"] or found, version=st["version"], mode=st["mode"], reason=st["reason"]
        )
        out.update(probed="in-process", properties=st["properties"])
        return out
    if found is None or not probe:
        return out
    if not os.environ.get("AIONVME_CUFILE_LIBRARY") and not nvidia_driver_present():
        out["reason"] = "no NVIDIA GPU driver here (/dev/nvidiactl and /proc/driver/nvidia are absent)"
        return out
    out.update(_probe_cufile())
    return out


def _probe_cufile(timeout: float = 120.0) -> dict[str, Any]:
    import json
    import subprocess

    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="aionvme-cufile-") as d:
        result, log = os.path.join(d, "status.json"), os.path.join(d, "cufile.log")
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("CUFILE_LOGFILE_PATH", log)
        code = f"from aionvme._runtime.cufile import probe_main; probe_main({result!r})"
        try:
            r = subprocess.run(
                [sys.executable, "-c", code], env=env, cwd=d, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"probed": "subprocess", "reason": f"the cuFile probe did not finish in {timeout:.0f} s"}
        out: dict[str, Any] = {"probed": "subprocess"}
        try:
            with open(result) as f:
                status = json.load(f)
        except (OSError, ValueError):
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            return {**out, "reason": f"the cuFile probe failed (exit {r.returncode}): {' | '.join(tail)}"}
        out.update(
            library=status.get("library"),
            version=status.get("version"),
            mode=status.get("mode"),
            reason=status.get("reason"),
            properties=status.get("properties"),
        )
        lines = []
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        printed = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
        out["log"] = (lines or printed)[-5:]
        return out


def gpus(init_cuda: bool = False) -> dict[str, Any]:
    """CUDA devices: through torch when it is installed, else the NVIDIA driver's /proc.
    Device properties need CUDA initialised in this process: only with
    ``init_cuda`` (the ``aionvme info`` command, a process of its own) or
    where it already is."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available() and not (init_cuda or torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            # get_device_name/properties would initialise CUDA in this
            # process (a fork after it cannot use CUDA): the driver's list
            names = _proc_gpu_models()
            return {
                "cuda": True,
                "devices": names or [f"{torch.cuda.device_count()} device(s)"],
                "source": f"/proc/driver/nvidia (torch CUDA {torch.version.cuda}, not initialised)",
                "details": [],
            }
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            names = [torch.cuda.get_device_name(i) for i in range(n)]
            details = []
            for i in range(n):
                p = torch.cuda.get_device_properties(i)
                details.append(
                    {
                        "index": i,
                        "name": p.name,
                        "capability": f"{p.major}.{p.minor}",
                        "memory_gib": round(p.total_memory / 2**30, 1),
                    }
                )
            return {
                "cuda": True,
                "devices": names,
                "source": f"torch.cuda (CUDA {torch.version.cuda})",
                "details": details,
            }
        return {
            "cuda": False,
            "devices": [],
            "source": f"torch {torch.__version__}: no CUDA device",
            "details": [],
        }
    devices = _proc_gpu_models()
    return {"cuda": bool(devices), "devices": devices, "source": "/proc/driver/nvidia", "details": []}


def _proc_gpu_models() -> list[str]:
    """The NVIDIA driver's GPUs ("Model:" of each, else its bus id), no CUDA involved."""
    gpus = "/proc/driver/nvidia/gpus"
    out = []
    for bus in sorted(os.listdir(gpus)) if os.path.isdir(gpus) else []:
        model = bus
        try:
            with open(os.path.join(gpus, bus, "information"), errors="replace") as f:
                for line in f:
                    if line.startswith("Model:"):
                        model = line.split(":", 1)[1].strip() or bus
                        break
        except OSError:
            pass
        out.append(model)
    return out


def _gpu_transfers() -> dict[str, Any]:
    """This process's CUDA tensor transfers: counters, files cuFile refused, the pinned pool."""
    st = gpu.stats()
    st["memlock_budget"] = memlock_budget()
    st["gpu_path"] = defaults.settings.gpu_path
    return st


def versions() -> dict[str, str | None]:
    return {
        "aionvme": __version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "uvloop": _version("uvloop"),
        "deepspeed": _version("deepspeed"),
    }


def info(path: str | None = None, *, init_cuda: bool = False) -> dict[str, Any]:
    """Everything ``aionvme info`` reports, as plain JSON-able data.

    Parameters
    ----------
    path : str, optional
        Directory whose filesystem, O_DIRECT support and alignment to probe
        (a 4 KiB temporary file is written and removed). Default: the
        current directory.
    init_cuda : bool
        Let torch initialise CUDA in this process for the GPUs' properties
        (capability, memory). Off by default: a process that forks after
        CUDA started cannot use CUDA in its children.
    """
    aio = kernel_aio()
    ring = io_uring()
    return {
        "versions": versions(),
        "kernel_aio": aio,
        "engine": engine_choice(aio["available"], ring["available"]),
        "io_uring": ring,
        "path": path_info(path or os.getcwd()),
        "limits": limits(),
        "cufile": cufile(),
        "gpu": gpus(init_cuda),
        "gpu_transfers": _gpu_transfers(),
        "defaults": defaults.get(),
        "platform": {"machine": platform.machine(), "executable": sys.executable},
    }
