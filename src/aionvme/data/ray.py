"""An aionvme dataset as a Ray Data datasource (optional: ``pip install "ray[data]"``).

::

    import ray
    from aionvme.data.ray import AionvmeDatasource

    ds = ray.data.read_datasource(AionvmeDatasource("/nvme/train"))
    for batch in ds.iter_batches(batch_size=256): ...

Each read task opens the dataset where it runs and reads its samples through
aionvme's engine there (kernel AIO, O_DIRECT, one ``pread_many`` per file and
block), so the directory must be at the same path on every node that runs
read tasks: a node-local copy on each node's NVMe, or a shared file system.
Ray is imported only by this module.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import ray.data  # type: ignore[import-not-found,unused-ignore]
from ray.data.block import BlockAccessor, BlockMetadata  # type: ignore[import-not-found,unused-ignore]
from ray.data.datasource import ReadTask  # type: ignore[import-not-found,unused-ignore]

from .._runtime.background import background
from ..defaults import parse_size
from ..memory import empty
from ._batch import BatchPlan
from ._dataset import Dataset
from ._layout import FileCache, Layout

__all__ = ["AionvmeDatasource"]


class AionvmeDatasource(ray.data.Datasource):  # type: ignore[misc,unused-ignore]
    """Samples of an aionvme :class:`~aionvme.data.Dataset` (aionvme format, MDS
    shards, a directory of ``.npy`` / ``.safetensors``) as rows of a Ray dataset.

    Parameters
    ----------
    path : str or PathLike
        The dataset's directory, at this path on every node that reads.
    format, key
        As for :class:`~aionvme.data.Dataset`.
    block_size : int or str
        Bytes of sample data per block at most (``"64M"``); a block holds at
        least one sample.
    verify : bool
        Check every field's crc32 (aionvme format) before a block is made.
    index_column : str, optional
        Also give each row its sample index in the dataset, in a column of this name.

    Notes
    -----
    Read tasks split the samples into contiguous ranges of the dataset's
    index (neighbouring samples sit next to each other in the shards), in
    order; shuffle with Ray (``random_shuffle``, ``randomize_block_order``).
    A fixed-shape field is a tensor column; a field whose shape varies, a
    column of variable-shaped tensors; MDS columns decoded on the host keep
    their Python values. A block is copied into Ray's object store when the
    task ends (Ray's rule), so read memory is a block's, not the dataset's.
    Errors are aionvme's (:class:`~aionvme.data.CorruptDatasetError`,
    :class:`~aionvme.data.DatasetChangedError`, ``OSError``), raised in the
    read task and by Ray to the consumer.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        format: str = "auto",
        key: str = "data",
        block_size: int | str = "64M",
        verify: bool = False,
        index_column: str | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.path = os.path.abspath(os.fspath(path))
        self.format = format
        self.key = key
        self.block_size = max(1, parse_size(block_size))
        self.verify = bool(verify)
        with Dataset(self.path, format, key=key) as ds:
            layout = ds.layout
            if index_column is not None and index_column in layout.keys:
                raise ValueError(f"index_column {index_column!r} is a field of the dataset")
            self.index_column = index_column
            self.n = layout.n
            # bytes of each sample's data (unpadded: what a row holds)
            self._sizes = np.zeros(layout.n, dtype=np.int64)
            for f in layout.fields.values():
                self._sizes += f.nbytes
            # the files each sample's fields lie in (for each read task's input_files)
            self._files = list(layout.files)
            self._sample_files = [f.file for f in layout.fields.values()]
            if layout.decoded is not None:
                self._sizes += layout.decoded.nbytes
                self._sample_files.append(layout.decoded.file)

    def get_name(self) -> str:
        return "Aionvme"

    def estimate_inmemory_data_size(self) -> int | None:
        return int(self._sizes.sum())

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[Any]:
        """``parallelism`` read tasks (fewer when there are fewer samples), each
        over a contiguous range of samples of about the same bytes."""
        n = self.n
        if n == 0:
            return []
        k = max(1, min(int(parallelism), n))
        cum = np.cumsum(self._sizes)
        total = int(cum[-1])
        if total:
            # cut where the bytes reach 1/k, 2/k, ... of the total (at least one sample per task)
            cuts = np.searchsorted(cum, np.arange(1, k) * total / k, side="left") + 1
        else:
            cuts = np.arange(1, k) * n // k
        bounds = np.unique(np.concatenate(([0], np.clip(cuts, 1, n - 1), [n]))).tolist()
        tasks = []
        for lo, hi in itertools.pairwise(bounds):
            files = sorted({int(i) for fs in self._sample_files for i in np.unique(fs[lo:hi])})
            meta = BlockMetadata(
                num_rows=hi - lo,
                size_bytes=int(self._sizes[lo:hi].sum()),
                input_files=tuple(self._files[i] for i in files),
                exec_stats=None,
            )
            tasks.append(
                ReadTask(
                    _Read(
                        self.path,
                        self.format,
                        self.key,
                        lo,
                        hi,
                        self.block_size,
                        self.verify,
                        self.index_column,
                    ),
                    meta,
                    per_task_row_limit=per_task_row_limit,
                )
            )
        return tasks


