"""Buffers on the fast path: page-aligned host memory as numpy arrays or
torch tensors, so O_DIRECT transfers go straight into them (no bounce copy)."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from ._engine import AlignedBuffer, recycle_limit
from ._runtime.pinned import pin

__all__ = ["AlignedBuffer", "empty", "is_aligned", "populate", "recycle_limit", "torch_dtype"]


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype for a torch dtype, its name ('bfloat16') or a numpy dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and hasattr(torch, dtype):
        return getattr(torch, dtype)
    return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype


_torch_dtype = torch_dtype  # the name formats/ used before


def empty(
    shape: int | tuple[int, ...],
    dtype: Any = "uint8",
    *,
    like: str = "numpy",
    pinned: bool = False,
) -> Any:
    """A new uninitialized (in fact zero-filled) page-aligned array.

    Parameters
    ----------
    shape : int or tuple
        For ``dtype='uint8'`` an int is a byte count.
    dtype : numpy or torch dtype, or its name ('float16', 'bfloat16', ...)
    like : {'numpy', 'torch'}
    pinned : bool
        Also page-lock the memory for CUDA (``cudaHostRegister``), so copies
        to and from the GPU are asynchronous DMA: a tensor that is both on
        the zero-copy O_DIRECT path and a fast staging buffer. torch only;
        raises :class:`~aionvme.DeviceError` without CUDA.

    Notes
    -----
    The memory comes from an anonymous mmap: aligned to the page size, which
    satisfies O_DIRECT on every device, and freed when the last array or
    tensor viewing it goes away (pinned memory is unregistered from CUDA
    first). torch's own ``pin_memory=True`` memory comes from its caching
    host allocator, whose alignment is not documented: this one is aligned
    by construction.
    """
    shp = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(d < 0 for d in shp):
        raise ValueError(f"negative dimension in shape {shp}")
    count = math.prod(shp)
    if like == "numpy":
        if pinned:
            raise ValueError("pinned=True needs like='torch'")
        dt = np.dtype(dtype)
        return np.frombuffer(memoryview(AlignedBuffer(count * dt.itemsize)), dtype=dt, count=count).reshape(
            shp
        )
    if like == "torch":
        import torch

        tdt = torch_dtype(dtype)
        itemsize = torch.empty(0, dtype=tdt).element_size()
        buf = AlignedBuffer(count * itemsize)
        if pinned:
            pin(buf)  # DeviceError without CUDA; unpinned again just before the pages go
        raw = np.frombuffer(memoryview(buf), dtype=np.uint8)
        return torch.from_numpy(raw).view(tdt).reshape(shp)
    raise ValueError(f"like must be 'numpy' or 'torch', got {like!r}")


def is_aligned(buf: Any, alignment: int = 4096) -> bool:
    """Whether buf's first byte sits on an alignment boundary."""
    from ._engine import buffer_info

    if "torch" in sys.modules:
        import torch

        if isinstance(buf, torch.Tensor):
            return bool(buf.data_ptr() % alignment == 0)
    addr, _ = buffer_info(buf)
    return bool(addr % alignment == 0)


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
_madvise: list[Any] = []  # libc's madvise, resolved at first use (None: missing or refused)


def populate(address: int, nbytes: int) -> bool:
    """Fault in the pages of ``[address, address + nbytes)`` (rounded out to
    whole pages) without changing their bytes: ``madvise(MADV_POPULATE_WRITE)``
    (Linux 5.14+), the GIL released. A hint for memory about to be filled
    (fresh memory faults in at 0.1-5 s/GiB on a VM, inside whatever fills
    it): False where madvise is missing or refuses (an older kernel,
    seccomp), and from then on without trying; the filling then faults the
    pages in itself. Never touches the bytes, so it may race a DMA or a
    receive landing in the same pages."""
    if not _madvise:
        fn = None
        try:
            import ctypes
            import ctypes.util

            fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _madvise.append(fn)
    fn = _madvise[0]
    if fn is None:
        return False
    if nbytes <= 0:
        return True
    first = address - address % 4096
    if fn(first, -(-(address + nbytes - first) // 4096) * 4096, _MADV_POPULATE_WRITE) != 0:
        _madvise[0] = None  # refused once (EINVAL before 5.14, EPERM): it will be refused again
        return False
    return True
