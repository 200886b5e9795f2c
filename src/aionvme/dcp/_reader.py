"""``aionvme.dcp.Reader``: a torch.distributed.checkpoint StorageReader that
reads each data file in two batched O_DIRECT requests.

Per rank and file, the items the load plan asks for are sorted by offset.
The first request reads the small records whole and the first and last 4 KiB
of each large one (where a torch.save archive keeps its pickle and its
central directory), adjacent ranges merged into one transfer. From those
bytes :func:`._record.parse` finds each tensor's storage bytes; the second
request reads them, straight into the destination tensor where the bytes are
the destination's (same dtype, a contiguous range of the saved chunk, a
contiguous destination), or else into page-aligned scratch memory that is
then copied (a cast, or a box of the saved chunk that is not one range),
adjacent scratch ranges merged. Records in another layout are read whole and
given to ``torch.load``, as ``FileSystemReader`` does. The files of one rank
are read concurrently.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..exceptions import AionvmeError
from ..file import File
from ..memory import empty
from ._common import METADATA, PAGE, align_up, run
from ._record import Layout, parse

__all__ = ["CheckpointFormatError", "Reader"]

# Records up to this size are read whole in the first request; of larger ones
# only the head and the tail, then the storage bytes wanted.
_SMALL = 64 * 1024
_PROBE = 4096
# Ranges of the first request closer than this are read as one transfer.
_MERGE_GAP = 64 * 1024
# Copies out of scratch memory larger than this run on a thread.
_BIG_COPY = 1 << 20


class CheckpointFormatError(AionvmeError, ValueError):
    """A checkpoint's metadata or data do not match: a size mismatch, a
    record that is not what the metadata says, an unsupported transform."""


@dataclass
class _Record:
    info: _StorageInfo
    reqs: list[ReadItem] = field(default_factory=list)
    whole: bool = False
    head: bytes = b""
    tail: bytes = b""


def _contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(size):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def _box_range(lay: Layout, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """(first element, element count) when the box is one contiguous range of
    the storage, in row-major order; None otherwise."""
    size = lay.size
    if tuple(lay.stride) != _contiguous_strides(size) and math.prod(size) > 1:
        return None
    k = -1
    for i, (n, ln) in enumerate(zip(size, lengths)):
        if ln != n:
            k = i
    if any(lengths[j] != 1 for j in range(k)):
        return None
    first = lay.storage_offset + sum(o * st for o, st in zip(offsets, _contiguous_strides(size)))
    return first, math.prod(lengths)


def _span(lay: Layout, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    """(first, last + 1) storage elements a box of the saved tensor touches."""
    first = lay.storage_offset + sum(o * st for o, st in zip(offsets, lay.stride))
    last = lay.storage_offset + sum((o + ln - 1) * st for o, ln, st in zip(offsets, lengths, lay.stride))
    return first, last + 1


def _merge(ranges: list[tuple[int, int]], gap: int) -> list[list[int]]:
    runs: list[list[int]] = []
    for b, e in sorted(ranges):
        if runs and b - runs[-1][1] <= gap:
            runs[-1][1] = max(runs[-1][1], e)
        else:
            runs.append([b, e])
    return runs


async def _read_runs(f: File, runs: list[list[int]]) -> list[tuple[int, memoryview]]:
    """Read each [begin, end) file range into page-aligned memory, in one
    request; returns (begin, bytes) per run. Each run is read from the page
    boundary below it, so the transfer is zero-copy O_DIRECT."""
    if not runs:
        return []
    place, total = [], 0
    for b, e in runs:
        fs = b // PAGE * PAGE
        place.append((total, fs, e - fs, b))
        total += align_up(e - fs)
    mem = memoryview(empty(total))
    await f.pread_many([(mem[p : p + n], fs) for p, fs, n, _ in place])
    return [(b, mem[p + b - fs : p + n]) for p, fs, n, b in place]


def _slice(got: list[tuple[int, memoryview]], begin: int, end: int) -> memoryview:
    for b, mv in got:
        if b <= begin and end <= b + len(mv):
            return mv[begin - b : end - b]
    raise RuntimeError("range not read")  # pragma: no cover - planned above


def _torch_view(mem: memoryview, dtype: torch.dtype) -> torch.Tensor:
    raw = torch.frombuffer(mem, dtype=torch.uint8) if len(mem) else torch.empty(0, dtype=torch.uint8)
    return raw if dtype == torch.uint8 else raw.view(dtype)


class Reader(StorageReader):
    """A ``torch.distributed.checkpoint`` storage reader on aionvme.

    ::

        import torch.distributed.checkpoint as dcp, aionvme.dcp
        dcp.load(state_dict, storage_reader=aionvme.dcp.Reader("/nvme/ckpt/step100"))

    Reads checkpoints written by :class:`aionvme.dcp.Writer` and by torch's
    ``FileSystemWriter``, with resharding (any number of ranks, DTensor and
    ShardedTensor state dicts), as ``FileSystemReader`` does.

    Notes
    -----
    Per rank, each data file is read in two batched requests (see the
    module's documentation); tensor bytes go with O_DIRECT into the
    destination tensors when they can (a page-aligned destination, such as
    one from :func:`aionvme.empty`, is zero-copy), else into page-aligned
    scratch memory and are copied. Items saved with stream transforms
    (torch's experimental ``_extensions``) are not supported and raise
    :class:`CheckpointFormatError`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.rank: int | None = None
        self.stats = {"files": 0, "requests": 0, "direct_bytes": 0, "scratch_bytes": 0, "fallbacks": 0}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        with open(os.path.join(self.path, name), "rb") as fh:
            metadata = pickle.load(fh)
        if not isinstance(metadata, Metadata):
            raise CheckpointFormatError(f"{os.path.join(self.path, name)} holds no checkpoint Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise CheckpointFormatError("the checkpoint's metadata has no storage_data")
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, dict[tuple[int, int], _Record]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise CheckpointFormatError(
                    f"{req.storage_index.fqn}: saved with stream transforms {info.transform_descriptors}"
                )
            recs = per_file.setdefault(info.relative_path, {})
            rec = recs.setdefault((info.offset, info.length), _Record(info))
            rec.reqs.append(req)
        run(self._read_all(per_file, planner))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    async def _read_all(
        self, per_file: dict[str, dict[tuple[int, int], _Record]], planner: LoadPlanner
    ) -> None:
        tasks = [
            asyncio.ensure_future(self._read_file(os.path.join(self.path, rel), list(recs.values()), planner))
            for rel, recs in per_file.items()
        ]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # no read left landing in a tensor
            raise

    async def _read_file(self, path: str, recs: list[_Record], planner: LoadPlanner) -> None:
        recs.sort(key=lambda r: r.info.offset)
        self.stats["files"] += 1
        with File(path, "r") as f:
            # Request 1: small records whole, the head and tail of large ones.
            ranges = []
            for r in recs:
                o, n = r.info.offset, r.info.length
                if n <= _SMALL or any(q.type == LoadItemType.BYTE_IO for q in r.reqs):
                    r.whole = True
                    ranges.append((o, o + n))
                else:
                    ranges += [(o, o + _PROBE), (o + n - _PROBE, o + n)]
            got = await _read_runs(f, _merge(ranges, _MERGE_GAP))
            self.stats["requests"] += 1
            # Request 2: the storage bytes of the large ones.
            direct: list[tuple[Any, int]] = []
            scratch: list[tuple[int, int]] = []
            later: list[tuple[_Record, ReadItem, Layout, torch.Tensor, int, int]] = []
            fallback: list[_Record] = []
            done: list[tuple[ReadItem, torch.Tensor]] = []
            for r in recs:
                o, n = r.info.offset, r.info.length
                if r.whole:
                    await self._from_memory(r, _slice(got, o, o + n), planner, done)
                    continue
                head = bytes(_slice(got, o, o + _PROBE))
                tail = bytes(_slice(got, o + n - _PROBE, o + n))
                lay = parse(head, tail, n)
                if lay is None:
                    fallback.append(r)
                    continue
                itemsize = torch.empty(0, dtype=lay.dtype).element_size()
                base = o + lay.data_offset
                for req in r.reqs:
                    dest = self._dest(planner, req)
                    box = _box_range(lay, req.storage_offsets, req.lengths)
                    if (
                        box is not None
                        and dest.device.type == "cpu"
                        and dest.dtype == lay.dtype
                        and dest.is_contiguous()
                        and dest.numel() == box[1]
                    ):
                        if box[1]:
                            direct.append((dest, base + box[0] * itemsize))
                            self.stats["direct_bytes"] += box[1] * itemsize
                        done.append((req, dest))
                        continue
                    first, end = _span(lay, req.storage_offsets, req.lengths)
                    if math.prod(req.lengths) == 0:
                        first = end = 0
                    b, e = base + first * itemsize, base + end * itemsize
                    scratch.append((b, e))
                    later.append((r, req, lay, dest, b, first))
            if fallback:
                whole = _merge([(r.info.offset, r.info.offset + r.info.length) for r in fallback], 0)
                scratch += [(b, e) for b, e in whole]
            runs = _merge([s for s in scratch if s[1] > s[0]], 0)
            reads: list[asyncio.Future[Any]] = [asyncio.ensure_future(_read_runs(f, runs))]
            if direct:
                direct.sort(key=lambda it: it[1])
                reads.append(asyncio.ensure_future(f.pread_many(direct)))
            try:
                results = await asyncio.gather(*reads)
            except BaseException:
                for t in reads:
                    t.cancel()
                await asyncio.gather(*reads, return_exceptions=True)
                raise
            self.stats["requests"] += 1
            got2 = results[0]
            for _, req, lay, dest, b, first in later:
                src = self._box_from(got2, lay, req, b, first)
                self.stats["scratch_bytes"] += src.numel() * src.element_size()
                await self._copy(dest, src, req)
                done.append((req, dest))
            for r in fallback:
                self.stats["fallbacks"] += 1
                mem = _slice(got2, r.info.offset, r.info.offset + r.info.length)
                await self._from_memory(r, mem, planner, done, parsed=False)
        for req, dest in done:
            planner.commit_tensor(req, dest)

    @staticmethod
    def _dest(planner: LoadPlanner, req: ReadItem) -> torch.Tensor:
        dest = planner.resolve_tensor(req).detach()
        if tuple(dest.shape) != tuple(req.lengths):
            raise CheckpointFormatError(
                f"{req.storage_index.fqn}: destination has shape {tuple(dest.shape)}, "
                f"the plan reads {tuple(req.lengths)}"
            )
        return dest

    @staticmethod
    def _box_from(
        got: list[tuple[int, memoryview]], lay: Layout, req: ReadItem, b: int, first: int
    ) -> torch.Tensor:
        """The box ``req`` reads, as a view of scratch memory starting at file
        offset ``b`` (storage element ``first``)."""
        if math.prod(req.lengths) == 0:
            return torch.empty(tuple(req.lengths), dtype=lay.dtype)
        itemsize = torch.empty(0, dtype=lay.dtype).element_size()
        _, end = _span(lay, req.storage_offsets, req.lengths)
        mem = _slice(got, b, b + (end - first) * itemsize)
        flat = _torch_view(mem, lay.dtype)
        start = sum(o * st for o, st in zip(req.storage_offsets, lay.stride)) + lay.storage_offset - first
        return flat.as_strided(tuple(req.lengths), lay.stride, start)

    async def _copy(self, dest: torch.Tensor, src: torch.Tensor, req: ReadItem) -> None:
        if src.numel() * src.element_size() > _BIG_COPY:
            await asyncio.to_thread(dest.copy_, src)
        else:
            dest.copy_(src)

    async def _from_memory(
        self,
        r: _Record,
        mem: memoryview,
        planner: LoadPlanner,
        done: list[tuple[ReadItem, torch.Tensor]],
        parsed: bool = True,
    ) -> None:
        """Items of a record read whole into memory."""
        lay = None
        for req in r.reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(mem)))
                continue
            if lay is None and parsed:
                raw = bytes(mem)
                lay = parse(raw, raw, len(raw))
            dest = self._dest(planner, req)
            if lay is not None:
                itemsize = torch.empty(0, dtype=lay.dtype).element_size()
                data = mem[lay.data_offset : lay.data_offset + lay.storage_numel * itemsize]
                whole = _torch_view(data, lay.dtype) if lay.storage_numel else torch.empty(0, dtype=lay.dtype)
                full = whole.as_strided(lay.size, lay.stride, lay.storage_offset) if whole.numel() else whole
                src = full
                if full.numel():
                    for d, (o, ln) in enumerate(zip(req.storage_offsets, req.lengths)):
                        src = src.narrow(d, o, ln)
                else:
                    src = torch.empty(tuple(req.lengths), dtype=lay.dtype)
            else:
                loaded = torch.load(io.BytesIO(bytes(mem)), map_location="cpu", weights_only=True)
                if not isinstance(loaded, torch.Tensor):
                    raise CheckpointFormatError(f"{req.storage_index.fqn}: the record holds no tensor")
                src = loaded
                for d, (o, ln) in enumerate(zip(req.storage_offsets, req.lengths)):
                    if ln < src.size(d):
                        src = src.narrow(d, o, ln)
            if tuple(src.shape) != tuple(dest.shape):
                raise CheckpointFormatError(
                    f"{req.storage_index.fqn}: saved box {tuple(src.shape)}, destination {tuple(dest.shape)}"
                )
            await self._copy(dest, src, req)
            done.append((req, dest))

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in os.fspath(checkpoint_id)
