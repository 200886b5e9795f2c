"""``aionvme.dcp.Writer``: a torch.distributed.checkpoint StorageWriter that
writes each rank's items into one file with batched O_DIRECT writes.

On disk it is what ``FileSystemWriter`` writes (so ``FileSystemReader`` loads
it): ``.distcp`` data files holding, per item, a whole torch.save archive (a
tensor) or the raw bytes (other objects), and a pickled ``Metadata`` in
``.metadata`` whose ``storage_data`` maps each item to
``_StorageInfo(relative_path, offset, length)``. The layout differs only in
where the records sit: each tensor's storage bytes start at a file offset
equal to their address modulo 4 KiB, so the whole pages of the tensor's
memory are whole pages of the file and go to the device with O_DIRECT,
without a copy, wherever torch's allocator put the tensor (64 bytes past a
page, typically); all the small pieces (the archives' headers and trailers,
the byte items, the partial pages at the ends of tensors, tensors spanning no
whole page) are gathered into page-aligned buffers. Every write is whole
pages: no read-modify-write.

Crash safety: data files get fresh names in every save (a random token in
the name), are fsynced, and their directory entries too, before the metadata
is written through :func:`aionvme.atomic_write` (temporary name, fsync,
rename, directory fsync). Until that rename, the directory's previous
``.metadata`` and the files it names are untouched; after it, the data files
no committed metadata names are removed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import io
import os
import pickle
import re
import secrets
import time
import uuid
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import defaults
from .._runtime.background import background
from ..atomic import atomic_write, fsync_dir
from ..file import File
from ..memory import AlignedBuffer, empty
from ._common import METADATA, PAGE, SUFFIX, run
from ._dist import (
    CHUNK,
    CheckpointPeerError,
    Incoming,
    SaveLock,
    Topology,
    distributed,
    group,
    recv_head,
    send_file,
    send_head,
)
from ._record import template
from ._stage import Stager, small_pages

__all__ = ["Writer"]

# Names of the data files written by DCP writers: ours are __{rank}_{token}_{n}.distcp,
# torch's __{rank}_{n}.distcp. Only such files are removed as stale after a commit.
_DATA_NAME = re.compile(r"^__\d+_[0-9A-Za-z_]*\.distcp$")


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """SavePlan.storage_data: the file name prefix of one rank in one save."""

    prefix: str
    token: str = ""


class _Pages:
    """Small pieces of a file (headers, trailers, byte items, partial pages),
    gathered into page-aligned buffers covering whole pages: each run of
    touched pages becomes one buffer and one O_DIRECT write."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, Any]] = []  # (file offset, bytes-like or uint8 tensor)

    def add(self, offset: int, data: Any) -> None:
        if len(data):
            self.pieces.append((offset, data))

    def buffers(self) -> list[tuple[np.ndarray, int]]:
        self.pieces.sort(key=lambda p: p[0])
        runs: list[list[Any]] = []  # [first page, end page, pieces]
        for off, data in self.pieces:
            first, end = off // PAGE, (off + len(data) + PAGE - 1) // PAGE
            if runs and first <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], end)
                runs[-1][2].append((off, data))
            else:
                runs.append([first, end, [(off, data)]])
        out = []
        for first, end, pieces in runs:
            buf = empty((end - first) * PAGE)  # zero-filled, page-aligned
            base = first * PAGE
            for off, data in pieces:
                if isinstance(data, torch.Tensor):
                    buf[off - base : off - base + len(data)] = data.numpy()
                else:
                    buf[off - base : off - base + len(data)] = np.frombuffer(data, dtype=np.uint8)
            out.append((buf, base))
        return out


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (no copy)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def _host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor: itself when it is one, else a copy
    into page-aligned memory (so the copy's write is zero-copy O_DIRECT)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():  # lazy views: the memory does not hold the values
        t = t.resolve_conj().resolve_neg()
    if t.device.type == "cpu" and t.is_contiguous():
        return t
    out = small_pages(t)
    out.copy_(t)
    return out


class _Layout:
    """Places one rank's items in one file and collects what to write."""

    def __init__(self, relative_path: str) -> None:
        self.relative_path = relative_path
        self.pos = 0
        self.pages = _Pages()
        self.bodies: list[tuple[Any, int]] = []  # (uint8 tensor, file offset), whole pages
        self.keep: list[Any] = []  # tensors that must outlive the writes
        self.results: list[WriteResult] = []

    def _result(self, item: WriteItem, offset: int, length: int) -> None:
        info = _StorageInfo(self.relative_path, offset, length)
        self.results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))

    def add_bytes(self, item: WriteItem, data: Any) -> None:
        raw = bytes(data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data))
        self.pages.add(self.pos, raw)
        self._result(item, self.pos, len(raw))
        self.pos += len(raw)

    def add_tensor(self, item: WriteItem, value: torch.Tensor) -> None:
        t = _host_contiguous(value)
        tpl = template(t.dtype, tuple(t.shape)) if t.layout == torch.strided and not t.is_quantized else None
        if tpl is None:  # not a plain tensor: the whole archive, as torch's writer makes it
            buf = io.BytesIO()
            torch.save(t, buf)
            self.add_bytes(item, buf)
            return
        data = _byte_view(t)
        nbytes = len(data)
        if nbytes == 0:  # nothing to align
            self.add_bytes(item, tpl.head + tpl.tail)
            return
        head = len(tpl.head)
        # The storage bytes go where their file offset and their address agree
        # modulo the page: the whole pages the tensor spans in memory are then
        # pages of the file, written straight from the tensor (a torch-allocated
        # tensor sits 64 bytes past a page); only the partial pages at its two
        # ends are copied, into the gathered buffers with the archive's pieces.
        # A tensor that spans no whole page is packed after the previous item.
        addr = data.data_ptr() % PAGE
        lead = (PAGE - addr) % PAGE
        body = (nbytes - lead) // PAGE * PAGE if nbytes > lead else 0
        if body:
            at = self.pos + head + (addr - self.pos - head) % PAGE  # storage bytes' file offset
        else:
            at, lead = self.pos + head, nbytes
        start = at - head
        self.pages.add(start, tpl.head)
        self.pages.add(at, data[:lead])
        if body:
            self.bodies.append((data[lead : lead + body], at + lead))
        self.pages.add(at + lead + body, data[lead + body :])
        self.pages.add(at + nbytes, tpl.tail)
        length = head + nbytes + len(tpl.tail)
        self.keep.append(t)
        self._result(item, start, length)
        self.pos = start + length


