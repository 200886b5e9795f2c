"""Tensors <-> bytes for the formats: what a value to save looks like as raw
little-endian bytes, and how bytes read from a file become numpy arrays or
torch tensors. torch is imported only when a torch tensor is involved."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..exceptions import DeviceError, TorchNotInstalledError, import_torch
from ._header import DTYPES, NUMPY_CODES, TORCH_CODES, DType, SafetensorsError, TensorInfo

__all__ = [
    "LIKE_NUMPY",
    "Source",
    "TorchNotInstalledError",
    "check_device",
    "is_torch_tensor",
    "materialize",
    "require_torch",
    "source_of",
    "torch_dtype",
]


def require_torch(hint: str) -> Any:
    """The torch module, or TorchNotInstalledError saying what to do instead."""
    return import_torch(hint)


LIKE_NUMPY = (
    "like='torch' (the default) makes torch tensors; pass like='numpy' for numpy arrays, "
    "or install torch (pip install 'aionvme[torch]')"
)


def is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


@dataclass
class Source:
    """One value to save: its safetensors dtype, header shape and size, and
    the value itself. Nothing is copied until :meth:`host_bytes` or
    :meth:`copy_into` is called."""

    name: str
    code: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str  # "torch" or "numpy": what a checkpoint load gives back
    value: Any

    @property
    def dtype(self) -> DType:
        return DTYPES[self.code]

    def host_bytes(self) -> np.ndarray:
        """The value's bytes as a flat uint8 array in host memory (C order,
        little-endian): a view where the value already is that, else a copy
        (CUDA to host, non-contiguous to contiguous, big- to little-endian)."""
        if self.kind == "numpy":
            arr = self.value
            if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            flat: np.ndarray = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            return flat
        import torch

        t = self.value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        host: np.ndarray = _resolved(t).contiguous().reshape(-1).view(torch.uint8).numpy()
        return host

    def copy_into(self, dst: np.ndarray, dst_torch: Any) -> None:
        """Copy the bytes into ``dst`` (uint8, nbytes long); ``dst_torch`` is
        the same memory as a torch tensor when torch is in use (its copy_ runs
        on several threads and copies straight from CUDA memory)."""
        if self.nbytes == 0:
            return
        if self.kind == "numpy":
            np.copyto(dst, self.host_bytes())
            return
        import torch

        t = _resolved(self.value.detach())
        if not t.is_contiguous():
            t = t.contiguous()
        src = t.reshape(-1).view(torch.uint8)
        dst_torch.copy_(src, non_blocking=src.device.type == "cuda" and dst_torch.is_pinned())


def _resolved(t: Any) -> Any:
    if t.is_complex():
        t = t.resolve_conj()
    return t.resolve_neg()


def source_of(name: str, value: Any) -> Source:
    """Describe a torch tensor or numpy array for writing (no copy yet).

    The bytes written are the value's in C order and little-endian: CUDA
    tensors are copied to the host, non-contiguous values made contiguous and
    big-endian numpy arrays byte-swapped as they are written.
    """
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__}: {name!r}")
    if is_torch_tensor(value):
        return _torch_source(name, value)
    if isinstance(value, np.ndarray):
        return _numpy_source(name, value)
    raise TypeError(f"{name!r}: expected a torch tensor or numpy array, got {type(value).__name__}")


def _numpy_source(name: str, arr: np.ndarray) -> Source:
    code = NUMPY_CODES.get(arr.dtype.name)
    if code is None or arr.dtype.hasobject:
        raise SafetensorsError(
            f"numpy dtype {arr.dtype} has no safetensors equivalent (supported: {', '.join(NUMPY_CODES)})",
            tensor=name,
        )
    return Source(name, code, tuple(arr.shape), int(arr.nbytes), "numpy", arr)


def _torch_source(name: str, t: Any) -> Source:
    import torch

    if t.layout != torch.strided:
        raise SafetensorsError(f"{t.layout} tensors cannot be saved; convert with .to_dense()", tensor=name)
    if t.device.type == "meta":
        raise SafetensorsError("a tensor on the meta device has no data to save", tensor=name)
    tname = str(t.dtype).rsplit(".", 1)[-1]
    code = TORCH_CODES.get(tname)
    if code is None:
        raise SafetensorsError(
            f"torch dtype {t.dtype} has no safetensors equivalent (supported: {', '.join(TORCH_CODES)})",
            tensor=name,
        )
    shape = tuple(t.shape)
    if code == "F4":  # torch packs two 4-bit values per element; the header counts values
        if not shape:
            raise SafetensorsError("a 0-d float4_e2m1fn_x2 tensor has no F4 shape", tensor=name)
        shape = (*shape[:-1], shape[-1] * 2)
    return Source(name, code, shape, t.numel() * t.element_size(), "torch", t)


def torch_dtype(code: DType, filename: object, name: str) -> Any:
    torch = require_torch(LIKE_NUMPY)

    tdt = getattr(torch, code.torch, None) if code.torch is not None else None
    if tdt is None:
        raise SafetensorsError(
            f"dtype {code.code} has no torch dtype in torch {torch.__version__}", filename, name
        )
    return tdt


def check_device(device: Any, like: str) -> Any:
    """Validate ``device`` before any I/O. Returns a torch.device, or None
    for the host. Asking for CUDA without CUDA raises DeviceError."""
    if like not in ("torch", "numpy"):
        raise ValueError(f"like must be 'torch' or 'numpy', got {like!r}")
    if device is None or (isinstance(device, str) and device == "cpu"):
        return None
    if like == "numpy":
        raise DeviceError(f"numpy arrays live on the host: device={device!r} needs like='torch'")
    torch = require_torch(LIKE_NUMPY)
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device={device!r} needs CUDA, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}; a CPU-only build or no visible GPU)"
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise DeviceError(f"device={device!r}: only {n} CUDA device(s) are visible")
    return dev


def materialize(
    info: TensorInfo,
    mem: memoryview,
    pos: int,
    like: str,
    filename: object,
) -> Any:
    """The tensor ``info`` whose bytes sit at ``mem[pos:pos + nbytes]``.

    A view of ``mem`` (no copy) when ``pos`` is a multiple of the dtype's
    item size, which holds for every file the reference writer produces;
    otherwise an aligned copy, because unaligned tensors break vectorized
    kernels. Each tensor gets its own storage object (so ``torch.save`` of one
    of them writes its bytes only, and safetensors does not see "shared"
    tensors), all keeping the one allocation alive.
    """
    dt = info.dtype
    n = info.nbytes
    if like == "numpy":
        if dt.numpy is None:
            raise SafetensorsError(
                f"dtype {dt.code} has no numpy equivalent; load with like='torch'", filename, info.name
            )
        npdt = np.dtype(dt.numpy)
        if n == 0:
            try:
                return np.empty(info.shape, dtype=npdt)
            except (ValueError, TypeError, OverflowError, MemoryError) as e:
                raise SafetensorsError(
                    f"shape {list(info.shape)} cannot be a numpy array ({e})", filename, info.name
                ) from None
        arr = np.frombuffer(mem[pos : pos + n], dtype=npdt).reshape(info.shape)
        return arr if pos % npdt.itemsize == 0 else arr.copy()

    torch = require_torch(LIKE_NUMPY)

    tdt = torch_dtype(dt, filename, info.name)
    shape = info.shape
    if dt.code == "F4":
        if not shape or shape[-1] % 2:
            raise SafetensorsError(
                f"F4 shape {list(shape)}: torch packs F4 two per byte and needs an even last dimension",
                filename,
                info.name,
            )
        shape = (*shape[:-1], shape[-1] // 2)
    if n == 0 or math.prod(shape) == 0:
        try:
            return torch.empty(shape, dtype=tdt)
        except (RuntimeError, TypeError, ValueError, OverflowError) as e:
            raise SafetensorsError(
                f"shape {list(shape)} cannot be a torch tensor ({e})", filename, info.name
            ) from None
    raw = mem[pos : pos + n]
    if pos % dt.itemsize == 0:
        return torch.frombuffer(raw, dtype=tdt).reshape(shape)
    out = torch.empty(shape, dtype=tdt)
    out.view(-1).view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return out
