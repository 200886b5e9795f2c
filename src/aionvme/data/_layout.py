"""What every reader of :mod:`aionvme.data` gives the loader: where each
sample's fields lie (file, offset, length, dtype, shape), as numpy arrays so a
million samples cost no million Python objects, and the files with what they
looked like when they were opened (to see them change)."""

from __future__ import annotations

import collections
import dataclasses
import os
import stat
from collections.abc import Callable
from typing import Any

import numpy as np

from ..file import File
from ._errors import CorruptDatasetError, DatasetChangedError

ALIGN = 4096  # field alignment in shards and batch buffers: O_DIRECT on every device


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def open_member(root: str, name: object, where: str, what: str) -> tuple[str, int, os.stat_result]:
    """Open a file an index names, confined to the dataset directory.

    ``root`` is the directory's real path; ``name`` comes from an untrusted
    index. Refused (:class:`CorruptDatasetError` naming ``where``): a name
    that is not a non-empty relative path, one with a ``..`` part, one
    that resolves (through symbolic links) outside ``root``, and anything
    but a regular file (a FIFO would block the open). The file is opened
    without following a link in its last part (``O_NOFOLLOW``), so a link
    swapped in after the check is refused, and ``O_NONBLOCK`` (a FIFO
    swapped in opens without blocking, then fails the regular-file check).
    Returns (real path, fd, fstat of that fd); FileNotFoundError passes
    through for the caller to word.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorruptDatasetError(f"{what} {name!r} is not a file name", where)
    if os.path.isabs(name) or ".." in name.replace(os.sep, "/").split("/"):
        raise CorruptDatasetError(f"{what} {name!r} is outside the dataset directory", where)
    real = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([real, root]) != root or real == root:
        raise CorruptDatasetError(f"{what} {name!r} leads outside the dataset directory (to {real})", where)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise CorruptDatasetError(f"{what} {name!r} cannot be opened: {e.strerror}", real) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptDatasetError(f"{what} {name!r} is not a regular file", real)
    return real, fd, st


def read_member(root: str, name: str, what: str) -> tuple[str, bytes]:
    """A whole file of the dataset (an index), confined as :func:`open_member`."""
    real, fd, _ = open_member(root, name, os.path.join(root, name), what)
    try:
        parts = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            parts.append(b)
    finally:
        os.close(fd)
    return real, b"".join(parts)


@dataclasses.dataclass
class Field:
    """A field read straight from the files: one byte range per sample."""

    name: str
    dtype: str  # numpy dtype name, or a torch-only name ("bfloat16", "float8_e4m3fn")
    itemsize: int
    ndim: int
    shape: tuple[int, ...] | None  # None: the shape varies between samples
    file: np.ndarray[Any, Any]  # int64 [n]: index into Layout.files
    offset: np.ndarray[Any, Any]  # int64 [n]
    nbytes: np.ndarray[Any, Any]  # int64 [n]
    shapes: np.ndarray[Any, Any] | None = None  # int64 [n, ndim] when shape is None
    crc: np.ndarray[Any, Any] | None = None  # uint32 [n] (crc32 of the field's bytes), aionvme format


@dataclasses.dataclass
class DecodedField:
    """A field decoded from a sample's raw bytes (MDS columns read as a whole sample).

    kind: "fixed" (a numeric array of one dtype and shape: stacked), "array"
    (an array whose shape varies: a list), "object" (bytes, str, int...: a list).
    """

    name: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclasses.dataclass
class Decoded:
    """Fields that are decoded from one raw byte range per sample."""

    file: np.ndarray[Any, Any]
    offset: np.ndarray[Any, Any]
    nbytes: np.ndarray[Any, Any]
    fields: dict[str, DecodedField]
    decode: Callable[[memoryview, int], dict[str, Any]]  # (sample bytes, sample index) -> values


@dataclasses.dataclass
class FileStat:
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStat:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclasses.dataclass
class Layout:
    kind: str  # "aionvme", "mds", "npy", "safetensors"
    root: str
    files: list[str]
    stats: list[FileStat]
    n: int
    fields: dict[str, Field]
    decoded: Decoded | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return list(self.fields) + (list(self.decoded.fields) if self.decoded is not None else [])

    def sample_nbytes(self) -> np.ndarray[Any, Any]:
        """Bytes each sample occupies in batch memory (every part rounded up to ALIGN)."""
        total = np.zeros(self.n, dtype=np.int64)
        for f in self.fields.values():
            total += (f.nbytes + (ALIGN - 1)) // ALIGN * ALIGN
        if self.decoded is not None:
            total += (self.decoded.nbytes + (ALIGN - 1)) // ALIGN * ALIGN
        return total

    def data_nbytes(self) -> int:
        """Bytes of sample data (no padding)."""
        t = sum(int(f.nbytes.sum()) for f in self.fields.values())
        if self.decoded is not None:
            t += int(self.decoded.nbytes.sum())
        return t

    def changed(self, i: int) -> str | None:
        """Why file i no longer is the file that was opened, or None."""
        path, old = self.files[i], self.stats[i]
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return "file removed"
        except OSError as e:
            return f"cannot stat: {e.strerror}"
        if (st.st_dev, st.st_ino) != (old.dev, old.ino):
            return "file replaced"
        if st.st_size != old.size:
            return f"file size changed from {old.size} to {st.st_size} bytes"
        if st.st_mtime_ns != old.mtime_ns:
            return "file modified"
        return None

    def check_unchanged(self, i: int, sample: int | None = None) -> None:
        why = self.changed(i)
        if why is not None:
            raise DatasetChangedError(f"dataset file changed under the reader ({why})", self.files[i], sample)


class FileCache:
    """Open files of a layout, at most ``limit`` at once (a directory of a
    million .npy files must not exhaust fds). A file opened (again) must still
    be the file the layout was made from."""

    def __init__(self, layout: Layout, limit: int = 256) -> None:
        self.layout = layout
        self.limit = limit
        self._open: collections.OrderedDict[int, File] = collections.OrderedDict()

    def get(self, i: int, sample: int | None = None) -> File:
        f = self._open.get(i)
        if f is not None:
            self._open.move_to_end(i)
            return f
        try:
            f = File(self.layout.files[i], "r")
        except FileNotFoundError:
            raise DatasetChangedError(
                "dataset file changed under the reader (file removed)", self.layout.files[i], sample
            ) from None
        old = self.layout.stats[i]
        st = os.fstat(f.fileno())
        if (st.st_dev, st.st_ino, st.st_size) != (old.dev, old.ino, old.size):
            f.close()
            self.layout.check_unchanged(i, sample)
            raise DatasetChangedError("dataset file changed under the reader", self.layout.files[i], sample)
        self._open[i] = f
        while len(self._open) > self.limit:
            _, old_f = self._open.popitem(last=False)
            old_f.close()  # transfers in flight finish first
        return f

    def close(self) -> None:
        while self._open:
            _, f = self._open.popitem()
            f.close()


# -- output types ---------------------------------------------------------------------

_torch_dtypes: dict[str, Any] = {}


def torch_dtype(name: str) -> Any:
    t = _torch_dtypes.get(name)
    if t is None:
        import torch

        t = getattr(torch, name, None)
        if t is None or not isinstance(t, torch.dtype):
            t = torch.from_numpy(np.empty(0, dtype=np.dtype(name))).dtype
        _torch_dtypes[name] = t
    return t


def has_numpy_dtype(name: str) -> bool:
    try:
        np.dtype(name)
    except TypeError:
        return False
    return True


def typed(flat: Any, dtype: str, shape: tuple[int, ...], tensors: str) -> Any:
    """A view of flat uint8 memory as an array/tensor of dtype and shape (no copy)."""
    if not isinstance(flat, np.ndarray):  # a torch tensor (CUDA batch memory)
        return flat.view(torch_dtype(dtype)).reshape(shape)
    if tensors == "numpy":
        return flat.view(np.dtype(dtype)).reshape(shape)
    import torch

    return torch.from_numpy(flat).view(torch_dtype(dtype)).reshape(shape)