def _items(layout: _Layout) -> list[tuple[Any, int]]:
    """What to write for a layout: (bytes, file offset), sorted and disjoint."""
    items: list[tuple[Any, int]] = list(layout.bodies)
    items += layout.pages.buffers()
    items.sort(key=lambda it: it[1])
    return items


async def _write_file(path: str, items: list[tuple[Any, int]], length: int, sync: bool) -> None:
    # "x": a fresh, randomly named file; O_EXCL never follows a link planted at its name
    f = File(path, "x", block_size=defaults.bulk_write_block())
    try:
        if items:
            await f.pwrite_many(items)
        f.truncate(length)  # the last page was written whole
        if sync:
            await f.fsync()
    finally:
        f.close()


# Chunks of a received file in flight per sender: one arriving while the
# others are written. The buffers are recycled mappings (aionvme.memory's
# pool): the next save's receives reuse memory already faulted in, where a
# buffer the size of the file would fault in fresh pages, 1-5 s/GiB on a VM
# whose guest has returned them to the host.
_RING = 4


async def _write_received(path: str, inc: Incoming, sync: bool) -> None:
    """Receive a file from a peer chunk by chunk into a small ring of
    buffers, writing each chunk as soon as it has arrived while the next
    ones come (chunks are whole pages at page offsets, as the sender's own
    writes: the copy is the same file). Every chunk is received even when
    this file cannot be written, so the sender never waits for ever; a lost
    sender raises and ends the receive."""
    f: File | None = None
    err: BaseException | None = None
    try:
        f = File(path, "x", block_size=defaults.bulk_write_block())
    except OSError as e:
        err = e
    ring = [np.frombuffer(memoryview(AlignedBuffer(CHUNK, recycle=True)), np.uint8) for _ in range(_RING)]
    writes: list[Any] = [None] * _RING
    failed: BaseException | None = None
    try:
        for i, (off, _) in enumerate(inc.chunks):
            slot = i % _RING
            if writes[slot] is not None:  # its buffer is free again once its write is done
                try:
                    await writes[slot]
                except Exception as e:
                    failed = failed or e
                writes[slot] = None
            got = await asyncio.to_thread(inc.receive, i, ring[slot])
            if f is not None and failed is None and len(got):
                writes[slot] = asyncio.ensure_future(f.pwrite(got, off))
    finally:
        live = [w for w in writes if w is not None]
        done = await asyncio.gather(*live, return_exceptions=True)  # none left writing from the ring
        try:
            failed = failed or next((r for r in done if isinstance(r, BaseException)), None)
            if err is None and failed is None and f is not None:
                f.truncate(inc.length)
                if sync:
                    await f.fsync()
        finally:
            if f is not None:
                f.close()
    if err is not None:
        raise err
    if failed is not None:
        raise failed


