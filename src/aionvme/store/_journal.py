"""The persistent store's index on disk: a snapshot (written whole with
aionvme.atomic_write) and an append-only journal of the changes since.

Journal file: a header line ``AIONVME-STORE-JOURNAL <generation>\n``, then
records ``<u32 length><u32 crc32><JSON payload>``. A record is written only
after the data it points at has been written and fdatasynced, and a put
returns only after its record is fdatasynced, so after a crash the journal
holds every returned put, and a put that was torn has no record. Replay stops
at the first record whose length or checksum does not match (the torn tail of
a write that was in progress) and cuts the file there.

Snapshot file: JSON ``{"format", "generation", "slabs", "entries"}``. After a
snapshot of generation g+1 is durable, the journal restarts with g+1; a
journal whose generation is not the snapshot's is stale and ignored (a crash
between the two steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import zlib
from collections.abc import Callable
from typing import Any

from ..atomic import atomic_write
from ._errors import JournalError

__all__ = ["Coalescer", "Journal", "load_index"]

FORMAT = "aionvme-store/1"
MAGIC = b"AIONVME-STORE-JOURNAL "
_REC = struct.Struct("<II")


class Coalescer:
    """Group commit: ``await c()`` returns after a run of ``fn`` (a blocking
    call, run on a thread) that started after the await began. Callers that
    arrive while a run is in progress share the next run."""

    def __init__(self, fn: Callable[[Any], None], prepare: Callable[[], Any] = lambda: None) -> None:
        self.fn = fn
        self.prepare = prepare  # runs on the loop thread just before each run; its result is fn's argument
        self._next: asyncio.Future[None] | None = None
        self._running = False
        self._task: asyncio.Task[None] | None = None

    async def __call__(self) -> None:
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.create_future()
        fut = self._next
        if not self._running:
            self._running = True
            self._task = loop.create_task(self._drive())
        await asyncio.shield(fut)

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._next is not None:
                fut, self._next = self._next, None
                try:
                    arg = self.prepare()
                    await loop.run_in_executor(None, self.fn, arg)
                except BaseException as e:
                    if not fut.done():
                        fut.set_exception(e)
                        fut.exception()  # retrieved: the waiters re-raise it
                else:
                    if not fut.done():
                        fut.set_result(None)
        finally:
            self._running = False


def encode(rec: dict[str, Any]) -> bytes:
    payload = json.dumps(rec, separators=(",", ":")).encode()
    return _REC.pack(len(payload), zlib.crc32(payload)) + payload


def _read_journal(path: str, generation: int) -> tuple[list[dict[str, Any]], int]:
    """(records, byte length of the valid prefix); ([], -1) if stale or absent."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return [], -1
    nl = data.find(b"\n")
    if not data.startswith(MAGIC) or nl < 0:
        return [], -1
    try:
        gen = int(data[len(MAGIC) : nl])
    except ValueError:
        return [], -1
    if gen != generation:
        return [], -1
    pos = nl + 1
    out: list[dict[str, Any]] = []
    while pos + _REC.size <= len(data):
        ln, crc = _REC.unpack_from(data, pos)
        body = data[pos + _REC.size : pos + _REC.size + ln]
        if len(body) != ln or zlib.crc32(body) != crc:
            break
        try:
            out.append(json.loads(body))
        except ValueError:
            break
        pos += _REC.size + ln
    return out, pos


def load_index(snapshot: str, journal: str) -> tuple[int, list[str] | None, dict[str, list[Any]], int]:
    """(generation, slab paths or None, entries {key: [meta, extents]}, valid
    journal length) from the snapshot plus the journal's records."""
    entries: dict[str, list[Any]] = {}
    slabs: list[str] | None = None
    generation = 0
    try:
        with open(snapshot, "rb") as f:
            snap = json.loads(f.read())
    except FileNotFoundError:
        snap = None
    except ValueError as e:
        raise JournalError(f"{snapshot}: not a store index ({e})") from None
    if snap is not None:
        if not isinstance(snap, dict) or snap.get("format") != FORMAT:
            raise JournalError(f"{snapshot}: not a {FORMAT} index")
        generation = int(snap["generation"])
        slabs = list(snap["slabs"])
        entries = {str(k): v for k, v in snap["entries"].items()}
    recs, valid = _read_journal(journal, generation)
    for r in recs:
        if r["op"] == "put":
            entries[r["k"]] = [r["m"], r["x"]]
        elif r["op"] == "del":
            entries.pop(r["k"], None)
    return generation, slabs, entries, valid


class Journal:
    """Appends records with group commit; ``snapshot`` rewrites the index."""

    def __init__(self, snapshot: str, path: str, generation: int, valid: int) -> None:
        self.snapshot_path = snapshot
        self.path = path
        self.generation = generation
        self.records = 0
        self.nbytes = 0
        self._pending: list[bytes] = []
        self._fd = -1
        self.broken: OSError | None = None
        # the journal is folded into a new snapshot past either size
        self.snapshot_records = 100_000
        self.snapshot_bytes = 64 << 20
        if valid < 0:
            self._restart(generation)
        else:
            self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            os.ftruncate(self._fd, valid)  # cut a torn tail
            os.fsync(self._fd)
            os.lseek(self._fd, valid, os.SEEK_SET)
            self.nbytes = valid
        self._commit = Coalescer(self._flush, self._take)

    def _restart(self, generation: int) -> None:
        with atomic_write(self.path, direct=False) as f:
            f.sync_pwrite(MAGIC + str(generation).encode() + b"\n", 0)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self.nbytes = os.lseek(self._fd, 0, os.SEEK_END)
        self.generation = generation
        self.records = 0

    def _take(self) -> list[bytes]:
        batch, self._pending = self._pending, []
        return batch

    def _flush(self, batch: list[bytes]) -> None:
        if self.broken is not None:
            raise self.broken
        try:
            self._write(batch)
            if self.records > self.snapshot_records or self.nbytes > self.snapshot_bytes:
                self._compact_from_files()
        except OSError as e:
            # a record may be half-written: later ones would follow garbage and
            # be cut at replay, so nothing more is appended to this journal
            self.broken = e
            raise

    def _compact_from_files(self) -> None:
        """Fold the journal into a new snapshot, from the files themselves (on
        the commit thread, between two flushes: no record can slip in between
        reading the journal and restarting it)."""
        _gen, slabs, entries, _valid = load_index(self.snapshot_path, self.path)
        self.write_snapshot(slabs or [], entries)

    def _write(self, batch: list[bytes]) -> None:
        if batch:
            data = b"".join(batch)
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self.nbytes += len(data)
            self.records += len(batch)
        os.fdatasync(self._fd)

    async def append(self, recs: list[dict[str, Any]]) -> None:
        """Add records; returns once they are durable."""
        if self.broken is not None:
            raise self.broken
        self._pending.extend(encode(r) for r in recs)
        await self._commit()

    def write_snapshot(self, slabs: list[str], entries: dict[str, list[Any]]) -> None:
        """Blocking: a new snapshot of the whole index, then an empty journal."""
        gen = self.generation + 1
        body = json.dumps(
            {"format": FORMAT, "generation": gen, "slabs": slabs, "entries": entries},
            separators=(",", ":"),
        ).encode()
        with atomic_write(self.snapshot_path, direct=False) as f:
            f.sync_pwrite(body, 0)
        self._restart(gen)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
