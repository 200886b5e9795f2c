"""Errors of :mod:`aionvme.data`: each names the file and, where one is
involved, the sample (its index in the dataset)."""

from __future__ import annotations

from typing import Any

from ..exceptions import AionvmeError

__all__ = [
    "CorruptDatasetError",
    "DatasetChangedError",
    "DatasetError",
    "LoaderStateError",
    "UnsupportedDatasetError",
]


class DatasetError(AionvmeError, ValueError):
    """A dataset that cannot be read as it is.

    Attributes
    ----------
    filename : the file concerned (shard, index, ``.npy``, ...), or None.
    sample : the dataset index of the sample concerned, or None.
    """

    def __init__(self, message: str, filename: object = None, sample: int | None = None) -> None:
        self.filename = filename
        self.sample = sample
        self._message = message
        where = []
        if filename is not None:
            where.append(f"file {filename!s}")
        if sample is not None:
            where.append(f"sample {sample}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._message, self.filename, self.sample))


class CorruptDatasetError(DatasetError):
    """A shard or index is truncated, damaged, or does not match its index
    (bad magic, wrong size, checksum mismatch, offsets out of range)."""


class UnsupportedDatasetError(DatasetError):
    """A dataset in a form this reader does not handle (an MDS column encoding
    such as ``jpeg`` or ``pkl``, a compressed shard, an object ``.npy``...)."""


class DatasetChangedError(AionvmeError, RuntimeError):
    """A file of the dataset changed (size, mtime or inode) after it was opened.

    Attributes
    ----------
    filename : the file that changed.
    sample : the sample being read when the change was seen, or None.
    """

    def __init__(self, message: str, filename: object = None, sample: int | None = None) -> None:
        self.filename = filename
        self.sample = sample
        self._message = message
        where = f" (sample {sample})" if sample is not None else ""
        super().__init__(f"{message}: {filename!s}{where}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._message, self.filename, self.sample))


class LoaderStateError(AionvmeError, ValueError):
    """A loader state that cannot be loaded or merged here: another dataset,
    seed, shuffle or drop_last, another rank or world size without
    :func:`~aionvme.data.merge_states`, a rank missing from a merge, a
    position out of range."""
