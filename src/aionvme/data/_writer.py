"""write_dataset: samples (dicts of arrays/tensors) -> an aionvme dataset directory."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import sys
import zlib
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import numpy as np

from ..atomic import atomic_write, fsync_dir
from ..defaults import parse_size
from ..memory import empty
from ._format import INDEX_NAME, encode_index, new_dataset_id, shard_header, shard_name
from ._layout import ALIGN, has_numpy_dtype, round_up

__all__ = ["sync_write_dataset", "write_dataset"]

_STAGE = 16 << 20  # bytes gathered before one O_DIRECT write
# Fields of at most this many bytes are packed, byte after byte, into shared
# 4096-byte pages instead of starting a page each (500 samples of 72 bytes took
# 2 MiB for 36 KB); a packed field never crosses a page, so reading it costs
# the one page read an aligned small field cost (the engine's unaligned path).
PACK_MAX = ALIGN // 2


def _as_bytes(value: Any, key: str, index: int) -> tuple[np.ndarray[Any, Any], str, tuple[int, ...]]:
    """(flat uint8 view of the value's bytes, dtype name, shape) without copying where possible."""
    if "torch" in sys.modules:
        import torch

        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            name = str(t.dtype).removeprefix("torch.")
            if t.is_complex() or name.startswith("qint") or name == "quint8":
                raise TypeError(f"sample {index}, field {key!r}: torch dtype {t.dtype} is not supported")
            return t.reshape(-1).view(torch.uint8).numpy(), name, tuple(t.shape)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(value, dtype=np.uint8)
        return raw, "uint8", (len(raw),)
    if isinstance(value, str):
        raise TypeError(
            f"sample {index}, field {key!r}: str values are not stored; encode them to bytes (uint8 arrays)"
        )
    a = np.asarray(value)
    if a.dtype.kind not in "biufc":
        raise TypeError(f"sample {index}, field {key!r}: dtype {a.dtype} is not a numeric array")
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    return a.reshape(-1).view(np.uint8), a.dtype.name, tuple(a.shape)


class _FieldAcc:
    def __init__(self, name: str, dtype: str, itemsize: int, ndim: int) -> None:
        self.name, self.dtype, self.itemsize, self.ndim = name, dtype, itemsize, ndim
        self.shard: list[int] = []
        self.offset: list[int] = []
        self.nbytes: list[int] = []
        self.crc: list[int] = []
        self.shapes: list[tuple[int, ...]] = []


def _progress(total: int | None, enabled: bool | None) -> Any:
    """A progress bar (tqdm, else rich) or None."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="sample", desc="write_dataset", dynamic_ncols=True)
    except ImportError:
        pass
    try:
        from rich.progress import Progress

        class _Rich:
            def __init__(self) -> None:
                self.p = Progress()
                self.p.start()
                self.task = self.p.add_task("write_dataset", total=total)

            def update(self, n: int) -> None:
                self.p.update(self.task, advance=n)

            def close(self) -> None:
                self.p.stop()

        return _Rich()
    except ImportError:
        return None


class _ShardWriter:
    """One shard being written through atomic_write: staged, aligned writes.

    A field of more than PACK_MAX bytes starts on the next 4096-byte boundary;
    smaller ones are gathered into a page of their own (``page``), written
    like one aligned field when it is full or the shard ends, and their
    offsets (appended as -1 until then) are filled in at that moment."""

    def __init__(self, root: str, number: int, dataset_id: bytes) -> None:
        self.number = number
        self.dataset_id = dataset_id
        self.path = os.path.join(root, shard_name(number))
        self._writer = atomic_write(self.path)
        self.file = self._writer.__enter__()
        self.stage = empty(_STAGE)
        self.stage_start = ALIGN  # the header block comes first
        self.stage_used = 0
        self.page = np.zeros(ALIGN, np.uint8)
        self.page_used = 0
        self.page_refs: list[tuple[list[int], int, int]] = []  # (offsets list, its index, place in page)

    @property
    def pos(self) -> int:
        """The shard's size so far (a page of small fields counted whole)."""
        return self.stage_start + self.stage_used + (ALIGN if self.page_refs else 0)

    def add(self, raw: np.ndarray[Any, Any], offsets: list[int]) -> None:
        """Place raw in the shard; its file offset goes to the end of ``offsets``."""
        n = raw.nbytes
        if 0 < n <= PACK_MAX:
            if self.page_used + n > ALIGN:
                self._flush_page()
            self.page[self.page_used : self.page_used + n] = raw
            self.page_refs.append((offsets, len(offsets), self.page_used))
            offsets.append(-1)
            self.page_used += n
            return
        offsets.append(self._append(raw))

    def _flush_page(self) -> None:
        if not self.page_refs:
            return
        self.page[self.page_used :] = 0
        base = self._append(self.page)
        for offsets, k, at in self.page_refs:
            offsets[k] = base + at
        self.page_refs.clear()
        self.page_used = 0

    def _append(self, raw: np.ndarray[Any, Any]) -> int:
        """Append raw at the next aligned position; returns its file offset."""
        n = raw.nbytes
        padded = round_up(n)
        if self.stage_used + padded > len(self.stage):
            self._flush()
            if padded > len(self.stage):
                self.stage = empty(padded)
        off = self.stage_start + self.stage_used
        self.stage[self.stage_used : self.stage_used + n] = raw
        self.stage[self.stage_used + n : self.stage_used + padded] = 0
        self.stage_used += padded
        return off

    def _flush(self) -> None:
        if self.stage_used:
            self.file.sync_pwrite(self.stage[: self.stage_used], self.stage_start)
        self.stage_start += self.stage_used
        self.stage_used = 0

    def finish(self) -> int:
        """Write the header, commit (fsync, rename, directory fsync); returns the size."""
        self._flush_page()
        self._flush()
        size = self.stage_start
        self.file.sync_pwrite(np.frombuffer(shard_header(self.number, self.dataset_id, size), np.uint8), 0)
        self._writer.__exit__(None, None, None)
        return size

    def abort(self, exc: BaseException) -> None:
        self._writer.__exit__(type(exc), exc, exc.__traceback__)


def sync_write_dataset(
    path: str | os.PathLike[str],
    samples: Iterable[dict[str, Any]],
    shard_size: int | str = "1G",
    *,
    progress: bool | None = None,
    meta: dict[str, Any] | None = None,
) -> int:
    """Blocking twin of :func:`write_dataset`; returns the number of samples written."""
    root = os.path.abspath(os.fspath(path))
    limit = parse_size(shard_size)
    if limit < 2 * ALIGN:
        raise ValueError(f"shard_size must be at least {2 * ALIGN} bytes, got {limit}")
    os.makedirs(root, exist_ok=True)
    index_path = os.path.join(root, INDEX_NAME)
    if os.path.exists(index_path):  # no index: the directory never opens as a half-new dataset
        os.unlink(index_path)
        fsync_dir(root)
    dataset_id = new_dataset_id()
    fields: dict[str, _FieldAcc] = {}
    shards: list[dict[str, Any]] = []
    total = len(samples) if isinstance(samples, Sized) else None
    bar = _progress(total, progress)
    shard: _ShardWriter | None = None
    n = 0
    try:
        for n, sample in enumerate(_samples(samples)):
            if not isinstance(sample, dict) or not sample:
                raise TypeError(f"sample {n} is not a non-empty dict of arrays")
            parts = [(str(k), *_as_bytes(v, str(k), n)) for k, v in sample.items()]
            if not fields:
                for k, _raw, dt, shp in parts:
                    fields[k] = _FieldAcc(k, dt, 0, len(shp))
            if len(parts) != len(fields) or any(k not in fields for k, *_ in parts):
                raise ValueError(f"sample {n} has keys {sorted(sample)}, the first sample {sorted(fields)}")
            # (small fields share a page: at most one more page)
            big = [p[1].nbytes for p in parts if p[1].nbytes > PACK_MAX]
            need = sum(round_up(n) for n in big) + (ALIGN if len(big) < len(parts) else 0)
            if shard is not None and shard.pos > ALIGN and shard.pos + need > limit:
                shards.append({"name": shard_name(shard.number), "size": shard.finish()})
                shard = None
            if shard is None:
                shard = _ShardWriter(root, len(shards), dataset_id)
            for k, raw, dt, shp in parts:
                acc = fields[k]
                if dt != acc.dtype or len(shp) != acc.ndim:
                    raise ValueError(
                        f"sample {n}, field {k!r}: {dt}{list(shp)} does not match the first sample's "
                        f"{acc.dtype} with {acc.ndim} dimensions"
                    )
                acc.shard.append(shard.number)
                shard.add(raw, acc.offset)
                acc.nbytes.append(raw.nbytes)
                acc.crc.append(zlib.crc32(raw))  # type: ignore[arg-type]
                acc.shapes.append(shp)
            if bar is not None:
                bar.update(1)
        count = len(next(iter(fields.values())).shard) if fields else 0
        if shard is not None:
            shards.append({"name": shard_name(shard.number), "size": shard.finish()})
            shard = None
    except BaseException as e:
        if shard is not None:
            shard.abort(e)
        raise
    finally:
        if bar is not None:
            bar.close()
    _write_index(root, dataset_id, count, fields, shards, meta or {})
    keep = {s["name"] for s in shards}
    for old in glob.glob(os.path.join(root, "shard-*.bin")):  # shards of an earlier, larger write
        if os.path.basename(old) not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
    return count


def _samples(samples: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from samples


def _write_index(
    root: str,
    dataset_id: bytes,
    n: int,
    fields: dict[str, _FieldAcc],
    shards: list[dict[str, Any]],
    meta: dict[str, Any],
) -> None:
    arrays: list[np.ndarray[Any, Any]] = []
    fdescs = []
    for acc in fields.values():
        ia: dict[str, int] = {}
        for key, values, dt in (
            ("shard", acc.shard, np.uint32),
            ("offset", acc.offset, np.uint64),
            ("nbytes", acc.nbytes, np.uint64),
            ("crc", acc.crc, np.uint32),
        ):
            ia[key] = len(arrays)
            arrays.append(np.asarray(values, dtype=dt))
        fixed = all(s == acc.shapes[0] for s in acc.shapes)
        if not fixed:
            ia["shapes"] = len(arrays)
            arrays.append(np.asarray(acc.shapes, dtype=np.int64).reshape(n, acc.ndim))
        itemsize = np.dtype(acc.dtype).itemsize if has_numpy_dtype(acc.dtype) else _torch_itemsize(acc.dtype)
        fdescs.append(
            {
                "name": acc.name,
                "dtype": acc.dtype,
                "itemsize": itemsize,
                "ndim": acc.ndim,
                "shape": list(acc.shapes[0]) if fixed and acc.shapes else None,
                "arrays": ia,
            }
        )
    header = {"n": n, "id": dataset_id.hex(), "shards": shards, "fields": fdescs, "meta": meta}
    data = encode_index(header, arrays)
    buf = empty(round_up(len(data)))
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    with atomic_write(os.path.join(root, INDEX_NAME)) as f:
        f.sync_pwrite(buf[: len(data)], 0)


def _torch_itemsize(name: str) -> int:
    import torch

    return int(torch.empty(0, dtype=getattr(torch, name)).element_size())


async def write_dataset(
    path: str | os.PathLike[str],
    samples: Iterable[dict[str, Any]],
    shard_size: int | str = "1G",
    *,
    progress: bool | None = None,
    meta: dict[str, Any] | None = None,
) -> int:
    """Write samples as an aionvme dataset directory; returns the sample count.

    Parameters
    ----------
    path : directory (created if needed). An existing dataset there is replaced.
    samples : iterable of dicts ``{name: array}``
        numpy arrays, torch tensors (any device; bfloat16 and float8 kept),
        Python/numpy scalars (stored as 0-d arrays), ``bytes`` (uint8 arrays).
        Every sample has the same keys; a field keeps its dtype and number of
        dimensions, its shape may vary (see :class:`Loader` for batching).
    shard_size : int or str
        A new shard starts when the next sample would take this one past the
        size (a larger sample gets a shard of its own).
    progress : bool, optional
        A progress bar (tqdm or rich, when installed); default: when stderr is a terminal.
    meta : dict, optional
        JSON-able metadata stored in the index (``Dataset.meta``).

    Notes
    -----
    A field of more than 2048 bytes starts on a 4096-byte boundary in its
    shard, so reading it with O_DIRECT lands straight in a page-aligned
    batch row. Smaller fields are packed into shared pages (never across a
    page boundary), so small samples take about their own size on disk. Each shard is
    written through :func:`aionvme.atomic_write` (temporary name, fsync,
    rename) and the index last, also atomically; an existing index is removed
    first. A write that is interrupted (exception, cancellation, crash)
    therefore leaves a directory without an index, which does not open.

    The samples are consumed, converted and written on a worker thread (your
    iterable is iterated there): the event loop is never blocked by copying.
    Cancelling the await stops the writing at the next sample.
    """
    stop = False

    def gen() -> Iterator[dict[str, Any]]:
        for s in samples:
            if stop:
                raise asyncio.CancelledError()
            yield s

    class _Sized:
        def __init__(self) -> None:
            self._n = len(samples) if isinstance(samples, Sized) else None

        def __iter__(self) -> Iterator[dict[str, Any]]:
            return gen()

        def __len__(self) -> int:
            if self._n is None:
                raise TypeError
            return self._n

    src: Iterable[dict[str, Any]] = _Sized() if isinstance(samples, Sized) else gen()
    task = asyncio.ensure_future(
        asyncio.to_thread(sync_write_dataset, path, src, shard_size, progress=progress, meta=meta)
    )
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        stop = True
        with contextlib.suppress(BaseException):
            await task  # the thread removes its temporary shard before we return
        raise