def write_replicated(
    path: str, layout: _Layout | None, topo: Topology, replicas: int, sync: bool, token: str
) -> BaseException | None:
    """Write this rank's file (``layout``; None when building it failed)
    into ``path`` while its bytes go to the ranks keeping its replicas, and
    write the files received from the ranks whose replicas this rank keeps
    (each under its sender's name, chunk by chunk as they land). Every
    header goes out before any is awaited, and every send and receive is
    made whatever failed, so no peer waits for ever; returns the first error
    (or None)."""
    err: BaseException | None = None
    bg = background()
    items = _items(layout) if layout is not None else None
    local = None
    if layout is not None and items is not None:
        local = bg.submit(_write_file(os.path.join(path, layout.relative_path), items, layout.pos, sync))
    copies = []
    works: list[Any] = []
    targets = topo.targets(topo.rank, replicas)
    try:
        for dst in targets:
            works += send_head(items, layout.pos if layout is not None else 0, dst)
        incoming = [recv_head(src) for src in topo.sources(topo.rank, replicas)]
    except Exception as e:
        err, incoming = e, []
    try:
        for dst in targets:
            works += send_file(items, dst)
        for inc in incoming:
            if inc is not None:
                name = os.path.join(path, f"__{inc.src}_{token}_0{SUFFIX}")
                copies.append(bg.submit(_write_received(name, inc, sync)))
        for w in works:
            w.wait()
    except Exception as e:
        err = err or e
    for fut in ([local] if local is not None else []) + copies:
        try:
            fut.result()
        except Exception as e:
            err = err or e
    if err is None and sync:
        try:
            fsync_dir(path)  # the new files' entries, before any metadata names them
        except OSError as e:
            err = e
    return err


def _save_id() -> str:
    """A save's id, ordered by time (nanoseconds, then a random uuid): of two
    nodes' ``.metadata`` after a crash between their commits, the reader
    loads the newest complete one."""
    return f"{time.time_ns():020d}-{uuid.uuid4()}"


