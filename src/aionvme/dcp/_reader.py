"""``aionvme.dcp.Reader``: a torch.distributed.checkpoint StorageReader that
reads each data file in one batched O_DIRECT request.

Per rank and file, the records the load plan needs are sorted by offset. One
``pread_many`` reads: the small records whole; the first and last 4 KiB of
each large one (where a torch.save archive keeps its pickle and its central
directory); and the large ones' tensor bytes, at the place the metadata
predicts (the saved chunk's dtype and shape give the archive torch.save
writes for it, and the record's length must match). Tensor bytes go straight
into the destination tensor where they are the destination's bytes (same
dtype, a contiguous range of the saved chunk, a contiguous destination), or
else into page-aligned scratch memory and are copied (a cast, a box of the
saved chunk that is not one range); ranges closer than 64 KiB are read as one.
Then each predicted layout is checked against the record's own bytes
(:func:`._record.parse`); a record that is not as predicted is read again in a
second request, as parsed, or whole and given to ``torch.load`` (what
``FileSystemReader`` does) when it is not a plain tensor archive. The files of
one rank are read concurrently.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import io
import math
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._runtime.background import background
from ..exceptions import AionvmeError
from ..file import File
from ..memory import empty
from ._common import METADATA, PAGE, align_up, run
from ._dist import distributed
from ._fetch import Peers
from ._record import Layout, parse, template

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


class _Got:
    """What a request read into scratch memory: (file offset, bytes) runs,
    sorted and disjoint."""

    def __init__(self, runs: list[tuple[int, memoryview]]) -> None:
        self.runs = runs
        self.starts = [b for b, _ in runs]

    def slice(self, begin: int, end: int) -> memoryview:
        i = bisect.bisect_right(self.starts, begin) - 1
        if i >= 0:
            b, mv = self.runs[i]
            if end <= b + len(mv):
                return mv[begin - b : end - b]
        raise RuntimeError("range not read")  # pragma: no cover - planned before the read


def _torch_view(mem: memoryview, dtype: torch.dtype) -> torch.Tensor:
    raw = torch.frombuffer(mem, dtype=torch.uint8) if len(mem) else torch.empty(0, dtype=torch.uint8)
    return raw if dtype == torch.uint8 else raw.view(dtype)


class _Plan:
    """The tensor reads of some records: (record, request, layout,
    destination, direct, file offset, bytes, first storage element)."""

    def __init__(self) -> None:
        self.items: list[tuple[_Record, ReadItem, Layout, torch.Tensor, bool, int, int, int]] = []

    def add(self, r: _Record, lay: Layout, dest: Any) -> None:
        itemsize = torch.empty(0, dtype=lay.dtype).element_size()
        base = r.info.offset + lay.data_offset
        for req in r.reqs:
            d: torch.Tensor = dest(req)
            box = _box_range(lay, req.storage_offsets, req.lengths)
            if (
                box is not None
                and d.device.type == "cpu"
                and d.dtype == lay.dtype
                and d.is_contiguous()
                and d.numel() == box[1]
            ):
                self.items.append((r, req, lay, d, True, base + box[0] * itemsize, box[1] * itemsize, 0))
                continue
            first, end = _span(lay, req.storage_offsets, req.lengths)
            if math.prod(req.lengths) == 0:
                first = end = 0
            self.items.append(
                (r, req, lay, d, False, base + first * itemsize, (end - first) * itemsize, first)
            )

    async def fetch(self, f: File, ranges: list[tuple[int, int]]) -> _Got:
        """One pread_many: ``ranges`` and the scratch reads into page-aligned
        memory (merged), the direct reads into their destinations."""
        ranges = ranges + [(b, b + n) for _, _, _, _, direct, b, n, _ in self.items if not direct and n]
        runs = _merge(ranges, _MERGE_GAP)
        place, total = [], 0
        for b, e in runs:
            fs = b // PAGE * PAGE
            place.append((total, fs, e - fs, b))
            total += align_up(e - fs)
        mem = memoryview(empty(total))
        batch: list[tuple[Any, int]] = [(mem[p : p + n], fs) for p, fs, n, _ in place]
        batch += [(d, b) for _, _, _, d, direct, b, n, _ in self.items if direct and n]
        batch.sort(key=lambda it: it[1])
        if batch:
            await f.pread_many(batch)
        return _Got([(b, mem[p + b - fs : p + n]) for p, fs, n, b in place])

    def finish(
        self, got: _Got, records: set[int] | None, stats: dict[str, int]
    ) -> tuple[list[tuple[ReadItem, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
        """(request, destination) of the reads done for ``records`` (ids; all
        if None), and the (destination, source) copies left to make."""
        done, copies = [], []
        for r, req, lay, d, direct, b, n, first in self.items:
            if records is not None and id(r) not in records:
                continue
            if direct:
                stats["direct_bytes"] += n
            else:
                src = _box_from(got, lay, req, b, first)
                stats["scratch_bytes"] += src.numel() * src.element_size()
                copies.append((d, src))
            done.append((req, d))
        return done, copies


def _box_from(got: _Got, lay: Layout, req: ReadItem, b: int, first: int) -> torch.Tensor:
    """The box ``req`` reads, as a view of scratch memory starting at file
    offset ``b`` (storage element ``first``)."""
    if math.prod(req.lengths) == 0:
        return torch.empty(tuple(req.lengths), dtype=lay.dtype)
    itemsize = torch.empty(0, dtype=lay.dtype).element_size()
    _, end = _span(lay, req.storage_offsets, req.lengths)
    mem = got.slice(b, b + (end - first) * itemsize)
    flat = _torch_view(mem, lay.dtype)
    start = sum(o * st for o, st in zip(req.storage_offsets, lay.stride)) + lay.storage_offset - first
    return flat.as_strided(tuple(req.lengths), lay.stride, start)


class Reader(StorageReader):
    """A ``torch.distributed.checkpoint`` storage reader on aionvme.

    ::

        import torch.distributed.checkpoint as dcp, aionvme.dcp
        dcp.load(state_dict, storage_reader=aionvme.dcp.Reader("/nvme/ckpt/step100"))

    Reads checkpoints written by :class:`aionvme.dcp.Writer` and by torch's
    ``FileSystemWriter``, with resharding (any number of ranks, DTensor and
    ShardedTensor state dicts), as ``FileSystemReader`` does.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint directory; in a process group, each node's own.
    peers : bool or None, default None
        Whether the ranks talk over the default process group; None: when it
        is initialized with more than one rank. Pass False for a load on a
        subgroup, and for ``dcp.load(no_dist=True)`` in a group.

    Notes
    -----
    In a process group, a node's directory need not hold the whole
    checkpoint: what it lacks (``.metadata``, data files lost with a node
    or never written there, as with ``Writer(replicas=...)`` or any save on
    node-local disks) comes from a rank of a node that holds it, over the
    process group (whole records; ``stats["peer_bytes"]``,
    ``stats["served_bytes"]``). No rank opens another node's directory.
    Files no live node holds raise :class:`CheckpointMissingError` on every
    rank, naming them and their items.

    Per rank, each data file is read in two batched requests (see the
    module's documentation); tensor bytes go with O_DIRECT into the
    destination tensors when they can (a page-aligned destination, such as
    one from :func:`aionvme.empty`, is zero-copy), else into page-aligned
    scratch memory and are copied. Items saved with stream transforms
    (torch's experimental ``_extensions``) are not supported and raise
    :class:`CheckpointFormatError`.
    """

    def __init__(self, path: str | os.PathLike[str], *, peers: bool | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.peers = peers
        self._peers: Peers | None = None
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.rank: int | None = None
        self._metadata: Metadata | None = None
        self._planner: LoadPlanner | None = None
        self.stats = {
            "files": 0,
            "requests": 0,
            "direct_bytes": 0,
            "scratch_bytes": 0,
            "fallbacks": 0,
            "peer_bytes": 0,
            "served_bytes": 0,
        }

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        self._peers = None
        peers = self.peers if self.peers is not None else distributed()
        if peers and rank is None:
            # Collective: DCP calls read_metadata (without rank) on every rank.
            self._peers = Peers(self.path)
            metadata = pickle.loads(self._peers.metadata())
        else:
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
        self._metadata = metadata
        self.rank = kwargs.get("rank")
        if self._peers is not None:
            where: dict[str, list[str]] = {}
            for index, info in self.storage_data.items():
                where.setdefault(info.relative_path, []).append(index.fqn)
            self._peers.check(where)
            if self._peers.all_local(set(where)):
                self._peers = None  # every directory holds every file: nothing to fetch

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
        self._planner = planner
        try:
            if self._peers is None:
                run(self._read_all(per_file, planner))
            else:
                self._read_with_peers(self._peers, per_file, planner)
        finally:
            self._planner = None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_with_peers(
        self, peers: Peers, per_file: dict[str, dict[tuple[int, int], _Record]], planner: LoadPlanner
    ) -> None:
        """Read what this directory holds while the records it lacks arrive
        from the ranks that hold them (whole records), then load those."""
        local = {n: recs for n, recs in per_file.items() if peers.holds(n)}
        remote = [r for n, recs in per_file.items() if not peers.holds(n) for r in recs.values()]
        reading = background().submit(self._read_all(local, planner))
        try:
            wanted = [(r.info.relative_path, r.info.offset, r.info.length) for r in remote]
            got = peers.fetch(wanted, self.stats)
        except BaseException:
            reading.cancel()
            with contextlib.suppress(BaseException):
                reading.result()
            raise
        reading.result()
        run(self._load_records(remote, got, planner))

    async def _load_records(self, recs: list[_Record], mems: list[memoryview], planner: LoadPlanner) -> None:
        done: list[tuple[ReadItem, torch.Tensor]] = []
        for r, mem in zip(recs, mems):
            await self._from_memory(r, mem, done, lambda req: self._dest(planner, req))
        for req, d in done:
            planner.commit_tensor(req, d)

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

    def _predict(self, r: _Record) -> Layout | None:
        """The layout a record has if torch.save wrote it for a contiguous
        tensor of the saved chunk's dtype and shape (what both writers write
        for plain tensors): the metadata says which, the record's length must
        match. Checked against the record's own bytes once they are read."""
        md = self._metadata
        if md is None or len(r.reqs) == 0:
            return None
        index = r.reqs[0].storage_index
        meta = md.state_dict_metadata.get(index.fqn)
        if not isinstance(meta, TensorStorageMetadata):
            return None
        offsets = tuple(index.offset) if index.offset is not None else None
        chunk = next((c for c in meta.chunks if tuple(c.offsets) == offsets), None)
        if chunk is None:
            return None
        size = tuple(int(x) for x in chunk.sizes)
        dtype = meta.properties.dtype
        tpl = template(dtype, size)
        nbytes = math.prod(size) * torch.empty(0, dtype=dtype).element_size()
        if tpl is None or nbytes == 0 or r.info.length != len(tpl.head) + nbytes + len(tpl.tail):
            return None
        return Layout(len(tpl.head), dtype, math.prod(size), 0, size, _contiguous_strides(size))

    async def _read_file(self, path: str, recs: list[_Record], planner: LoadPlanner) -> None:
        recs.sort(key=lambda r: r.info.offset)
        self.stats["files"] += 1
        dests: dict[int, torch.Tensor] = {}  # id(ReadItem) -> its destination, resolved once

        def dest(req: ReadItem) -> torch.Tensor:
            d = dests.get(id(req))
            if d is None:
                d = dests[id(req)] = self._dest(planner, req)
            return d

        with File(path, "r") as f:
            probes: list[tuple[int, int]] = []
            plan = _Plan()
            predicted: dict[int, Layout] = {}
            for r in recs:
                o, n = r.info.offset, r.info.length
                if n <= _SMALL or any(q.type == LoadItemType.BYTE_IO for q in r.reqs):
                    r.whole = True
                    probes.append((o, o + n))
                    continue
                probes += [(o, o + _PROBE), (o + n - _PROBE, o + n)]
                lay = self._predict(r)
                if lay is not None:
                    predicted[id(r)] = lay
                    plan.add(r, lay, dest)
            got = await plan.fetch(f, probes)
            self.stats["requests"] += 1
            # Check the predictions; plan what they got wrong.
            retry = _Plan()
            fallback: list[_Record] = []
            for r in recs:
                if r.whole:
                    continue
                o, n = r.info.offset, r.info.length
                lay = parse(bytes(got.slice(o, o + _PROBE)), bytes(got.slice(o + n - _PROBE, o + n)), n)
                if lay is not None and predicted.get(id(r)) == lay:
                    continue
                predicted.pop(id(r), None)
                if lay is None:
                    fallback.append(r)
                else:
                    retry.add(r, lay, dest)
            done, copies = plan.finish(got, set(predicted), self.stats)
            for r in recs:
                if r.whole:
                    await self._from_memory(
                        r, got.slice(r.info.offset, r.info.offset + r.info.length), done, dest
                    )
            if retry.items or fallback:
                # A second request: as parsed, or whole for torch.load.
                got2 = await retry.fetch(
                    f, [(r.info.offset, r.info.offset + r.info.length) for r in fallback]
                )
                self.stats["requests"] += 1
                done2, copies2 = retry.finish(got2, None, self.stats)
                done += done2
                copies += copies2
                for r in fallback:
                    self.stats["fallbacks"] += 1
                    mem = got2.slice(r.info.offset, r.info.offset + r.info.length)
                    await self._from_memory(r, mem, done, dest, parsed=False)
            for d, src in copies:
                await self._copy(d, src)
        for req, d in done:
            planner.commit_tensor(req, d)

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
    async def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
        if src.numel() * src.element_size() > _BIG_COPY:
            await asyncio.to_thread(dest.copy_, src)
        else:
            dest.copy_(src)

    async def _from_memory(
        self,
        r: _Record,
        mem: memoryview,
        done: list[tuple[ReadItem, torch.Tensor]],
        dest_of: Any,
        parsed: bool = True,
    ) -> None:
        """Items of a record read whole into memory."""
        planner = self._planner
        if planner is None:  # pragma: no cover - set for the duration of read_data
            raise RuntimeError("no planner")
        lay = None
        for req in r.reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(mem)))
                continue
            if lay is None and parsed:
                n = len(mem)
                if n > _SMALL:  # the archive's pickle is in its head, its directory in its tail
                    lay = parse(bytes(mem[:_PROBE]), bytes(mem[n - _PROBE :]), n)
                else:
                    raw = bytes(mem)
                    lay = parse(raw, raw, n)
            dest = dest_of(req)
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
            await self._copy(dest, src)
            done.append((req, dest))

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in os.fspath(checkpoint_id)
