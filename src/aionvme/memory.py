"""Buffers on the fast path: page-aligned host memory as numpy arrays or
torch tensors, so O_DIRECT transfers go straight into them (no bounce copy)."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from ._engine import AlignedBuffer, recycle_limit
from ._runtime.pinned import pin

__all__ = ["AlignedBuffer", "empty", "is_aligned", "recycle_limit", "torch_dtype"]


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
