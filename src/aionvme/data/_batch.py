"""One batch: where each sample's bytes go in batch memory, the batched reads
that put them there (one pread_many per file, sorted by offset), the
checks, and the tensors the user gets (views of batch memory)."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import numpy as np

from ..exceptions import ShortReadError
from ._errors import CorruptDatasetError, DatasetChangedError
from ._layout import ALIGN, FileCache, Layout, typed

_SUBMIT_ITEMS = 256  # reads per pread_many of a batch (see BatchPlan)


def _split(starts: list[int], ends: list[int], most: int) -> tuple[list[int], list[int]]:
    """The [start, end) runs cut into pieces of at most ``most``."""
    s2: list[int] = []
    e2: list[int] = []
    for s, e in zip(starts, ends):
        for a in range(s, e, most):
            s2.append(a)
            e2.append(min(a + most, e))
    return s2, e2


class BatchPlan:
    """Reads and memory places for the samples ``idx`` (in batch order).

    Memory (offsets from the start of the batch's buffer, all multiples of
    4096): for each fixed-shape field one contiguous [B, ...] block, row r of
    sample idx[r]; for each variable-shape field one aligned slot per sample;
    for decoded fields (MDS) one aligned slot per sample for its raw bytes.
    """

    __slots__ = ("data_nbytes", "idx", "nbytes", "reads", "slots")

    def __init__(self, layout: Layout, idx: np.ndarray[Any, Any]) -> None:
        self.idx = idx
        b = len(idx)
        pos = 0
        mem, fil, off, ln, rows, crcs = [], [], [], [], [], []
        slots: dict[str, Any] = {}
        for f in layout.fields.values():
            nb = f.nbytes[idx]
            if f.shape is not None:
                row = int(nb[0]) if b else 0
                slots[f.name] = (pos, None)
                m = pos + np.arange(b, dtype=np.int64) * row
                pos += -(-(b * row) // ALIGN) * ALIGN
            else:
                padded = (nb + (ALIGN - 1)) // ALIGN * ALIGN
                m = pos + np.concatenate(([0], np.cumsum(padded)[:-1])).astype(np.int64) if b else nb
                slots[f.name] = (m, nb)
                pos += int(padded.sum())
            mem.append(m)
            fil.append(f.file[idx])
            off.append(f.offset[idx])
            ln.append(nb)
            rows.append(np.arange(b, dtype=np.int64))
            crcs.append(f.crc[idx] if f.crc is not None else np.full(b, -1, dtype=np.int64))
        d = layout.decoded
        if d is not None:
            nb = d.nbytes[idx]
            padded = (nb + (ALIGN - 1)) // ALIGN * ALIGN
            m = pos + np.concatenate(([0], np.cumsum(padded)[:-1])).astype(np.int64) if b else nb
            slots[""] = (m, nb)
            pos += int(padded.sum())
            mem.append(m)
            fil.append(d.file[idx])
            off.append(d.offset[idx])
            ln.append(nb)
            rows.append(np.arange(b, dtype=np.int64))
            crcs.append(np.full(b, -1, dtype=np.int64))
        self.nbytes = pos
        self.slots = slots
        self.data_nbytes = int(sum(int(x.sum()) for x in ln))
        if mem:
            a_mem, a_fil, a_off, a_ln = (np.concatenate(x).astype(np.int64) for x in (mem, fil, off, ln))
            a_row = np.concatenate(rows)
            a_crc = np.concatenate([c.astype(np.int64) for c in crcs])
            order = np.lexsort((a_off, a_fil))  # by file, then offset inside it
            a_mem, a_fil, a_off, a_ln, a_row, a_crc = (
                x[order] for x in (a_mem, a_fil, a_off, a_ln, a_row, a_crc)
            )
            cuts = np.nonzero(np.diff(a_fil))[0] + 1
            starts = np.concatenate(([0], cuts)).tolist()
            ends = np.concatenate((cuts, [len(a_fil)])).tolist()
            # at most _SUBMIT_ITEMS reads per request: read() submits them one loop
            # tick apart, so a batch of 1024 small samples does not hold the loop
            # for one 4-5 ms tick (slicing the views and handing them to the engine)
            starts, ends = _split(starts, ends, _SUBMIT_ITEMS)
            self.reads = [
                (
                    int(a_fil[s]),
                    a_mem[s:e].tolist(),
                    a_off[s:e].tolist(),
                    a_ln[s:e].tolist(),
                    idx[a_row[s:e]].tolist(),
                    a_crc[s:e].tolist(),
                )
                for s, e in zip(starts, ends)
                if e > s
            ]
        else:
            self.reads = []

    async def read(self, layout: Layout, files: FileCache, buf: Any) -> None:
        """Fill buf (at least self.nbytes, page-aligned) with one pread_many per file."""

        futs: list[Any] = []
        try:
            for fi, mem, off, ln, samples, _ in self.reads:
                if futs:
                    await asyncio.sleep(0)  # the loop runs other work between requests
                f = files.get(fi, samples[0] if samples else None)
                items = [(buf[m : m + n], o) for m, o, n in zip(mem, off, ln)]
                futs.append(f.pread_many(items))
        except BaseException:
            # the batches already submitted still write into buf: wait for them first
            await asyncio.gather(*futs, return_exceptions=True)
            raise
        # return_exceptions=True: the gather ends only when every read has (also when
        # cancelled: aionvme's futures end once the kernel has let go of buf)
        results = await asyncio.gather(*futs, return_exceptions=True)
        for (fi, _, off, ln, samples, _), r in zip(self.reads, results):
            if isinstance(r, BaseException):
                raise self._error(layout, fi, samples, off, ln, r) from r

    def _error(
        self, layout: Layout, fi: int, samples: list[int], off: list[int], ln: list[int], e: BaseException
    ) -> BaseException:
        seg = getattr(e, "segment", None)
        sample = samples[seg] if isinstance(seg, int) and 0 <= seg < len(samples) else None
        why = layout.changed(fi)
        if why is not None:
            return DatasetChangedError(
                f"dataset file changed under the reader ({why})", layout.files[fi], sample
            )
        if isinstance(e, ShortReadError):
            return CorruptDatasetError(
                f"file ends at {e.offset + e.received}, the index puts the sample's bytes up to "
                f"{e.offset + e.expected} (truncated)",
                layout.files[fi],
                sample,
            )
        return e

    def verify(self, layout: Layout, buf: Any) -> None:
        """crc32 of every field read against the index (aionvme format). Blocking: run off the loop."""
        for fi, mem, _, ln, samples, crc in self.reads:
            for m, n, s, c in zip(mem, ln, samples, crc):
                if c >= 0 and zlib.crc32(buf[m : m + n]) != c:
                    why = layout.changed(fi)
                    if why is not None:
                        raise DatasetChangedError(
                            f"dataset file changed under the reader ({why})", layout.files[fi], s
                        )
                    raise CorruptDatasetError(
                        "checksum mismatch: the shard's bytes are damaged", layout.files[fi], s
                    )

    def assemble(self, layout: Layout, buf: Any, tensors: str) -> dict[str, Any]:
        """The batch as views of buf: stacked fixed-shape fields, lists for the rest."""
        out: dict[str, Any] = {}
        b = len(self.idx)
        for f in layout.fields.values():
            pos, nb = self.slots[f.name]
            if f.shape is not None:
                row = int(f.nbytes[self.idx[0]]) if b else 0
                out[f.name] = typed(buf[pos : pos + b * row], f.dtype, (b, *f.shape), tensors)
            else:
                shapes = f.shapes[self.idx] if f.shapes is not None else None
                out[f.name] = [
                    typed(buf[m : m + n], f.dtype, tuple(shapes[r]) if shapes is not None else (n,), tensors)
                    for r, (m, n) in enumerate(zip(pos.tolist(), nb.tolist()))
                ]
        d = layout.decoded
        if d is not None:
            pos, nb = self.slots[""]
            values = [
                d.decode(memoryview(np_bytes(buf, m, n)), int(s))  # type: ignore[arg-type]
                for m, n, s in zip(pos.tolist(), nb.tolist(), self.idx.tolist())
            ]
            for name, spec in d.fields.items():
                col = [v[name] for v in values]
                if spec.kind == "fixed" and spec.dtype is not None and spec.shape is not None:
                    arr = np.stack(col) if col else np.empty((0, *spec.shape), dtype=spec.dtype)
                    out[name] = arr if tensors == "numpy" else _torch_from(arr)
                elif spec.kind == "array" and tensors != "numpy":
                    out[name] = [_torch_from(a) for a in col]
                else:
                    out[name] = col
        return out


def np_bytes(buf: Any, m: int, n: int) -> np.ndarray[Any, Any]:
    part = buf[m : m + n]
    if isinstance(part, np.ndarray):
        return part
    return np.asarray(part.cpu().numpy())


def _torch_from(a: np.ndarray[Any, Any]) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


def pad_batch(batch: dict[str, Any], keys: list[str] | None = None, value: float = 0) -> dict[str, Any]:
    """Turn list fields (shape varies between samples) into padded tensors with masks.

    For each list field ``k`` of tensors with the same number of dimensions,
    ``batch[k]`` becomes one ``[B, *max_shape]`` tensor filled with ``value``
    around each sample, and ``batch[k + "_mask"]`` a bool tensor of the same
    shape, True where the data is. Other fields are left as they are. Meant
    as (part of) a loader's ``transform``; it copies, so the result outlives
    the batch memory.
    """
    import torch

    out = dict(batch)
    for k, v in batch.items():
        if keys is not None and k not in keys:
            continue
        if not isinstance(v, list) or not v or not all(isinstance(t, torch.Tensor) for t in v):
            continue
        ndim = v[0].dim()
        if any(t.dim() != ndim for t in v):
            raise ValueError(f"field {k!r}: samples differ in their number of dimensions")
        shape = [max(int(t.shape[d]) for t in v) for d in range(ndim)]
        padded = torch.full((len(v), *shape), value, dtype=v[0].dtype, device=v[0].device)
        mask = torch.zeros((len(v), *shape), dtype=torch.bool, device=v[0].device)
        for r, t in enumerate(v):
            region: tuple[Any, ...] = (r, *(slice(0, int(s)) for s in t.shape))
            padded[region] = t
            mask[region] = True
        out[k] = padded
        out[k + "_mask"] = mask
    return out
