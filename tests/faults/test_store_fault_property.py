"""Property test: random programs of concurrent TieredStore calls (put,
put(to="nvme"), put_many, get, get_many, hold, evict, prefetch, delete on a
few keys) while the NVMe tier's writes fail, on kernel AIO and on io_uring:

- ENOSPC: the store's directory is on a small loop-mounted ext4 that a filler
  file has all but filled, from the start until a chosen round (the filler
  is then removed);
- EIO: the loop device's size limit is cut below the slab file (preallocated:
  ``nvme=``) for a chosen range of rounds, so every transfer of the slab fails.

During the faults each call either returns or raises a typed error (the
store's own, or an OSError with errno ENOSPC or EIO); a read returns one of
the values its key held during the round, never torn bytes; nothing hangs.
After the faults stop: every key reads back one of the values the model
allows (a put that returned is there unless a later write replaced it; a put
that raised left the key as it was, or removed it where it overwrote the old
value's pages in place), no reference, claim, load or write-out is left on
any value, deleting every key frees every byte of every tier, and the store
takes new puts (more than its host tier holds, so they evict to the disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable

import pytest
import uvloop
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aionvme.store import StoreError, StoreKeyError, StoreTimeoutError, TieredStore
from test_store_property import HOST, KEYS, _guarded, as_bytes, make_value, ops, run_op, sig

from .faultkit import LoopFS, fiemap

MiB = 1 << 20

programs = st.lists(st.lists(ops, min_size=1, max_size=6), min_size=2, max_size=6)
WRITES = ("put", "put_nvme", "put_many", "delete")


def _typed(err: BaseException) -> bool:
    if isinstance(err, StoreTimeoutError):
        return False  # nothing here waits for room long: a timeout is a hang
    if isinstance(err, StoreError):
        return True
    return isinstance(err, OSError) and err.errno in (errno.EIO, errno.ENOSPC)


def _idle(e) -> bool:  # type: ignore[no-untyped-def]
    """No reference, claim, load or write-out on any copy of entry e."""
    if hasattr(e, "idle"):
        return bool(e.idle())
    # the entry of the store before its mover (twin fields): the test still says what leaked
    return not (e.refs or e.gpu_refs or e.disk_refs or e.claims or e.gpu_claims or e.moving)


class Fault:
    """Turns the disk's write failures on and off for one store directory."""

    def __init__(self, kind: str, fs: LoopFS, room: int) -> None:
        self.kind = kind
        self.room = room  # ENOSPC: bytes left free on the filesystem
        self.fs = fs
        self.filler = fs.mnt / "filler"
        self.on = False

    def store_kwargs(self) -> dict:
        # EIO: a preallocated slab, so its place on the device is known
        return {"nvme": 2 * MiB} if self.kind == "eio" else {}

    def start(self, store: TieredStore) -> None:
        if self.kind == "enospc":
            st_ = os.statvfs(self.fs.mnt)
            size = max(st_.f_bfree * st_.f_frsize - MiB, 0)  # root may use the reserved blocks too
            with open(self.filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, size)
                with contextlib.suppress(OSError):
                    while True:  # to the last block, then give back the room asked for
                        os.posix_fallocate(f.fileno(), size, 64 * 1024)
                        size += 64 * 1024
                f.truncate(max(size - self.room, 0))
        else:
            slab = store._nvme.slabs[0]
            (_, phys, _), *_ = fiemap(slab.file.fileno(), slab.size)
            self.fs.set_size_limit(phys - phys % 4096)
        self.on = True

    def stop(self) -> None:
        if not self.on:
            return
        if self.kind == "enospc":
            self.filler.unlink(missing_ok=True)
        else:
            self.fs.set_size_limit(0)
        self.on = False


async def _round(store: TieredStore, model: dict[str, set], round_ops, faulty: bool) -> None:
    """Run one round's calls at once; ``model``: each key's possible values
    (sig, None = absent), updated from what each write returned."""
    seen: dict[str, set] = {k: set(model[k]) for k in KEYS}  # what a read of k may see this round
    for op, key, spec in round_ops:
        for k in key if isinstance(key, list) else [key]:
            if op in WRITES:
                seen[k].add(None if op == "delete" else sig(spec))
                if faulty:
                    seen[k].add(None)  # a failed overwrite in place removes the key

    results = await asyncio.gather(*(run_op(store, *o) for o in round_ops), return_exceptions=True)
    for (op, key, _spec), res in zip(round_ops, results):
        ks = key if isinstance(key, list) else [key]
        if isinstance(res, StoreKeyError):
            assert any(None in seen[k] for k in ks), f"{op} {key}: unexpected KeyError"
        elif isinstance(res, BaseException):
            assert _typed(res), f"{op} {key}: {res!r}"
            assert faulty or (op == "hold" and isinstance(res, StoreError)), f"{op} {key}: {res!r}"
        elif op in ("get", "get_many", "hold"):
            for k, v in zip(ks, res):
                kind = "torch" if hasattr(v, "clone") else "numpy"
                assert (kind, as_bytes(v)) in seen[k], f"{op} {k}: torn or stale value"
    # writes of a key apply in call order: fold them into the key's possible values
    for (op, key, spec), res in zip(round_ops, results):
        if op not in WRITES:
            continue
        for k in key if isinstance(key, list) else [key]:
            if res is None:
                model[k] = {None if op == "delete" else sig(spec)}
            elif not isinstance(res, StoreKeyError):
                model[k] = model[k] | {None}  # failed: as it was, or gone (an in-place overwrite)


