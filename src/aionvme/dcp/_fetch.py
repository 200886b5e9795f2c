"""What a node's checkpoint directory lacks, fetched from a node that holds it.

Used by :class:`aionvme.dcp.Reader` when it loads in a process group. In
``read_metadata`` every rank publishes what its directory holds (whether it
has ``.metadata``, which data files); a rank whose directory has no
``.metadata`` gets it from the first rank that has one. Every rank then knows
every directory's files, so all agree on what no live node holds (a typed
error naming the files and their items) and on who serves what: a record
(one item's bytes in one data file) missing here is read by one rank of the
nearest place that holds its file (in ring order, spread over that place's
ranks by file) and sent over the process group. No rank opens anything but
its own directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._runtime.background import background
from ..file import File
from ..memory import AlignedBuffer, empty
from ._common import METADATA, PAGE, SUFFIX
from ._dist import CHUNK, CheckpointMissingError, CheckpointPeerError, Topology, group, populate

__all__ = ["Peers"]

Range = tuple[str, int, int]  # (data file, offset, length)


def _u8(mem: Any) -> torch.Tensor:
    return torch.frombuffer(mem, dtype=torch.uint8)


# Served records go out in chunks of CHUNK bytes read into a ring of this
# many recycled buffers (aionvme.memory's pool): a slot is read into again
# once its chunk has been sent, so serving needs no memory the size of what
# it serves (fresh memory faults in at 1-5 s/GiB on a VM whose guest has
# returned it to the host) and the reads go on while earlier chunks travel.
_RING = 4


def _tags(reqs: list[Any]) -> list[int]:
    """The first chunk's tag of each request (server, name, offset, length)
    of one rank: its chunks are numbered in request order."""
    out, t = [], 0
    for *_, n in reqs:
        out.append(t)
        t += (n + CHUNK - 1) // CHUNK
    return out


async def _serve(path: str, chunks: list[tuple[int, int, str, int, int]]) -> tuple[int, BaseException | None]:
    """Read and send each (rank, tag, file, offset, length) chunk in turn,
    from the page boundary before it into a ring slot (so the aligned
    middle goes with O_DIRECT). Every chunk is sent whatever failed (zeros
    for what could not be read); returns (bytes sent, first error)."""
    grp = group()
    ring = [
        np.frombuffer(memoryview(AlignedBuffer(CHUNK + PAGE, recycle=True)), np.uint8) for _ in range(_RING)
    ]
    sends: list[Any] = [None] * _RING
    files: dict[str, File] = {}
    err: BaseException | None = None
    sent = 0
    try:
        for k, (r, tag, name, off, n) in enumerate(chunks):
            slot = k % _RING
            if sends[slot] is not None:
                await asyncio.to_thread(sends[slot].wait)
                sends[slot] = None
            first = off // PAGE * PAGE
            mem = ring[slot][: off + n - first]
            try:
                if err is not None:
                    raise err
                if name not in files:
                    files[name] = File(os.path.join(path, name), "r")
                await files[name].pread(mem, first)
            except Exception as e:
                err = err or e
                mem[:] = 0
            sends[slot] = dist.isend(_u8(mem[off - first :]), r, group=grp, tag=tag)
            sent += n
        for w in sends:
            if w is not None:
                await asyncio.to_thread(w.wait)
    finally:
        for f in files.values():
            f.close()
    return sent, err


def _describe(raw: bytes) -> tuple[str, str, list[str]] | None:
    """(digest, save_id, data files named) of a ``.metadata`` file's bytes,
    None when they are no checkpoint metadata."""
    try:
        md = pickle.loads(raw)
        files = sorted({info.relative_path for info in md.storage_data.values()})
        save_id = str(getattr(md.storage_meta, "save_id", "") or "")
    except Exception:
        return None
    return hashlib.sha256(raw).hexdigest(), save_id, files


class Peers:
    """One load's view of the process group: every directory's files."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.topo: Topology | None = None
        self.files: list[set[str]] = []  # by place

    def metadata(self) -> bytes:
        """The ``.metadata`` this load uses: this directory's, or another
        rank's (collective: every rank of the default group calls it).

        Nodes commit one after another, so a crash between two commits
        leaves directories with different ``.metadata``: the newest (by the
        writer's time-ordered ``save_id``) whose files the live nodes hold
        is the one every rank loads (its data was complete on every node
        before the first commit)."""
        raw: bytes | None = None
        names: list[str] = []
        with contextlib.suppress(OSError), open(os.path.join(self.path, METADATA), "rb") as fh:
            raw = fh.read()
        with contextlib.suppress(OSError):
            names = sorted(n for n in os.listdir(self.path) if n.endswith(SUFFIX))
        mine = _describe(raw) if raw is not None else None
        self.topo = topo = Topology.gather(self.path, dist.get_rank() == 0, (mine, names), True)
        self.files = [set().union(*(topo.extra[r][1] for r in ranks)) for ranks in topo.places]
        held = set().union(*self.files)
        versions: dict[str, tuple[str, list[str], int]] = {}  # digest -> (save_id, files, first holder)
        for r, (desc, _) in enumerate(topo.extra):
            if desc is not None and desc[0] not in versions:
                versions[desc[0]] = (desc[1], desc[2], r)
        if not versions:
            raise CheckpointMissingError(self.path, {METADATA: []})
        complete = [d for d, (_, files, _) in versions.items() if set(files) <= held]
        chosen = max(complete or list(versions), key=lambda d: versions[d][0])
        if any(desc is None or desc[0] != chosen for desc, _ in topo.extra):
            src = versions[chosen][2]
            box = [raw if topo.rank == src else None]
            dist.broadcast_object_list(box, src=src, group=group())
            if mine is None or mine[0] != chosen:
                raw = box[0]
        if not isinstance(raw, bytes):  # pragma: no cover - a holder sends bytes
            raise CheckpointPeerError(errno.EPROTO, "no metadata arrived", self.path)
        return raw

    def check(self, where: dict[str, list[str]]) -> None:
        """Raise CheckpointMissingError for the files (with their items) no
        live directory holds; the same on every rank."""
        held = set().union(*self.files) if self.files else set()
        missing = {name: fqns for name, fqns in where.items() if name not in held}
        if missing:
            raise CheckpointMissingError(self.path, missing)

    def all_local(self, names: set[str]) -> bool:
        """Whether every directory holds all of ``names`` (then no rank fetches)."""
        return all(names <= files for files in self.files)

    def holds(self, name: str) -> bool:
        topo = self.topo
        return topo is not None and name in self.files[topo.place]

    def _server(self, name: str, order: list[str]) -> int:
        topo = self.topo
        if topo is None:  # pragma: no cover - set by metadata()
            raise RuntimeError("no topology")
        n = len(topo.places)
        g = min((g for g in range(n) if name in self.files[g]), key=lambda g: (g - topo.place) % n)
        ranks = topo.places[g]
        mine = topo.places[topo.place].index(topo.rank)
        return ranks[(order.index(name) + mine) % len(ranks)]

    def fetch(self, wanted: list[Range], stats: dict[str, int]) -> list[memoryview]:
        """The bytes of ``wanted`` (records of files this directory lacks),
        from the ranks that hold them, while this rank sends what others
        asked of it. Collective: every rank calls it once per load, each rank
        reaches every exchange whatever failed, and all raise if one did."""
        topo = self.topo
        if topo is None:  # pragma: no cover - set by metadata()
            raise RuntimeError("no topology")
        order = sorted(set().union(*self.files))
        mine = [(self._server(name, order), name, off, n) for name, off, n in wanted]
        asked: list[Any] = [None] * len(topo.nodes)
        dist.all_gather_object(asked, mine, group=group())
        # Every receive is posted first, every send is made whatever failed
        # (zeros for what could not be read), so no rank waits for ever; the
        # outcome is agreed on afterwards and all raise if a read failed.
        # Records travel in chunks of at most CHUNK bytes, tagged in the
        # order of the receiver's requests.
        grp = group()
        total = sum(n for _, _, _, n in mine)
        buf = memoryview(empty(max(total, 1)))
        got: list[memoryview] = []
        works: list[Any] = []
        pos = 0
        for (server, _, _, n), tag in zip(mine, _tags(mine)):
            got.append(buf[pos : pos + n])
            for j in range(0, n, CHUNK):
                piece = got[-1][j : j + CHUNK]
                populate(piece)  # faulted in before it lands, not inside gloo's socket copy
                works.append(dist.irecv(_u8(piece), server, group=grp, tag=tag + j // CHUNK))
            pos += n
        chunks: list[tuple[int, int, str, int, int]] = []
        for r, reqs in enumerate(asked):
            for (server, name, off, n), tag in zip(reqs, _tags(reqs)):
                if server == topo.rank:
                    chunks += [
                        (r, tag + j // CHUNK, name, off + j, min(CHUNK, n - j)) for j in range(0, n, CHUNK)
                    ]
        chunks.sort(key=lambda c: (c[2], c[3]))  # each file's chunks in file order
        serving = background().submit(_serve(self.path, chunks))
        err: BaseException | None = None
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:  # gloo: a peer's connection closed, or timed out
            err = CheckpointPeerError(errno.ECONNRESET, f"a rank stopped sending what this load fetches: {e}")
        try:
            served, unread = serving.result()
        except RuntimeError as e:  # gloo: a rank this one serves is gone
            lost = f"a rank stopped receiving what this one serves: {e}"
            raise CheckpointPeerError(errno.ECONNRESET, lost) from e
        err = err or unread
        status: list[Any] = [None] * len(topo.nodes)
        dist.all_gather_object(status, None if err is None else f"{type(err).__name__}: {err}", group=grp)
        if err is not None:
            raise err
        failed = [f"rank {r}: {e}" for r, e in enumerate(status) if e is not None]
        if failed:
            raise CheckpointPeerError(errno.EIO, "a rank could not read what it serves: " + "; ".join(failed))
        stats["peer_bytes"] += total
        stats["served_bytes"] += served
        return got