class Writer(StorageWriter, Stager):
    """A ``torch.distributed.checkpoint`` storage writer on aionvme.

    ::

        import torch.distributed.checkpoint as dcp, aionvme.dcp
        dcp.save(state_dict, storage_writer=aionvme.dcp.Writer("/nvme/ckpt/step100"))
        fut = dcp.async_save(state_dict, storage_writer=aionvme.dcp.Writer("/nvme/ckpt/step200"))

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint directory (made if missing). In a process group it may
        be each node's own disk: the ranks of a node (torchrun's
        ``GROUP_RANK``, else the host name) share it, and every node's
        directory gets the ``.metadata``.
    replicas : int, default 1
        How many nodes keep each rank's data file: each node writes its
        ranks' files and a copy of those of the ``replicas - 1`` nodes before
        it (ring order: the nodes' lowest ranks), received over the process
        group while its own writes run. Needs ``replicas`` node-local
        directories and a save by every rank of the default group; 1 is the
        plain format (the nodes' directories gathered into one load with
        ``FileSystemReader``).
    sync_files : bool, default True
        fsync the data files, then their directory, before the metadata is
        committed. Without it a crash may leave a committed checkpoint whose
        data is not on the device.
    overwrite : bool, default True
        Save over a checkpoint already in ``path`` (its files are replaced
        only once the new checkpoint is committed); False raises
        ``FileExistsError`` instead.
    cache_staged_state_dict : bool, default False
        For ``dcp.async_save``: keep the page-aligned staging buffers and
        copy the next state dict of the same shapes into them.
    remove_stale : bool, default True
        After the commit, remove the ``__*.distcp`` data files in ``path``
        that the new metadata does not name (those of the checkpoint it
        replaced, or of an interrupted save).
    peers : bool or None, default None
        Whether the ranks talk over the default process group (node
        topology, replicas, metadata for every node); None: when it is
        initialized with more than one rank and DCP's rank for this save is
        the default group's. Pass False for a save on a subgroup, and for
        ``dcp.save(no_dist=True)`` in a group: these ranks' collectives would
        wait for ranks that do not save.

    Notes
    -----
    Each rank writes one file, ``__{rank}_{token}_0.distcp``, in one batch of
    O_DIRECT writes: the whole pages of each tensor's memory straight from
    it, at file offsets that agree with their addresses modulo 4 KiB, so
    tensors at any address are written without a copy (one that is not
    contiguous, or not on the CPU, is first copied into page-aligned memory);
    everything else from page-aligned buffers. Where the process can see
    that a tensor's pages are scattered in physical memory, its writes go
    through the engine's huge-page buffers instead, in fewer, larger device
    requests (``aionvme.defaults`` ``write_copy``). The file
    is fsynced, then the directory. The coordinator then writes ``.metadata``
    atomically: a crash at any point leaves the previous checkpoint in
    ``path`` loadable, or the new one complete.

    One save at a time per directory: the rank that commits a directory
    holds an exclusive ``flock`` on it from its plan to its commit, so a
    second save into it raises :class:`CheckpointBusyError` (inside DCP's
    ``CheckpointException``) before any rank writes; the kernel drops the
    lock with a killed process. Stale files are removed only under the lock,
    so a committed ``.metadata`` names only files that exist.

    With several nodes, every rank tells every other whether its part
    succeeded before any node commits: a failure on one rank raises on all
    (:class:`CheckpointPeerError` names it) and no directory's checkpoint
    changes.

    The format is ``FileSystemWriter``'s: ``FileSystemReader`` loads these
    checkpoints and :class:`aionvme.dcp.Reader` loads torch's. The records'
    CRC-32 fields are 0, as torch.save writes them with
    ``torch.serialization.set_crc32_options(False)`` (torch.load does not
    check them).

    As an ``AsyncStager`` (what ``dcp.async_save`` uses when given this
    writer), :meth:`stage` copies the state dict into page-aligned memory
    (pinned for CUDA tensors) before ``async_save`` returns; the write then
    runs on a thread with no copy left to make.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        replicas: int = 1,
        sync_files: bool = True,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
        remove_stale: bool = True,
        peers: bool | None = None,
    ) -> None:
        StorageWriter.__init__(self)
        Stager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, not {replicas!r}")
        self.path = os.fspath(path)
        self.replicas = replicas
        self.sync_files = sync_files
        self.overwrite = overwrite
        self.remove_stale = remove_stale
        self.peers = peers
        self.save_id = _save_id()
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = False
        self._topo: Topology | None = None
        self._lock: SaveLock | None = None
        self._token = ""

    # -- StorageWriter -------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._unlock()  # a save that failed on another rank never reached finish
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = _save_id()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._unlock()
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._topo = None
        # With peers, every rank of the default group takes part in this save.
        # DCP passes the rank in the save's group: where it differs from the
        # default group's (no_dist, most subgroups) peers stay off by themselves;
        # a subgroup that keeps the default ranks needs peers=False.
        peers = self.peers
        if peers is None:
            peers = distributed() and self.use_collectives and self.rank == dist.get_rank()
        if peers:
            err = None
            try:
                os.makedirs(self.path, exist_ok=True)
            except OSError as e:
                err = e
            self._topo = Topology.gather(self.path, is_coordinator)  # collective: reached even after err
            if err is not None:
                raise err
            self._topo.check_replicas(self.replicas, self.path)
        elif self.replicas > 1:
            raise ValueError(
                f"replicas={self.replicas} needs a save by every rank of the default process group "
                "(torch.distributed initialized, use_collectives=True)"
            )

    def _metadata_path(self, rank: int | None = None) -> str:
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        return os.path.join(self.path, name)

    def _leads(self) -> bool:
        """Whether this rank commits and cleans up its directory."""
        return self._topo.leader if self._topo is not None else self.is_coordinator

    def _unlock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.path, exist_ok=True)
        existing = self._metadata_path(None if self.use_collectives else 0)
        if self.use_collectives and self._leads():
            # Held until this directory's metadata is committed: a second save
            # into it raises CheckpointBusyError now, before any rank writes.
            self._lock = SaveLock(self.path)
        if os.path.exists(existing) and not self.overwrite:
            self._unlock()
            raise FileExistsError(f"a checkpoint exists in {self.path} and overwrite=False")
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_Prefix(f"__{self.rank}_{secrets.token_hex(4)}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = secrets.token_hex(4)
        return [
            dataclasses.replace(p, storage_data=_Prefix(f"__{i}_{token}_", token))
            if p.storage_data is None
            else p
            for i, p in enumerate(plans)
        ]

    def _layout(self, plan: SavePlan, planner: SavePlanner) -> _Layout:
        storage = plan.storage_data
        prefix = (
            storage.prefix if isinstance(storage, _Prefix) else f"__{self.rank or 0}_{secrets.token_hex(4)}_"
        )
        layout = _Layout(f"{prefix}0{SUFFIX}")
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                layout.add_bytes(item, planner.resolve_data(item))
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                if not isinstance(data, torch.Tensor):
                    raise TypeError(f"{item.index.fqn}: the planner resolved a tensor item to {type(data)}")
                layout.add_tensor(item, data)
        return layout

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._topo is not None and (self.replicas > 1 or len(self._topo.places) > 1):
            results = self._write_with_peers(plan, planner, self._topo)
        else:
            try:
                layout = self._layout(plan, planner)
                path = os.path.join(self.path, layout.relative_path)
                run(_write_file(path, _items(layout), layout.pos, self.sync_files))
                if self.sync_files:
                    fsync_dir(self.path)  # the new file's directory entry, before any metadata names it
            except BaseException:
                self._unlock()
                raise
            results = layout.results
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_with_peers(self, plan: SavePlan, planner: SavePlanner, topo: Topology) -> list[WriteResult]:
        """This rank's file, written here while its bytes go to the ranks
        that keep its replicas and the files of the ranks it keeps replicas
        of arrive; then every rank learns every rank's outcome, and each
        place's leader commits the metadata there (the coordinator's place
        in :meth:`finish`)."""
        err: BaseException | None = None
        layout: _Layout | None = None
        self._token = plan.storage_data.token if isinstance(plan.storage_data, _Prefix) else ""
        try:
            layout = self._layout(plan, planner)
        except Exception as e:
            err = e
        try:
            failure = write_replicated(self.path, layout, topo, self.replicas, self.sync_files, self._token)
            err = failure or err
            mine = None if err is None else f"{type(err).__name__}: {err}"
            everyone: list[Any] = [None] * len(topo.nodes)
            dist.all_gather_object(everyone, (mine, layout.results if layout else []), group=group())
            results = [r for _, r in everyone]
            failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(everyone) if e is not None]
            if err is not None:
                raise err
            if failed:
                raise CheckpointPeerError(errno.EIO, "a rank's part of the save failed: " + "; ".join(failed))
            md = getattr(planner, "metadata", None) if self.is_coordinator else None
            box = [pickle.dumps(self._final_metadata(md, results)) if isinstance(md, Metadata) else None]
            dist.broadcast_object_list(box, src=topo.coordinator, group=group())
            if topo.leader and not self.is_coordinator:
                if box[0] is None:
                    raise CheckpointPeerError(
                        errno.EINVAL, "the coordinator's planner exposes no metadata to send to this node"
                    )
                self._commit(box[0], results)
        except BaseException:
            self._unlock()
            raise
        if not self.is_coordinator:
            self._unlock()
        return layout.results if layout else []

    def _final_metadata(self, metadata: Metadata, results: list[list[WriteResult]]) -> Metadata:
        metadata.version = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        return metadata

    def _commit(self, raw: bytes, results: list[list[WriteResult]], target: str | None = None) -> None:
        """Write ``.metadata`` atomically, then remove the data files it does
        not name (under this directory's save lock, so only leftovers of
        earlier saves: never a file a committed metadata names)."""
        with atomic_write(target or self._metadata_path(), durable=self.sync_files) as f:
            if raw:
                f.sync_pwrite(raw, 0)
        if self.remove_stale and target is None:
            self._remove_stale({wr.storage_data.relative_path for rs in results for wr in rs})

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            metadata = self._final_metadata(metadata, results)
            rank_local = not self.use_collectives and self.rank is not None
            target = self._metadata_path(self.rank) if rank_local else None
            self._commit(pickle.dumps(metadata), results, target)
        finally:
            self._unlock()

    def _remove_stale(self, referenced: set[str]) -> None:
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            if _DATA_NAME.match(name) and name not in referenced:
                try:
                    os.unlink(os.path.join(self.path, name))
                except FileNotFoundError:
                    pass
                except OSError as e:  # the checkpoint is committed: a leftover file is no error
                    warnings.warn(f"could not remove stale checkpoint file {name}: {e}", stacklevel=3)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in os.fspath(checkpoint_id)
