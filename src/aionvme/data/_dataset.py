"""Dataset: one sample-indexed view over an aionvme dataset, MDS shards, or a
directory of .npy / .safetensors files."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np

from .._runtime.background import run as run_blocking
from ..memory import empty
from ._batch import BatchPlan
from ._errors import DatasetError, UnsupportedDatasetError
from ._format import INDEX_NAME
from ._format import read_layout as read_aionvme
from ._layout import FileCache, Layout

__all__ = ["Dataset"]

FORMATS = ("auto", "aionvme", "mds", "npy", "safetensors")


def open_layout(path: str, format: str, key: str) -> Layout:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        if not os.path.exists(root):
            raise FileNotFoundError(2, "no such dataset directory", root)
        raise NotADirectoryError(20, "a dataset is a directory", root)
    if format == "auto":
        if os.path.exists(os.path.join(root, INDEX_NAME)):
            format = "aionvme"
        elif os.path.exists(os.path.join(root, "index.json")):
            format = "mds"
        else:
            names = os.listdir(root)
            has_npy = any(x.endswith(".npy") for x in names)
            has_st = any(x.endswith(".safetensors") for x in names)
            if has_npy and has_st:
                raise DatasetError("both .npy and .safetensors files: pass format=", root)
            if not (has_npy or has_st):
                raise DatasetError(
                    f"no dataset here (no {INDEX_NAME}: an unfinished write?; no MDS index.json, "
                    "no .npy or .safetensors files)",
                    root,
                )
            format = "npy" if has_npy else "safetensors"
    if format == "aionvme":
        if not os.path.exists(os.path.join(root, INDEX_NAME)):
            raise DatasetError(f"no {INDEX_NAME}: not a dataset, or its write did not finish", root)
        return read_aionvme(root)
    if format == "mds":
        from ._mds import read_layout as read_mds

        return read_mds(root)
    from ._files import read_layout as read_files

    return read_files(root, format, key)


class Dataset:
    """Samples on disk, indexed 0..len-1: an aionvme dataset (see
    :func:`write_dataset`), MosaicML MDS shards, or a directory of ``.npy`` /
    ``.safetensors`` files (one sample per file, in name order).

    Parameters
    ----------
    path : the directory.
    format : {'auto', 'aionvme', 'mds', 'npy', 'safetensors'}
        'auto' looks for ``index.aionvme``, then ``index.json``, then the files.
    key : str
        The field name of a ``.npy`` directory's arrays (default 'data').

    Attributes
    ----------
    keys : list of field names.
    nbytes : bytes of sample data (no padding).
    format : which reader opened it.

    Notes
    -----
    Opening reads the index (its checksum is verified), and checks every
    shard's size and header against it (MDS: the shard headers' offsets;
    ``.npy``/``.safetensors``: every file's header): a truncated shard or
    index, or a shard from another write, raises :class:`CorruptDatasetError`
    naming the file, here, before any data is read. The size, mtime and inode
    of every file are recorded: a file that changes later raises
    :class:`DatasetChangedError` where the reader meets the change.

    Opening is blocking file I/O (the index, a header per shard or file:
    seconds for a directory of a million ``.npy`` files). In async code,
    open it with ``await asyncio.to_thread(Dataset, path)``.
    """

    def __init__(self, path: str | os.PathLike[str], format: str = "auto", *, key: str = "data") -> None:
        self.layout = open_layout(os.fspath(path), format, key)
        self.path = self.layout.root
        self._files: dict[int, FileCache] = {}
        self._lock = threading.Lock()

    @property
    def format(self) -> str:
        return self.layout.kind

    def __len__(self) -> int:
        return self.layout.n

    @property
    def keys(self) -> list[str]:
        return self.layout.keys

    @property
    def nbytes(self) -> int:
        return self.layout.data_nbytes()

    @property
    def meta(self) -> dict[str, Any]:
        """Metadata given to :func:`write_dataset` (aionvme format), else {}."""
        return dict(self.layout.info.get("meta", {}))

    def __repr__(self) -> str:
        return (
            f"<aionvme.data.Dataset {self.path!r} format={self.format} samples={len(self)} keys={self.keys}>"
        )

    def _cache(self) -> FileCache:
        tid = threading.get_ident()
        with self._lock:
            c = self._files.get(tid)
            if c is None:
                c = self._files[tid] = FileCache(self.layout, limit=64)
            return c

    def _index(self, i: int) -> int:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"sample index must be an int, got {type(i).__name__}")
        n = self.layout.n
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        return j

    async def get(self, i: int, *, verify: bool = True, tensors: str = "torch") -> dict[str, Any]:
        """Sample i as a dict of tensors (fresh memory, yours to keep).

        Parameters
        ----------
        verify : bool
            Check the fields' crc32 against the index (aionvme format) before returning.
        tensors : {'torch', 'numpy'}

        Raises
        ------
        CorruptDatasetError, DatasetChangedError
            Naming the file and the sample; no data is returned then.
        """
        j = self._index(i)
        plan = BatchPlan(self.layout, np.array([j], dtype=np.int64))
        buf = empty(max(plan.nbytes, 1))
        await plan.read(self.layout, self._cache(), buf)
        if verify:
            await asyncio.to_thread(plan.verify, self.layout, buf)
        return _single(plan.assemble(self.layout, buf, tensors))

    def sync_get(self, i: int, *, verify: bool = True, tensors: str = "torch") -> dict[str, Any]:
        """Blocking twin of :meth:`get`, on aionvme's background loop.

        Raises RuntimeError on a thread whose event loop is running (it would
        stall that loop): there, ``await ds.get(i)``."""
        return run_blocking(
            "data.Dataset.sync_get", "data.Dataset.get", self.get(i, verify=verify, tensors=tensors)
        )

    def __getitem__(self, i: int) -> dict[str, Any]:
        """``ds[i]``: :meth:`sync_get` (checksums verified, torch tensors)."""
        return self.sync_get(i)

    def close(self) -> None:
        with self._lock:
            for c in self._files.values():
                c.close()
            self._files.clear()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        files = getattr(self, "_files", None)
        if files:
            for c in files.values():
                c.close()


def _single(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v[0] for k, v in batch.items()}


def check_tensors(tensors: str, layout: Layout) -> None:
    if tensors not in ("torch", "numpy"):
        raise ValueError(f"tensors must be 'torch' or 'numpy', got {tensors!r}")
    if tensors == "numpy":
        from ._layout import has_numpy_dtype

        for f in layout.fields.values():
            if not has_numpy_dtype(f.dtype):
                raise UnsupportedDatasetError(
                    f"field {f.name!r} is {f.dtype}: use tensors='torch'", layout.root
                )