async def _settled(store: TieredStore, model: dict[str, set]) -> None:
    """After the faults: every key as the model allows, and no count left."""
    while store._tasks:  # write-behind batches and prefetches
        await asyncio.gather(*list(store._tasks), return_exceptions=True)
    for k in KEYS:
        try:
            v = await store.get(k)
        except StoreKeyError:
            assert None in model[k], f"{k} is gone; the model says {model[k]}"
            model[k] = {None}
            continue
        kind = "torch" if hasattr(v, "clone") else "numpy"
        assert (kind, as_bytes(v)) in model[k], f"{k}: a value nobody put"
        model[k] = {(kind, as_bytes(v))}
    for e in store._index.values():
        assert _idle(e), f"a count was left: {e!r}"


async def _program(root: str, prog, fault: Fault, start: int, stop: int) -> None:
    # timeout: nothing here waits long for room; a put that hangs fails as StoreTimeoutError
    store = TieredStore(root, host=HOST, stripe="16K", timeout=10, **fault.store_kwargs())
    model: dict[str, set] = {k: {None} for k in KEYS}
    try:
        for i, round_ops in enumerate(prog):
            if i == start:
                fault.start(store)
            if i == stop:
                fault.stop()
            await _round(store, model, round_ops, fault.on)
        fault.stop()
        await _settled(store, model)
        for k in list(store.keys()):
            await store.delete(k)
        st_ = store.stats()
        assert st_["host"]["used"] == 0 and st_["nvme"]["used"] == 0, st_
        # room is free: puts go in, more than the host tier holds (so evictions write to the disk)
        vals = {f"new{i}": make_value(i, 40_000, "numpy") for i in range(6)}
        for k, v in vals.items():
            await store.put(k, v)
        for k, v in vals.items():
            assert as_bytes(await store.get(k)) == as_bytes(v), k
        assert store.stats()["nvme"]["used"] > 0
        assert store.errors == [] or all(_typed(e) for e in store.errors), store.errors
    finally:
        fault.stop()
        await store.close()


def _run(kind: str, fs: LoopFS, prog, start: int, stop: int, loop: str, room: int) -> None:
    base = tempfile.mkdtemp(dir=fs.mnt)
    try:
        fault = Fault(kind, fs, room)
        coro = _guarded(_program(base, prog, fault, start, stop), 60.0)
        uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _property(max_examples: int):  # type: ignore[no-untyped-def]
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


EXAMPLES = int(os.environ.get("AIONVME_FAULT_PROPERTY_EXAMPLES", "8"))
_given = given(
    prog=programs,
    window=st.tuples(st.integers(0, 5), st.integers(1, 6)),
    loop=st.sampled_from(["asyncio", "uvloop"]),
    room=st.sampled_from([0, 128 * 1024]),  # ENOSPC: a full disk, or room for a value or two
)


def _window(kind: str, window: tuple[int, int], n: int) -> tuple[int, int]:
    start, length = window
    start = 0 if kind == "enospc" else min(start, n - 1)  # a grown slab keeps its room: ENOSPC from the start
    return start, min(start + length, n)


@pytest.fixture
def fs(loopfs: Callable[..., LoopFS], kind: str) -> LoopFS:
    """One filesystem for all of a test's examples (each has its own directory)."""
    if kind == "eio":
        # no journal and errors=continue: a failed write past the cut (and the
        # metadata update it brings) neither aborts a journal nor turns the
        # filesystem read-only; the slab's own blocks are what fails
        return loopfs("ext4", 64 * MiB, mkfs_args=("-O", "^has_journal"), mount_opts="errors=continue")
    return loopfs("ext4", 16 * MiB)


@pytest.mark.usefixtures("kernel_engine")
@pytest.mark.parametrize("kind", ["enospc", "eio"])
@_property(EXAMPLES)
@_given
# the finding: every put evicts the one before, whose write fails; it stayed pinned
@example(
    prog=[[("put", k, (i, 40_000, "numpy"))] for i, k in enumerate("abc")] + [[("get", "a", None)]],
    window=(0, 3),
    loop="asyncio",
    room=0,
)
def test_programs_under_write_faults(fs, kind, prog, window, loop, room):
    _run(kind, fs, prog, *_window(kind, window, len(prog)), loop, room)


@pytest.mark.slow
@pytest.mark.usefixtures("kernel_engine")
@pytest.mark.parametrize("kind", ["enospc", "eio"])
@_property(200)
@_given
def test_programs_under_write_faults_soak(fs, kind, prog, window, loop, room):
    _run(kind, fs, prog, *_window(kind, window, len(prog)), loop, room)
