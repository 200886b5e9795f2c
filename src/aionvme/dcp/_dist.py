"""What the DCP writer and reader do over the process group: who shares a
checkpoint directory with whom, one save per directory at a time, and moving
a data file's bytes between ranks.

Nodes. A node is torchrun's node rank (``GROUP_RANK``), else the host name;
the ranks of one node share its checkpoint directory. Ranks whose ``path`` is
the same directory (same device and inode) form one *place*: each place's
leader (the coordinator where it is one of them, else its lowest rank) locks
it, commits its ``.metadata`` and removes its stale files. Places are ordered
by their lowest rank; replicas of place ``g``'s files go to places
``g + 1 .. g + replicas - 1`` (mod the number of places).

Transport. Everything travels on torch.distributed: the default group when
its backend moves CPU tensors (gloo, or ``cpu:gloo,cuda:nccl``), else a gloo
group over the same ranks made once per process (the NCCL-only case: the
bytes are host memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import socket
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import memory
from ..exceptions import AionvmeError
from ._common import PAGE, align_up

__all__ = [
    "CheckpointBusyError",
    "CheckpointMissingError",
    "CheckpointPeerError",
    "SaveLock",
    "Topology",
    "distributed",
    "group",
    "node_id",
    "populate",
    "recv_head",
    "send_file",
    "send_head",
]


class CheckpointBusyError(AionvmeError, BlockingIOError):
    """Another save is writing into this checkpoint directory."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EWOULDBLOCK, "another save is writing into this checkpoint directory", path)

    def __reduce__(self) -> tuple[Any, ...]:  # DCP pickles a rank's error to the others
        return (type(self), (self.filename,))


class CheckpointMissingError(AionvmeError, FileNotFoundError):
    """Data a load needs is held by no live node. ``missing`` maps each
    absent file to the items it holds."""

    def __init__(self, path: str, missing: dict[str, list[str]]) -> None:
        self.missing = missing
        listed = "; ".join(f"{n} ({', '.join(sorted(fqns)[:8])})" for n, fqns in sorted(missing.items()))
        super().__init__(
            errno.ENOENT, f"no live node holds {len(missing)} file(s) of this checkpoint: {listed}", path
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.filename, self.missing))


class CheckpointPeerError(AionvmeError, OSError):
    """A rank of the group failed its part of a save or a load (its error is
    in the message); raised on every rank, so none commits or goes on."""


def node_id() -> str:
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_GLOO: dict[int, Any] = {}


def group() -> Any:
    """The group our bytes travel on (None: the default group). Collective
    on its first call in a process whose default backend cannot move CPU
    tensors."""
    if "gloo" in str(dist.get_backend()):
        return None
    key = id(dist.group.WORLD)
    if key not in _GLOO:  # pragma: no cover - NCCL-only default group (bench/gpu_check.sh)
        _GLOO[key] = dist.new_group(backend="gloo")
    return _GLOO[key]


def dir_identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