class _Read:
    """One read task: samples lo..hi-1 in blocks of at most block_size bytes,
    read by aionvme's engine on the node it runs on (a plain object: Ray pickles it)."""

    def __init__(
        self,
        path: str,
        format: str,
        key: str,
        lo: int,
        hi: int,
        block_size: int,
        verify: bool,
        index: str | None,
    ) -> None:
        self.path, self.format, self.key = path, format, key
        self.lo, self.hi = lo, hi
        self.block_size, self.verify, self.index = block_size, verify, index

    def __call__(self) -> Iterable[Any]:
        return self._blocks()

    def _blocks(self) -> Iterator[Any]:
        with Dataset(self.path, self.format, key=self.key) as ds:
            layout = ds.layout
            files = FileCache(layout, limit=64)
            try:
                sizes = layout.sample_nbytes()
                lo = self.lo
                while lo < self.hi:
                    hi = _block_end(sizes, lo, self.hi, self.block_size)
                    idx = np.arange(lo, hi, dtype=np.int64)
                    # on aionvme's loop thread of this worker process (a read task is
                    # synchronous code by Ray's contract: it blocks its thread either way)
                    batch = background().run(_read(layout, files, idx, self.verify))
                    if self.index is not None:
                        batch[self.index] = idx
                    yield BlockAccessor.batch_to_block(_columns(batch))
                    lo = hi
            finally:
                files.close()


def _block_end(sizes: np.ndarray[Any, Any], lo: int, hi: int, block_size: int) -> int:
    """The end of the block starting at lo: as many samples as fit block_size bytes (at least one)."""
    cum = np.cumsum(sizes[lo:hi])
    return lo + max(1, int(np.searchsorted(cum, block_size, side="right")))


async def _read(layout: Layout, files: FileCache, idx: np.ndarray[Any, Any], verify: bool) -> dict[str, Any]:
    plan = BatchPlan(layout, idx)
    buf = empty(max(plan.nbytes, 1))
    await plan.read(layout, files, buf)
    if verify:
        import asyncio

        await asyncio.to_thread(plan.verify, layout, buf)
    return plan.assemble(layout, buf, "numpy")


def _columns(batch: dict[str, Any]) -> dict[str, Any]:
    """Lists of per-sample arrays (fields whose shape varies) as object arrays:
    Ray makes a variable-shaped tensor column of them."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, list):
            col = np.empty(len(v), dtype=object)
            for i, a in enumerate(v):  # (col[:] = v would stack arrays of one shape)
                col[i] = a
            out[k] = col
        else:
            out[k] = v
    return out
