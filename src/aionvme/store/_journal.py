"""The persistent store's index on disk: a snapshot (written whole with
aionvme.atomic_write) and an append-only journal of the changes since.

Journal file (format 2): a header line ``AIONVME-STORE-JOURNAL/2 <generation>\n``,
then records ``<u32 length><u32 crc32><JSON payload>``, the payload an object
that starts ``{"op":``. The records of one group commit are written by one
write(2) and fdatasynced together; the last of them carries ``"e":1`` (the end
of a commit). A record is written only after the data it points at has been
written and fdatasynced, and a put returns only after its record is
fdatasynced, so after a crash the journal holds every returned put.

Replay tells a torn tail from damage: a record whose length or checksum does
not match is the torn tail of the last write when no complete commit follows
it (then the file is cut there, silently, as a crash leaves it); with a
committed record after it, it is damage (a flipped byte, a lost block) and
the open raises :class:`StoreCorruptError` with the file and byte offset,
changing nothing. ``recover=True`` salvages every intact record, copies the
journal to ``<journal>.damaged-<n>`` and reports what was dropped.

Snapshot file: JSON ``{"format", "generation", "slabs", "entries"}``, entries
``{key: [meta, extents, checksum]}``; keys that are not str (bytes, int) in
``"typed"`` instead, as ``"b:<hex>"`` / ``"i:<decimal>"`` (format 3, written
only when there are such keys, so a store of str keys stays format 2). A
journal record names such a key by ``"k"`` (hex or decimal) and ``"kt"``
(``"b"`` or ``"i"``); a record without ``"kt"`` has a str key, as before.
After a snapshot of generation g+1 is durable, the journal restarts with
g+1; a journal whose generation is not the snapshot's is stale and ignored (a crash between the two steps).

Format 1 (before data checksums: header ``AIONVME-STORE-JOURNAL <g>``, no
commit marks, entries ``[meta, extents]``) is still read: its values have no
checksum (they are read unverified) and the first open writes a format-2
snapshot, so the old journal is never appended to. Keeping old stores
readable costs a dozen lines; refusing them would throw away a cache that is
still good.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import struct
import warnings
import zlib
from collections.abc import Callable, Hashable
from typing import Any

from ..atomic import atomic_write
from ._alloc import ALIGN
from ._errors import JournalError, StoreCorruptError
from ._lock import DirLock
from ._values import Meta

__all__ = ["Coalescer", "Index", "Journal", "load_index"]

FORMAT = "aionvme-store/2"
FORMAT3 = "aionvme-store/3"  # format 2 with "typed" (non-str) keys
FORMAT1 = "aionvme-store/1"
MAGIC2 = b"AIONVME-STORE-JOURNAL/2 "
MAGIC1 = b"AIONVME-STORE-JOURNAL "
_REC = struct.Struct("<II")
_START = b'{"op":'  # every payload starts so: a damaged region's end is found by searching for it


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


def key_to_json(k: Hashable) -> tuple[str, str | None]:
    """A key as JSON text and its type tag: str as is (tag None), bytes as
    hex ("b"), int as decimal ("i"). The caller checked the type
    (``_values.check_keys``)."""
    if isinstance(k, str):
        return k, None
    if isinstance(k, bytes):
        return k.hex(), "b"
    return str(k), "i"


def key_from_json(s: object, tag: object) -> Hashable:
    """The key of :func:`key_to_json`; ValueError for anything else."""
    if not isinstance(s, str):
        raise ValueError(f"a key is stored as a str, not {s!r:.40}")
    if tag is None:
        return s
    if tag == "b":
        return bytes.fromhex(s)
    if tag == "i" and s.lstrip("-").isdigit():
        return int(s)
    raise ValueError(f"bad key {s!r:.40} of type tag {tag!r:.10}")


def encode(rec: dict[str, Any]) -> bytes:
    k = rec.get("k") if isinstance(rec, dict) else None  # (tests encode damaged records too)
    if k is not None and not isinstance(k, str):
        s, tag = key_to_json(k)
        rec = {**rec, "k": s, "kt": tag}  # "op" stays first (see _START)
    payload = json.dumps(rec, separators=(",", ":")).encode()
    return _REC.pack(len(payload), zlib.crc32(payload)) + payload


def _record_at(data: bytes, pos: int) -> tuple[dict[str, Any], int] | None:
    """The intact record at pos and where it ends, or None."""
    if pos + _REC.size > len(data):
        return None
    ln, crc = _REC.unpack_from(data, pos)
    end = pos + _REC.size + ln
    if end > len(data) or zlib.crc32(data[pos + _REC.size : end]) != crc:
        return None
    try:
        rec = json.loads(data[pos + _REC.size : end])
    except (ValueError, RecursionError):
        return None
    return (rec, end) if isinstance(rec, dict) else None


def _next_record(data: bytes, pos: int) -> int | None:
    """The offset of the next intact record after pos (a search for the
    payload's start, each hit checked by its length and checksum)."""
    c = data.find(_START, pos + _REC.size)
    while c >= 0:
        if _record_at(data, c - _REC.size) is not None:
            return c - _REC.size
        c = data.find(_START, c + 1)
    return None


class _Scan:
    """A journal's records: ``recs`` the intact ones (offset, record), in
    order; ``bad`` the damaged byte ranges; ``cut`` where a torn tail starts
    (the file's length if none); ``version``; ``stale`` if the journal does
    not belong to the snapshot (or is absent)."""

    def __init__(self, path: str, generation: int) -> None:
        self.path = path
        self.recs: list[tuple[int, int, dict[str, Any]]] = []  # (offset, end, record)
        self.bad: list[tuple[int, int]] = []
        self.version = 2
        self.stale = True
        self.cut = -1
        self.size = 0
        self.committed: list[tuple[int, int, dict[str, Any]]] = []
        self.damage: list[tuple[int, int]] = []
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        self.size = len(data)
        nl = data.find(b"\n", 0, 64)
        if data.startswith(MAGIC2):
            head = len(MAGIC2)
        elif data.startswith(MAGIC1):
            head, self.version = len(MAGIC1), 1
        else:
            return
        try:
            gen = int(data[head:nl]) if nl > 0 else -1
        except ValueError:
            return
        if gen != generation:
            return
        self.stale = False
        pos = nl + 1
        while pos < len(data):
            got = _record_at(data, pos)
            if got is not None:
                self.recs.append((pos, got[1], got[0]))
                pos = got[1]
                continue
            nxt = _next_record(data, pos)
            self.bad.append((pos, len(data) if nxt is None else nxt))
            if nxt is None:
                break
            pos = nxt
        # the end of the last complete commit: what follows it is a torn tail
        last = len(self.recs)
        if self.version >= 2:
            while last and not self.recs[last - 1][2].get("e"):
                last -= 1
        end = nl + 1 if not last else self.recs[last - 1][1]
        self.cut = end
        self.committed = self.recs[:last]
        self.damage = [b for b in self.bad if b[0] < end]


def _corrupt(path: str, offset: int | None, what: str) -> StoreCorruptError:
    return StoreCorruptError(
        f"{what}; nothing was changed: TieredStore(..., recover=True) keeps every intact record, "
        "copies the damaged file aside and reports what was lost",
        path,
        offset,
    )


def _entry(v: Any, nslabs: int) -> list[Any]:
    """An index entry [meta, extents, checksum], checked (ValueError if not)."""
    if not isinstance(v, list) or len(v) not in (2, 3):
        raise ValueError(f"an entry is [meta, extents, checksum], not {v!r:.80}")
    meta = Meta.from_json(v[0])
    ext = v[1]
    if not isinstance(ext, list) or len(ext) > 4096:
        raise ValueError(f"bad extents {ext!r:.80}")
    total = 0
    for x in ext:
        if not (isinstance(x, list) and len(x) == 4 and all(type(i) is int for i in x)):
            raise ValueError(f"bad extent {x!r:.80}")
        i, off, boff, n = x
        if not (0 <= i < nslabs and 0 <= off < 1 << 62 and 0 <= boff < 1 << 62 and 0 < n < 1 << 62):
            raise ValueError(f"extent {x} is outside the store's {nslabs} slab(s)")
        total += n
    if (ext and total != meta.nbytes) or (not ext and meta.nbytes):
        raise ValueError(f"extents of {total} bytes for a value of {meta.nbytes}")
    c = v[2] if len(v) == 3 else None
    if c is not None and not (type(c) is int and 0 <= c < 1 << 64):
        raise ValueError(f"bad checksum {c!r:.40}")
    return [v[0], ext, c]


class Index:
    """What :func:`load_index` found. ``entries`` {key: [meta, extents,
    checksum]}; ``valid`` the journal's length to keep (-1: start a new
    one); ``rewrite``: write a new snapshot at open (a format-1 store, a
    recovery); ``recovered``: the report of a recovery, or None."""

    def __init__(self) -> None:
        self.generation = 0
        self.slabs: list[str] | None = None
        self.entries: dict[Hashable, list[Any]] = {}
        self.valid = -1
        self.rewrite = False
        self.recovered: dict[str, Any] | None = None


def load_index(snapshot: str, journal: str, recover: bool = False) -> Index:
    """The index from the snapshot plus the journal's records, checked:
    StoreCorruptError (a JournalError) for any damage but a torn tail,
    unless ``recover``."""
    idx = Index()
    try:
        with open(snapshot, "rb") as f:
            snap = json.loads(f.read())
    except FileNotFoundError:
        snap = None
    except (ValueError, RecursionError) as e:
        raise StoreCorruptError(f"not a store index ({e})", snapshot) from None
    version = 2
    if snap is not None:
        if not isinstance(snap, dict) or snap.get("format") not in (FORMAT, FORMAT1, FORMAT3):
            raise JournalError(f"{snapshot}: not a {FORMAT} index")
        version = 1 if snap["format"] == FORMAT1 else 2
        gen, slabs, ents = snap.get("generation"), snap.get("slabs"), snap.get("entries")
        if (
            type(gen) is not int
            or gen < 0
            or not isinstance(slabs, list)
            or not all(isinstance(p, str) for p in slabs)
            or not isinstance(ents, dict)
        ):
            raise StoreCorruptError("the snapshot lacks generation, slabs or entries", snapshot)
        idx.generation, idx.slabs = gen, slabs
        typed = snap.get("typed", {})
        if not isinstance(typed, dict):
            raise StoreCorruptError("the snapshot's typed keys are not an object", snapshot)
        # (the key's text, its type tag, the entry): str keys, then "b:<hex>" / "i:<decimal>"
        named: list[tuple[str, str | None, Any]] = [(k, None, v) for k, v in ents.items()]
        for k, v in typed.items():
            tag, _, text = k.partition(":")
            named.append((text, tag, v))
        for text, tag, v in named:
            try:
                idx.entries[key_from_json(text, tag)] = _entry(v, len(slabs))
            except ValueError as e:
                raise StoreCorruptError(f"entry {text!r:.80}: {e}", snapshot) from None
    nslabs = len(idx.slabs or ())
    scan = _Scan(journal, idx.generation)
    if scan.stale:
        idx.rewrite = version == 1 and snap is not None
        return idx
    idx.valid = scan.cut
    dropped: list[tuple[int, int]] = list(scan.damage)
    order: dict[Hashable, int] = {}
    for n, (pos, end, r) in enumerate(scan.committed):
        try:
            order[_apply(idx.entries, r, nslabs)] = n
        except ValueError as e:
            if not recover:
                raise _corrupt(journal, pos, f"record {n}: {e}") from None
            dropped.append((pos, end))
    if scan.damage and not recover:
        pos, end = scan.damage[0]
        after = sum(1 for p, _e, _r in scan.committed if p > pos)
        raise _corrupt(
            journal, pos, f"{end - pos} damaged bytes with {after} intact committed records after them"
        )
    if version == 1 or scan.version == 1:
        idx.rewrite = True
    if dropped:
        # the salvaged index goes into a new snapshot at open; until it is
        # durable the damaged journal stays (cut only of its torn tail)
        lost = _drop_overlaps(idx.entries, order)
        idx.rewrite = True
        idx.recovered = {
            "journal": journal,
            "copy": _keep_copy(journal),
            "dropped": sorted(dropped),  # (start, end) byte ranges of the journal
            "dropped_bytes": sum(b - a for a, b in dropped),
            "records": len(scan.committed) - sum(1 for d in dropped if d not in scan.damage),
            "lost_keys": lost,
        }
        warnings.warn(
            f"{journal}: recovered {idx.recovered['records']} intact records; dropped "
            f"{idx.recovered['dropped_bytes']} damaged bytes {idx.recovered['dropped']}"
            + (f" and the keys {lost} (their bytes were reused)" if lost else "")
            + f"; the damaged journal is kept as {idx.recovered['copy']} (see store.recovered)",
            RuntimeWarning,
            stacklevel=3,
        )
    return idx


def _apply(entries: dict[Hashable, list[Any]], r: dict[str, Any], nslabs: int) -> Hashable:
    """Apply one record to the entries; its key."""
    op = r.get("op")
    k = key_from_json(r.get("k"), r.get("kt"))
    if op == "put":
        entries[k] = _entry([r.get("m"), r.get("x"), r.get("c")], nslabs)
    elif op == "del":
        entries.pop(k, None)
    else:
        raise ValueError(f"unknown op {op!r:.40}")
    return k


def _drop_overlaps(entries: dict[Hashable, list[Any]], order: dict[Hashable, int]) -> list[Hashable]:
    """A recovery: where a dropped record leaves two keys naming the same NVMe
    bytes, the one written last keeps them; the others are removed (returned)."""
    lost: list[Hashable] = []
    while True:
        pieces = sorted(
            (i, off - off % ALIGN, off + n, order.get(k, -1), k)
            for k, (_m, ext, _c) in entries.items()
            for i, off, _b, n in ext
        )
        clash = None
        for a, b in itertools.pairwise(pieces):
            if a[0] == b[0] and b[1] < a[2]:
                clash = min(a, b, key=lambda p: p[3])[4]
                break
        if clash is None:
            return lost
        del entries[clash]
        lost.append(clash)


def _keep_copy(path: str) -> str:
    n = 1
    while os.path.exists(f"{path}.damaged-{n}"):
        n += 1
    copy = f"{path}.damaged-{n}"
    with (
        open(path, "rb") as src,
        open(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as dst,
    ):
        shutil.copyfileobj(src, dst)
        dst.flush()
        os.fsync(dst.fileno())
    return copy


class Journal:
    """Appends records with group commit; ``snapshot`` rewrites the index.
    Owns the directory lock of its store (``lock``, released by close)."""

    def __init__(
        self,
        snapshot: str,
        path: str,
        generation: int,
        valid: int,
        *,
        lock: DirLock | None = None,
        mode: int = 0o600,
    ) -> None:
        self.snapshot_path = snapshot
        self.path = path
        self.generation = generation
        self.lock = lock
        self.mode = mode
        self.records = 0
        self.nbytes = 0
        self._pending: list[dict[str, Any]] = []
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
        with atomic_write(self.path, direct=False, mode=self.mode) as f:
            f.sync_pwrite(MAGIC2 + str(generation).encode() + b"\n", 0)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self.nbytes = os.lseek(self._fd, 0, os.SEEK_END)
        self.generation = generation
        self.records = 0

    def _take(self) -> list[bytes]:
        """The records of the next commit, encoded; the last marks its end."""
        batch, self._pending = self._pending, []
        if batch:
            batch[-1] = {**batch[-1], "e": 1}
        return [encode(r) for r in batch]

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
        idx = load_index(self.snapshot_path, self.path)
        self.write_snapshot(idx.slabs or [], idx.entries)

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
        self._pending.extend(recs)
        await self._commit()

    def write_snapshot(self, slabs: list[str], entries: dict[Hashable, list[Any]]) -> None:
        """Blocking: a new snapshot of the whole index, then an empty journal."""
        gen = self.generation + 1
        plain: dict[str, list[Any]] = {}
        typed: dict[str, list[Any]] = {}
        for k, v in entries.items():
            if isinstance(k, str):
                plain[k] = v
            else:
                text, tag = key_to_json(k)
                typed[f"{tag}:{text}"] = v
        snap: dict[str, Any] = {"format": FORMAT3 if typed else FORMAT, "generation": gen, "slabs": slabs}
        snap["entries"] = plain
        if typed:
            snap["typed"] = typed
        body = json.dumps(snap, separators=(",", ":")).encode()
        with atomic_write(self.snapshot_path, direct=False, mode=self.mode) as f:
            f.sync_pwrite(body, 0)
        self._restart(gen)

    def final_snapshot(self, slabs: list[str], entries: dict[Hashable, list[Any]]) -> None:
        """:meth:`write_snapshot` at close, where a failure loses nothing (the
        journal holds every record and the next open replays it): a
        warning, not an exception (a full disk must not make close() fail)."""
        try:
            self.write_snapshot(slabs, entries)
        except OSError as e:
            warnings.warn(
                f"{self.snapshot_path}: the index snapshot was not written at close ({e}); "
                "nothing is lost: the journal holds every key and the next open replays it",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        if self.lock is not None:
            self.lock.release()