@dataclasses.dataclass
class Topology:
    """Every rank's node, place and whatever it published, the same on all ranks."""

    rank: int
    nodes: list[str]  # by rank
    places: list[list[int]]  # ranks of each place, in ring order
    place_of: list[int]  # by rank
    leaders: list[int]  # by place
    coordinator: int
    extra: list[Any]  # by rank

    @classmethod
    def gather(cls, path: str, is_coordinator: bool, extra: Any = None, missing_ok: bool = False) -> Topology:
        """All-gather (node, directory identity, coordinator?, extra) on
        :func:`group`. ``path`` must exist (unless ``missing_ok``: the ranks
        of one node then share a place); an error reading it is published as
        the identity, so no rank leaves the collective early."""
        try:
            ident: Any = dir_identity(path)
        except FileNotFoundError:
            ident = ("absent", node_id()) if missing_ok else f"{path} does not exist"
        except OSError as e:
            ident = f"unreadable: {e}"
        mine = (node_id(), ident, is_coordinator, extra)
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine, group=group())
        rank = dist.get_rank()
        errs = [f"rank {r}: {o[1]}" for r, o in enumerate(out) if isinstance(o[1], str)]
        if errs:
            raise CheckpointPeerError(errno.EIO, "; ".join(errs), path)
        by_ident: dict[Any, list[int]] = {}
        for r, o in enumerate(out):
            by_ident.setdefault(o[1], []).append(r)
        places = sorted(by_ident.values(), key=min)
        place_of = [0] * len(out)
        for g, ranks in enumerate(places):
            for r in ranks:
                place_of[r] = g
        leaders = [next((r for r in ranks if out[r][2]), min(ranks)) for ranks in places]
        coordinator = next((r for r, o in enumerate(out) if o[2]), 0)
        return cls(rank, [o[0] for o in out], places, place_of, leaders, coordinator, [o[3] for o in out])

    @property
    def place(self) -> int:
        return self.place_of[self.rank]

    @property
    def leader(self) -> bool:
        return self.leaders[self.place] == self.rank

    def check_replicas(self, replicas: int, path: str) -> None:
        n = len(self.places)
        if replicas > n:
            raise ValueError(
                f"replicas={replicas} needs {replicas} node-local directories; {path} is {n} "
                f"(nodes {sorted(set(self.nodes))})"
            )
        if replicas > 1:
            places_of: dict[str, set[int]] = {}
            for ranks in self.places:
                nodes = {self.nodes[r] for r in ranks}
                if len(nodes) > 1:
                    raise ValueError(
                        f"replicas={replicas}: nodes {sorted(nodes)} share the directory {path}; "
                        "replicas go to node-local directories"
                    )
                places_of.setdefault(nodes.pop(), set()).add(min(ranks))
            split = sorted(n for n, ps in places_of.items() if len(ps) > 1)
            if split:  # a "replica" there could land on the same node
                raise ValueError(
                    f"replicas={replicas}: the ranks of node(s) {split} name different directories "
                    f"as {path}; the ranks of a node share one"
                )

    def targets(self, rank: int, replicas: int) -> list[int]:
        """The ranks that receive a copy of ``rank``'s file, one per other place."""
        g = self.place_of[rank]
        i = self.places[g].index(rank)
        out = []
        for j in range(1, replicas):
            ranks = self.places[(g + j) % len(self.places)]
            out.append(ranks[i % len(ranks)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose files ``rank`` receives, in rank order."""
        return [r for r in range(len(self.nodes)) if rank in self.targets(r, replicas)]


class SaveLock:
    """One save at a time per directory: an exclusive ``flock`` on the
    directory itself (no lock file), taken without waiting. flock belongs to
    the open file description, so a second save in the same process
    conflicts like one in another process; the kernel drops it when its
    holder dies, so a crashed save never blocks the next. ``release`` is
    idempotent."""

    def __init__(self, path: str) -> None:
        self.fd: int | None = None
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise CheckpointBusyError(path) from None
            raise OSError(e.errno, e.strerror, path) from None
        self.fd = fd

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.release()


def _u8(buf: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(buf) if buf.size else torch.empty(0, dtype=torch.uint8)


# Pieces travel in chunks of at most this many bytes: the receiver faults in
# each chunk's pages just before it arrives and writes it while the next one
# comes (a received file is on its disk a chunk after its last byte arrived).
CHUNK = 16 << 20


def populate(mem: Any) -> None:
    """Fault in the pages of writable memory ``mem`` (a numpy array,
    memoryview or uint8 tensor) without changing its bytes, before a receive
    lands in them (:func:`aionvme.memory.populate`): gloo's receive into
    fresh anonymous memory runs at 0.5-1.4 GB/s, page faults inside the
    socket copy, against 4.3-5 GB/s into memory populated first."""
    if len(mem):
        t = mem if isinstance(mem, torch.Tensor) else torch.frombuffer(mem, dtype=torch.uint8)
        memory.populate(t.data_ptr(), t.numel())


def _chunks(pieces: list[tuple[Any, int]]) -> list[tuple[torch.Tensor, int]]:
    out = []
    for p, off in pieces:
        t = p if isinstance(p, torch.Tensor) else _u8(p)
        out += [(t[i : i + CHUNK], off + i) for i in range(0, t.numel(), CHUNK)]
    return out


def send_head(pieces: list[tuple[Any, int]] | None, length: int, dst: int) -> list[Any]:
    """Start sending a file's header to ``dst``: (chunk count, file length)
    and the chunks' (offset, size); None: this rank has no file to send.
    The chunks follow with :func:`send_file`. Returns the works to wait for."""
    grp = group()
    if pieces is None:
        return [dist.isend(torch.tensor([-1, 0], dtype=torch.int64), dst, group=grp)]
    chunks = _chunks(pieces)
    works = [dist.isend(torch.tensor([len(chunks), length], dtype=torch.int64), dst, group=grp)]
    if chunks:
        table = torch.tensor([[off, t.numel()] for t, off in chunks], dtype=torch.int64)
        works.append(dist.isend(table.reshape(-1), dst, group=grp))
    return works


def send_file(pieces: list[tuple[Any, int]] | None, dst: int) -> list[Any]:
    """Start sending a file's bytes to ``dst`` after :func:`send_head`: each
    piece (a uint8 tensor or page-aligned array) in chunks of at most
    :data:`CHUNK` bytes. Returns the works to wait for; the pieces must stay
    alive until then."""
    if pieces is None:
        return []
    grp = group()
    return [dist.isend(t, dst, group=grp) for t, _ in _chunks(pieces) if t.numel()]


@dataclasses.dataclass
class Incoming:
    """A file announced by :func:`recv_head`: its length and each chunk's
    (offset, size) in the order sent (page offsets; bytes between chunks
    are the sender's zero padding, a hole in the copy)."""

    src: int
    length: int
    chunks: list[tuple[int, int]]

    def receive(self, i: int, into: np.ndarray) -> np.ndarray:
        """Receive chunk ``i`` into the front of page-aligned ``into``
        (blocking; chunks in order), its pages faulted in first; returns
        the received bytes."""
        size = self.chunks[i][1]
        view = into[:size]
        if size:
            populate(view)
            try:
                work = dist.irecv(_u8(view), self.src, group=group())
                if work is not None:
                    work.wait()
            except RuntimeError as e:  # gloo: the sender's connection closed, or timed out
                raise CheckpointPeerError(
                    errno.ECONNRESET, f"rank {self.src} stopped sending its file (chunk {i}): {e}"
                ) from e
        return view


def recv_head(src: int) -> Incoming | None:
    """Receive what :func:`send_head` sent from ``src`` (blocking; None:
    the sender had no file); then :meth:`Incoming.receive` each chunk."""
    grp = group()
    head = torch.empty(2, dtype=torch.int64)
    dist.recv(head, src, group=grp)
    n, length = int(head[0]), int(head[1])
    if n < 0:
        return None
    chunks: list[tuple[int, int]] = []
    if n:
        table = torch.empty(2 * n, dtype=torch.int64)
        dist.recv(table, src, group=grp)
        end = align_up(max(length, 1), PAGE)
        for off, size in table.reshape(-1, 2).tolist():
            if off < 0 or not 0 <= size <= CHUNK or off + size > end or off % PAGE:
                raise CheckpointPeerError(errno.EPROTO, f"rank {src} sent a piece outside its file")
            chunks.append((off, size))
    return Incoming(src, length, chunks)
