"""torch.save records without torch.save's copies.

``FileSystemReader`` loads every tensor item of a checkpoint with
``torch.load`` on the item's byte range, so each range must be a whole
torch.save zip archive. Such an archive is a few small entries (the pickle, a
format version, the byte order) around one stored, uncompressed entry holding
the storage bytes, 64-byte aligned within the archive. Its bytes depend only on
the tensor's dtype, shape and strides, except the CRC of the data entry.

Writing: :func:`template` asks torch.save itself for the archive of a tensor
with ``torch.serialization.skip_data`` (which seeks over the storage bytes and
records CRC 0, as ``set_crc32_options(False)`` does; ``torch.load`` does not
check CRCs), so the archive is torch's own, byte for byte, and the storage
bytes can be written by aionvme straight from the tensor.

Reading: :func:`parse` finds the storage bytes of an archive from its first and
last few KiB (the central directory at the end names the entries and where
their local headers are; the pickle is read by a restricted unpickler that
accepts only what torch.save writes for one plain tensor). Anything else
(another writer, compression, a tensor subclass) gives None and the caller
falls back to ``torch.load``.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import threading
from dataclasses import dataclass
from typing import IO, Any, cast

import torch

__all__ = ["Layout", "Template", "parse", "template"]


@dataclass(frozen=True)
class Template:
    """A torch.save archive of one contiguous tensor, less its storage bytes.

    The archive is ``head + <nbytes of storage> + tail``; the storage bytes
    start at ``len(head)``, a multiple of 64.
    """

    head: bytes
    tail: bytes


class _Recorder(io.RawIOBase):
    """A write-only stream that keeps what torch.save writes around the seek
    over the storage bytes (skip_data mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[bytearray] = [bytearray()]
        self.pos = 0
        self.skipped = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        self.parts[-1] += bytes(b)
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self.pos + offset
        if whence not in (0, 1) or target < self.pos:
            raise io.UnsupportedOperation("torch.save seeked backwards")
        if target > self.pos:
            self.skipped += target - self.pos
            self.parts.append(bytearray())
        self.pos = target
        return self.pos


_cache: dict[tuple[torch.dtype, tuple[int, ...]], Template] = {}
_cache_lock = threading.Lock()
_CACHE_MAX = 4096


def template(dtype: torch.dtype, shape: tuple[int, ...]) -> Template | None:
    """The archive torch.save writes for a contiguous ``dtype`` tensor of
    ``shape``, without its storage bytes; None if torch's layout is not the
    expected one (the caller then writes a whole torch.save instead)."""
    key = (dtype, shape)
    with _cache_lock:
        got = _cache.get(key)
    if got is not None:
        return got
    # torch.empty does not touch the memory: a large one costs no page faults.
    probe = torch.empty(shape, dtype=dtype)
    nbytes = probe.numel() * probe.element_size()
    rec = _Recorder()
    with torch.serialization.skip_data():
        torch.save(probe, cast(IO[bytes], rec))
    del probe
    if nbytes == 0:
        if len(rec.parts) != 1:
            return None
        made = Template(bytes(rec.parts[0]), b"")
    else:
        if len(rec.parts) != 2 or rec.skipped != nbytes or len(rec.parts[0]) % 64:
            return None
        made = Template(bytes(rec.parts[0]), bytes(rec.parts[1]))
    with _cache_lock:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = made
    return made


# -- reading -------------------------------------------------------------------------

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry, 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory, 56 bytes
_LOCATOR64 = struct.Struct("<IIQI")  # zip64 end of central directory locator, 20 bytes
_SIG_LOCAL, _SIG_CENTRAL, _SIG_EOCD = 0x04034B50, 0x02014B50, 0x06054B50
_SIG_EOCD64, _SIG_LOCATOR64 = 0x06064B50, 0x07064B50


@dataclass(frozen=True)
class Layout:
    """Where a record's tensor is: its storage bytes start ``data_offset``
    bytes into the record; the tensor views them with these strides."""

    data_offset: int
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Unexpected(Exception):
    pass


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorDesc:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


# The typed storages torch.save names in its pickles (torch.FloatStorage, ...);
# newer dtypes (float8, uint16, ...) are saved as UntypedStorage with
# _rebuild_tensor_v3, which names the dtype itself.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


def _storage_dtype(module: str, name: str) -> torch.dtype:
    if module == "torch.storage" and name == "UntypedStorage":
        return torch.uint8
    if module == "torch" and name in _STORAGE_DTYPES:
        return _STORAGE_DTYPES[name]
    raise _Unexpected(name)


def _rebuild(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorDesc:
    """torch._utils._rebuild_tensor_v2's arguments: (..., requires_grad, backward_hooks[, metadata])."""
    if len(rest) > 2 and rest[2]:  # tensor metadata, e.g. the conj or neg bit: torch.load applies it
        raise _Unexpected("tensor metadata")
    if not isinstance(storage, _StorageRef):
        raise _Unexpected("rebuild arguments")
    return _geometry(storage, storage_offset, size, stride, rest[1:2], storage.dtype)


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorDesc:
    """torch._utils._rebuild_tensor_v3: (..., requires_grad, backward_hooks, dtype[, metadata])."""
    if len(rest) < 3 or not isinstance(rest[2], torch.dtype) or not isinstance(storage, _StorageRef):
        raise _Unexpected("rebuild_v3 arguments")
    if len(rest) > 3 and rest[3]:
        raise _Unexpected("tensor metadata")
    itemsize = torch.empty(0, dtype=rest[2]).element_size()
    if storage.dtype != torch.uint8 or storage.numel % itemsize:
        raise _Unexpected("rebuild_v3 storage")
    elems = _StorageRef(rest[2], storage.key, storage.numel // itemsize)
    return _geometry(elems, storage_offset, size, stride, rest[1:2], rest[2])


def _geometry(
    storage: Any, storage_offset: Any, size: Any, stride: Any, hooks: tuple[Any, ...], dtype: torch.dtype
) -> _TensorDesc:
    if not isinstance(storage, _StorageRef) or not isinstance(storage_offset, int):
        raise _Unexpected("rebuild arguments")
    if hooks and hooks[0]:
        raise _Unexpected("backward hooks")
    try:
        shp = tuple(int(s) for s in size)
        st = tuple(int(s) for s in stride)
    except TypeError:
        raise _Unexpected("size") from None
    if len(shp) != len(st) or any(s < 0 for s in shp) or any(s < 0 for s in st) or storage_offset < 0:
        raise _Unexpected("geometry")
    return _TensorDesc(storage, storage_offset, shp, st, dtype)


class _Probe(pickle.Unpickler):
    """Reads the pickle torch.save writes for one plain tensor, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if name.endswith("Storage"):
            return _StorageType(_storage_dtype(module, name))
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Unexpected(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and isinstance(pid[4], int)
        ):
            return _StorageRef(pid[1].dtype, pid[2], pid[4])
        raise _Unexpected("persistent id")


def _central(tail: bytes, length: int) -> dict[str, tuple[int, int, int]] | None:
    """name -> (local header offset, size, method) from the central directory
    in ``tail`` (the record's last ``len(tail)`` bytes)."""
    base = length - len(tail)  # record offset of tail[0]
    if len(tail) < _EOCD.size:
        return None
    sig, _, _, _, count, cd_size, cd_off, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if sig != _SIG_EOCD or comment:
        return None
    if cd_off == 0xFFFFFFFF or count == 0xFFFF:
        at = len(tail) - _EOCD.size - _LOCATOR64.size
        if at < 0:
            return None
        sig, _, eocd64, _ = _LOCATOR64.unpack_from(tail, at)
        p = eocd64 - base
        if sig != _SIG_LOCATOR64 or p < 0 or p + _EOCD64.size > len(tail):
            return None
        sig, _, _, _, _, _, _, count, cd_size, cd_off = _EOCD64.unpack_from(tail, p)
        if sig != _SIG_EOCD64:
            return None
    p = cd_off - base
    if p < 0 or p + cd_size > len(tail):
        return None
    out: dict[str, tuple[int, int, int]] = {}
    for _ in range(count):
        if p + _CENTRAL.size > len(tail):
            return None
        f = _CENTRAL.unpack_from(tail, p)
        if f[0] != _SIG_CENTRAL:
            return None
        method, csize, usize, nlen, xlen, clen, loff = f[4], f[8], f[9], f[10], f[11], f[12], f[16]
        name = tail[p + _CENTRAL.size : p + _CENTRAL.size + nlen].decode("utf-8", "replace")
        extra = tail[p + _CENTRAL.size + nlen : p + _CENTRAL.size + nlen + xlen]
        if 0xFFFFFFFF in (usize, csize, loff):  # zip64 extra field: the 0xFFFFFFFF ones, in order
            q = 0
            while q + 4 <= len(extra):
                hid, hlen = struct.unpack_from("<HH", extra, q)
                if hid == 1:
                    vals = list(struct.unpack_from(f"<{hlen // 8}Q", extra, q + 4))
                    if usize == 0xFFFFFFFF and vals:
                        usize = vals.pop(0)
                    if csize == 0xFFFFFFFF and vals:
                        csize = vals.pop(0)
                    if loff == 0xFFFFFFFF and vals:
                        loff = vals.pop(0)
                    break
                q += 4 + hlen
        if csize != usize:
            return None
        out[name] = (loff, usize, method)
        p += _CENTRAL.size + nlen + xlen + clen
    return out


def _entry_data(head: bytes, loff: int) -> int | None:
    """Record offset of an entry's bytes, from its local header (in head)."""
    if loff + _LOCAL.size > len(head):
        return None
    f = _LOCAL.unpack_from(head, loff)
    if f[0] != _SIG_LOCAL:
        return None
    start: int = loff + _LOCAL.size + f[9] + f[10]
    return start


def parse(head: bytes, tail: bytes, length: int) -> Layout | None:
    """The layout of a torch.save record of ``length`` bytes, given its first
    bytes (``head``) and last bytes (``tail``); None where it is not a plain,
    uncompressed, little-endian single-tensor archive found in those bytes."""
    try:
        entries = _central(tail, length)
        if entries is None:
            return None
        names = {n.split("/", 1)[1] if "/" in n else n: v for n, v in entries.items()}
        pkl = names.get("data.pkl")
        if pkl is None or pkl[2] != 0:
            return None
        begin = _entry_data(head, pkl[0])
        if begin is None or begin + pkl[1] > len(head):
            return None
        order = names.get("byteorder")
        if order is not None:
            ob = _entry_data(head, order[0])
            if ob is None or ob + order[1] > len(head) or head[ob : ob + order[1]] != b"little":
                return None
        desc = _Probe(io.BytesIO(head[begin : begin + pkl[1]])).load()
        if not isinstance(desc, _TensorDesc):
            return None
        data = names.get(f"data/{desc.storage.key}")
        if data is None or data[2] != 0:
            return None
        itemsize = torch.empty(0, dtype=desc.dtype).element_size()
        if data[1] != desc.storage.numel * itemsize:
            return None
        start = _entry_data(head, data[0])
        if start is None or start + data[1] > length:
            return None
        if desc.size and all(s > 0 for s in desc.size):
            last = desc.storage_offset + sum((s - 1) * st for s, st in zip(desc.size, desc.stride))
            if last >= desc.storage.numel:
                return None
        return Layout(start, desc.dtype, desc.storage.numel, desc.storage_offset, desc.size, desc.stride)
    except (_Unexpected, pickle.UnpicklingError, EOFError, struct.error, ValueError, AttributeError):
        return None
