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

import atexit
import contextlib
from typing import Any

from ._runtime import cuda, cufile, pinned
from ._runtime.cufile import cufile_status, deregister, gds_choice, register, registered
from ._runtime.pinned import pin

# What users call. The runtime's plumbing (the transfers, the pinned pool,
# the library search, the bounce planner) stays in aionvme._runtime.
__all__ = [
    "cufile_status",
    "deregister",
    "gds_choice",
    "pin",
    "register",
    "registered",
    "shutdown",
    "stats",
]


def stats() -> dict[str, Any]:
    """Counters of this process's GPU transfers and the state of both paths."""
    with cuda.lock:
        out = dict(cuda.stats)
        out.update(cufile.describe())
        out["pool"] = pinned.describe()
    return out


def shutdown() -> None:
    """Deregister every buffer, close the cuFile driver (files still
    registered keep it open until they close) and forget the pinned pool.
    The next GPU transfer starts afresh. Also run at exit."""
    with cuda.lock:
        cufile.shutdown()
        pinned.forget()


def _at_exit() -> None:
    with contextlib.suppress(Exception):
        shutdown()


# Registered here, after the runtime modules' hooks: files still registered keep the driver open.
atexit.register(_at_exit)
