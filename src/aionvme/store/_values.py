"""What a stored value is (numpy array or torch tensor: dtype, shape, device)
and how its bytes are seen: flat uint8 views, fresh results, views of store memory."""

from __future__ import annotations

import ast
import functools
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._engine import AlignedBuffer, buffer_info
from ..exceptions import BufferTypeError, DeviceError, NonContiguousBufferError, import_torch
from ._alloc import round_up
from ._errors import OutBufferError, StoreKeyTypeError

PAGE = 4096

__all__ = ["Meta", "describe", "flat_bytes", "is_cuda", "result_like", "view_as"]


@dataclass(frozen=True)
class Meta:
    """``kind`` 'numpy' or 'torch'; ``dtype`` its name ('float32', 'bfloat16');
    ``shape``; ``nbytes``."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_json(self) -> list[Any]:
        return [self.kind, self.dtype, list(self.shape), self.nbytes]

    @classmethod
    def from_json(cls, v: Any) -> Meta:
        """The Meta of an index record, checked: ValueError for any other shape
        (wrong types, a dtype no library knows, a byte count that does not
        match the shape)."""
        if not isinstance(v, list) or len(v) != 4:
            raise ValueError(f"a value's meta is [kind, dtype, shape, nbytes], not {v!r:.80}")
        kind, dtype, shape, nbytes = v
        if kind not in ("numpy", "torch") or not isinstance(dtype, str) or not isinstance(shape, list):
            raise ValueError(f"bad meta {v!r:.80}")
        if not all(_count(d) for d in shape) or not _count(nbytes) or len(shape) > 64:
            raise ValueError(f"bad shape or byte count in {v!r:.80}")
        try:
            item = np_dtype(dtype).itemsize if kind == "numpy" else _torch_itemsize(dtype)
        except (TypeError, ValueError, SyntaxError, BufferTypeError, MemoryError, RecursionError) as e:
            raise ValueError(f"unknown dtype {dtype!r:.80}: {e}") from None
        if math.prod(shape) * item != nbytes:
            raise ValueError(f"{nbytes} bytes is not shape {shape} of {dtype!r:.80}")
        return cls(kind, dtype, tuple(shape), nbytes)


def _count(n: object) -> bool:
    return type(n) is int and 0 <= n < 1 << 62


@functools.lru_cache(maxsize=64)
def _torch_itemsize(name: str) -> int:
    return int(torch_module().empty(0, dtype=torch_dtype(name)).element_size())


def dtype_name(dt: np.dtype[Any]) -> str:
    """How Meta names a numpy dtype: ``dtype.str`` ('<f4'), or for a
    structured dtype (whose ``str`` is a bare '|V12') ``'npy:'`` and its
    .npy-format description (field names, types, offsets)."""
    if dt.fields is None:
        return dt.str
    return "npy:" + repr(np.lib.format.dtype_to_descr(dt))


@functools.lru_cache(maxsize=512)
def np_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a Meta's dtype name (see :func:`dtype_name`)."""
    if name.startswith("npy:"):
        return np.lib.format.descr_to_dtype(ast.literal_eval(name[4:]))
    return np.dtype(name)


def torch_module() -> Any:
    """The torch module, or TorchNotInstalledError saying what to do instead."""
    return import_torch(
        "the value was stored as a torch tensor, or like='torch' (the default) asks for one; "
        "pass like='numpy' to attach, or install torch (pip install 'aionvme[torch]')"
    )


def _is_tensor(v: object) -> bool:
    return "torch" in sys.modules and isinstance(v, torch_module().Tensor)


def is_cuda(v: object) -> bool:
    return _is_tensor(v) and v.device.type == "cuda"  # type: ignore[attr-defined]


def describe(value: Any) -> Meta:
    """The Meta of a value the store accepts; BufferTypeError for anything else."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise BufferTypeError("object arrays cannot be stored (no fixed bytes)")
        return Meta("numpy", dtype_name(value.dtype), tuple(value.shape), int(value.nbytes))
    if _is_tensor(value):
        t = value
        if t.is_sparse or t.layout != torch_module().strided:
            raise BufferTypeError(f"only strided (dense) tensors can be stored, got {t.layout}")
        name = str(t.dtype).removeprefix("torch.")
        return Meta("torch", name, tuple(t.shape), int(t.numel() * t.element_size()))
    raise BufferTypeError(
        "TieredStore stores numpy arrays and torch tensors, "
        f"got {type(value).__module__}.{type(value).__name__}"
    )


def flat_bytes(value: Any) -> Any:
    """A contiguous 1-D uint8 view of the value's bytes (a copy only if it is not contiguous)."""
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        return a.reshape(-1).view(np.uint8)
    t = value.contiguous().reshape(-1)
    return t.view(torch_module().uint8)


def torch_dtype(name: str) -> Any:
    torch = torch_module()
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise BufferTypeError(f"unknown torch dtype {name!r}")
    return dt


def view_as(raw: Any, meta: Meta) -> Any:
    """The value of ``meta`` viewing the first nbytes of ``raw`` (a 1-D uint8
    numpy array or torch tensor): no copy."""
    if meta.kind == "numpy":
        a = raw if isinstance(raw, np.ndarray) else raw.numpy()
        return a[: meta.nbytes].view(np_dtype(meta.dtype)).reshape(meta.shape)
    torch = torch_module()
    t = raw if _is_tensor(raw) else torch.from_numpy(raw)
    t = t[: meta.nbytes]
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=t.device)
    return t.view(torch_dtype(meta.dtype)).reshape(meta.shape)


def result_like(meta: Meta, device: str, aligned: bool, nbytes: int | None = None) -> tuple[Any, Any]:
    """(value, raw) for a fresh result: ``raw`` a 1-D uint8 buffer of at least
    ``nbytes`` (default meta.nbytes) bytes, ``value`` the meta-shaped view of it.
    ``aligned``: page-aligned host memory (O_DIRECT reads land in it directly)."""
    n = meta.nbytes if nbytes is None else nbytes
    dev = str(device)
    if meta.kind == "numpy":
        if dev != "cpu":
            raise DeviceError(f"a numpy value can only be returned on 'cpu', not {device!r}")
        raw = _aligned_numpy(n) if aligned else np.empty(n, np.uint8)
        return view_as(raw, meta), raw
    torch = torch_module()
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(f"device={device!r} but CUDA is not available")
        raw = torch.empty(n, dtype=torch.uint8, device=dev)
    elif dev == "cpu":
        raw = _aligned_torch(n) if aligned else torch.empty(n, dtype=torch.uint8)
    else:
        raise DeviceError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return view_as(raw, meta), raw


# Results are page-aligned, on the zero-copy O_DIRECT path. Below RECYCLE_MIN
# they are views into slightly larger malloc'd blocks: as fast to allocate as
# np.empty (glibc reuses its heap blocks). From it, recycled mappings
# (AlignedBuffer(recycle=True)): glibc maps blocks of 32 MiB and more afresh
# every time, and a fresh mapping costs a page fault and the zeroing of every
# page before the read can land (a 64 MiB get: 23 ms of CPU, against 1 ms for
# the read into memory used before); a result freed by the caller gives its
# mapping to the next result of its size.
RECYCLE_MIN = 1 << 20


def _aligned_numpy(n: int) -> Any:
    if n >= RECYCLE_MIN:
        return np.frombuffer(memoryview(AlignedBuffer(n, recycle=True)), np.uint8)
    raw = np.empty(n + PAGE, np.uint8)
    off = -raw.ctypes.data % PAGE
    return raw[off : off + n]


def _aligned_torch(n: int) -> Any:
    torch = torch_module()
    if n >= RECYCLE_MIN:
        return torch.from_numpy(_aligned_numpy(n))
    raw = torch.empty(n + PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % PAGE
    return raw[off : off + n]


def result_span(meta: Meta, phase: int) -> tuple[Any, Any, Any]:
    """(value, raw, span) for a fresh CPU result of a value whose extent on
    NVMe starts ``phase`` bytes into a page: ``span`` the page-aligned whole
    pages around it (``raw`` starts ``phase`` bytes into it), so one O_DIRECT
    read of the extent's pages fills it with no bounce."""
    n = meta.nbytes
    whole = round_up(phase + n)
    span = _aligned_numpy(whole) if meta.kind == "numpy" else _aligned_torch(whole)
    raw = span[phase : phase + n]
    return view_as(raw, meta), raw, span


def address(buf: Any) -> int:
    """The address of a host buffer's first byte (a numpy array or a CPU
    tensor), 0 for anything else (a CUDA tensor)."""
    if isinstance(buf, np.ndarray):
        if buf.flags.c_contiguous:
            return int(buffer_info(buf)[0])  # 0.1 µs; ndarray.ctypes.data builds an object: 3 µs
        return int(buf.ctypes.data)
    if _is_tensor(buf) and buf.device.type == "cpu":
        return int(buf.data_ptr())
    return 0


_U8 = np.dtype(np.uint8)


def _same_dtype(name: str, meta: Meta) -> bool:
    """Whether an ``out`` of dtype ``name`` (numpy's or torch's name for it)
    holds the value's dtype."""
    if meta.kind == "numpy":
        return name == np_dtype(meta.dtype).name and not np_dtype(meta.dtype).fields
    return name == meta.dtype


def _refuse(out_dtype: object, meta: Meta) -> OutBufferError:
    return OutBufferError(
        f"out is {out_dtype}, the value {meta.dtype} {meta.shape}: give an out of the value's "
        "dtype, or uint8 for its raw bytes"
    )


def check_out(out: Any, meta: Meta) -> Any:
    """The flat uint8 view of a caller's ``out`` buffer, after checking it
    fits: the same number of bytes (any shape), and the value's dtype or
    uint8 (a copy of the raw bytes); OutBufferError (a ValueError) if not."""
    if isinstance(out, np.ndarray):
        # the hot path of a host-tier hit: only what a copy needs (describe()
        # builds a Meta, ~1.5 µs, of which only nbytes matters here)
        dt = out.dtype
        if dt.hasobject:
            raise BufferTypeError("object arrays cannot be stored (no fixed bytes)")
        if out.nbytes != meta.nbytes:
            raise OutBufferError(f"out has {out.nbytes} bytes, the value {meta.nbytes}")
        if dt != _U8 and not (
            dt == np_dtype(meta.dtype) if meta.kind == "numpy" else _same_dtype(dt.name, meta)
        ):
            raise _refuse(dt, meta)
        flags = out.flags
        if not flags.c_contiguous:
            raise NonContiguousBufferError("out must be C-contiguous")
        if not flags.writeable:
            raise BufferTypeError("out is read-only")
        # frombuffer: the same bytes as out.reshape(-1).view(uint8), in half the time
        return np.frombuffer(out, np.uint8) if out.nbytes else out.reshape(-1).view(np.uint8)
    m = describe(out)
    if m.nbytes != meta.nbytes:
        raise OutBufferError(f"out has {m.nbytes} bytes, the value {meta.nbytes}")
    if m.dtype != "uint8" and not _same_dtype(m.dtype, meta):
        raise _refuse(out.dtype, meta)
    if not out.is_contiguous():
        raise NonContiguousBufferError("out must be contiguous")
    return out.reshape(-1).view(torch_module().uint8)


# the largest int key a persistent store takes (its journal writes it in
# decimal; Python refuses to parse more than 4300 digits by default)
INT_KEY_BITS = 4096


def check_keys(keys: Any, persist: bool) -> None:
    """Keys: any hashable in a scratch store; str, bytes or int (block
    hashes, of up to INT_KEY_BITS bits) in a persistent one, whose journal
    records each with its type: StoreKeyTypeError if not."""
    if persist:
        for k in keys:
            if type(k) is int:
                if k.bit_length() > INT_KEY_BITS:
                    raise StoreKeyTypeError(
                        f"a persistent store takes int keys of up to {INT_KEY_BITS} bits, "
                        f"got one of {k.bit_length()}"
                    )
            elif not isinstance(k, (str, bytes)):
                raise StoreKeyTypeError(
                    f"a persistent store takes str, bytes or int keys, got {type(k).__name__}"
                )


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
