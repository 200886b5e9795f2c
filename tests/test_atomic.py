"""Whole-file atomic writes: old content intact until commit, none of the
temporary file left behind on failure, permissions kept."""

from __future__ import annotations

import asyncio
import contextlib
import os

import numpy as np
import pytest

import aionvme as nvme


async def test_commit_replaces_the_file(tmp_dir):
    path = tmp_dir / "ckpt.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    data = np.random.default_rng(0).integers(0, 256, 3_000_001, dtype=np.uint8)
    async with nvme.atomic_write(path) as f:
        await f.pwrite(data[:1_000_000], 0)
        await f.pwrite(data[1_000_000:], 1_000_000)
        assert path.read_bytes() == b"old"  # not visible before the commit
    assert path.read_bytes() == data.tobytes()
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o640)
    assert [p.name for p in tmp_dir.iterdir()] == ["ckpt.bin"]


async def test_failure_keeps_the_old_file(tmp_dir):
    path = tmp_dir / "ckpt.bin"
    path.write_bytes(b"old content")
    with pytest.raises(RuntimeError):
        async with nvme.atomic_write(path) as f:
            await f.pwrite(b"half of the new", 0)
            raise RuntimeError("training crashed")
    assert path.read_bytes() == b"old content"
    assert [p.name for p in tmp_dir.iterdir()] == ["ckpt.bin"]


async def test_cancellation_keeps_the_old_file(tmp_dir):
    path = tmp_dir / "ckpt.bin"
    path.write_bytes(b"old")
    big = nvme.empty(64 << 20)

    async def save():
        async with nvme.atomic_write(path) as f:
            await f.pwrite(big, 0)
            await asyncio.sleep(10)

    t = asyncio.ensure_future(save())
    await asyncio.sleep(0.05)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_dir.iterdir()] == ["ckpt.bin"]


def test_sync_form(tmp_dir):
    path = tmp_dir / "new.bin"
    with nvme.atomic_write(path) as f:
        f.sync_pwrite(b"hello world", 0)
    assert path.read_bytes() == b"hello world"


async def test_cancel_during_commit_sees_the_commit_through(tmp_dir, monkeypatch):
    # Cancel while the directory fsync runs: the rename has happened, so the
    # fsync must finish before CancelledError reaches the caller.
    import threading

    from aionvme import atomic

    path = tmp_dir / "ckpt.bin"
    path.write_bytes(b"old")
    started, release = threading.Event(), threading.Event()
    synced = []
    real = atomic.fsync_dir

    def slow_fsync_dir(d):
        started.set()
        release.wait(10)
        real(d)
        synced.append(d)

    monkeypatch.setattr(atomic, "fsync_dir", slow_fsync_dir)

    async def save():
        async with nvme.atomic_write(path) as f:
            await f.pwrite(b"new content", 0)

    t = asyncio.ensure_future(save())
    while not started.is_set():
        await asyncio.sleep(0.005)
    t.cancel()
    await asyncio.sleep(0.05)
    assert not t.done()  # still waiting for the fsync
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert synced and path.read_bytes() == b"new content"


async def test_an_unusable_target_leaves_no_temporary_file(tmp_dir):
    # the target's permissions cannot be read (a symlink loop: ELOOP): the
    # error comes out and the temporary file made first is gone
    target = tmp_dir / "loop"
    os.symlink("loop", target)
    with pytest.raises(OSError):
        async with nvme.atomic_write(target) as f:
            await f.pwrite(b"x", 0)
    assert sorted(p.name for p in tmp_dir.iterdir()) == ["loop"]


# -- permissions, long names, symbolic links -------------------------------------------------

_IN_CREATE = 0x100
_IN_MOVED_TO = 0x80


def _watch_as_nobody(directory: str, ready_w: int, stop_r: int, report_w: int) -> None:
    """Child process (uid/gid 65534): open every file created in directory as
    soon as inotify reports it, keep the descriptors, and when told to stop
    read them all; report JSON {"events", "opened", "leaked"} on report_w."""
    import ctypes
    import json
    import select
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    ino = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    libc.inotify_add_watch(ino, os.fsencode(directory), _IN_CREATE | _IN_MOVED_TO)
    os.write(ready_w, b"r")
    held, events = [], 0
    while True:
        r, _, _ = select.select([ino, stop_r], [], [], 5)
        if ino in r:
            data = os.read(ino, 1 << 16)
            pos = 0
            while pos < len(data):
                _wd, _mask, _cookie, n = struct.unpack_from("iIII", data, pos)
                name = data[pos + 16 : pos + 16 + n].rstrip(b"\0")
                pos += 16 + n
                events += 1
                with contextlib.suppress(OSError):  # EACCES: the file is private
                    held.append(os.open(os.path.join(os.fsencode(directory), name), os.O_RDONLY))
        if stop_r in r or not r:
            break
    leaked = sum(b"SECRET" in os.pread(fd, 1 << 16, 0) for fd in held)
    os.write(report_w, json.dumps({"events": events, "opened": len(held), "leaked": leaked}).encode())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a watcher as uid 65534")
async def test_another_user_never_reads_a_private_files_new_content(tmp_dir):
    # The probe: a 0600 file in a 0755 directory saved over and over,
    # while a process of another user opens every temporary file the moment
    # inotify reports it. The temporary files must be private from their
    # creation: the watcher opens none of them and reads nothing new.
    import json
    import shutil
    import tempfile

    import torch

    # tmp_path's parents are 0700: the watcher needs a directory it can enter
    directory = tempfile.mkdtemp(prefix="aionvme-perm-", dir="/tmp")
    try:
        os.chmod(directory, 0o755)
        path = os.path.join(directory, "private.safetensors")
        raw = os.path.join(directory, "private.bin")
        for p in (path, raw):
            with open(p, "wb") as fh:
                fh.write(b"old")
            os.chmod(p, 0o600)
        ready_r, ready_w = os.pipe()
        stop_r, stop_w = os.pipe()
        report_r, report_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                _watch_as_nobody(directory, ready_w, stop_r, report_w)
                code = 0
            finally:
                os._exit(code)
        try:
            assert os.read(ready_r, 1) == b"r"
            n = 150
            for i in range(n):
                secret = torch.frombuffer(bytearray(b"SECRET%06d" % i), dtype=torch.uint8)
                await nvme.save({"s": secret}, path, durable=False)
                with nvme.atomic_write(raw, durable=False) as f:
                    f.sync_pwrite(b"SECRET%06d" % i, 0)
        finally:
            os.write(stop_w, b"s")
            _, status = os.waitpid(pid, 0)
        report = json.loads(os.read(report_r, 4096))
        for fd in (ready_r, ready_w, stop_r, stop_w, report_r, report_w):
            os.close(fd)
        assert os.waitstatus_to_exitcode(status) == 0
        assert report["events"] >= 2 * n  # the watcher saw every temporary file appear
        assert report == {"events": report["events"], "opened": 0, "leaked": 0}
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
        assert oct(os.stat(raw).st_mode & 0o777) == oct(0o600)
        assert (await nvme.load(path))["s"].numpy().tobytes() == b"SECRET%06d" % (n - 1)
    finally:
        shutil.rmtree(directory)


async def test_a_new_file_gets_the_umask_mode_and_a_private_temporary(tmp_dir):
    path = tmp_dir / "new.bin"
    old = os.umask(0o027)
    try:
        w = nvme.atomic_write(path)
        async with w as f:
            assert oct(os.stat(w.tmp_path).st_mode & 0o777) == oct(0o600)
            await f.pwrite(b"x", 0)
    finally:
        os.umask(old)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o640)


async def test_a_public_files_mode_is_kept(tmp_dir):
    path = tmp_dir / "public.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    w = nvme.atomic_write(path)
    with w as f:
        assert oct(os.stat(w.tmp_path).st_mode & 0o777) == oct(0o600)  # private until the commit
        f.sync_pwrite(b"new", 0)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
    assert path.read_bytes() == b"new"


@pytest.mark.parametrize("length", [237, 238, 250, 255])
async def test_any_legal_name_can_be_saved(tmp_dir, length):
    # the temporary name adds 18 bytes: it must be shortened, not fail with ENAMETOOLONG
    import torch

    path = tmp_dir / ("n" * (length - 4) + ".bin")
    await nvme.save({"w": torch.arange(5)}, path)
    assert torch.equal((await nvme.load(path))["w"], torch.arange(5))
    with nvme.atomic_write(path) as f:
        f.sync_pwrite(b"raw", 0)
    assert path.read_bytes() == b"raw"
    # multi-byte characters: the limit is in bytes
    wide = tmp_dir / ("é" * ((length - 4) // 2) + ".bin")
    async with nvme.atomic_write(wide) as f:
        await f.pwrite(b"wide", 0)
    assert wide.read_bytes() == b"wide"
    assert sorted(p.name for p in tmp_dir.iterdir()) == sorted([path.name, wide.name])


async def test_saving_to_a_symlink_writes_through_it(tmp_dir):
    # users keep a symlinked checkpoint (latest -> run-3/ckpt): the link stays,
    # the file it points to gets the new content, in its own directory
    import torch

    real_dir = tmp_dir / "run-3"
    real_dir.mkdir()
    target = real_dir / "ckpt.safetensors"
    await nvme.save({"w": torch.zeros(3)}, target)
    os.chmod(target, 0o640)
    link = tmp_dir / "latest.safetensors"
    os.symlink(os.path.join("run-3", "ckpt.safetensors"), link)
    await nvme.save({"w": torch.ones(3)}, link)
    assert os.path.islink(link) and os.readlink(link) == os.path.join("run-3", "ckpt.safetensors")
    assert torch.equal((await nvme.load(target))["w"], torch.ones(3))
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o640)
    assert sorted(p.name for p in tmp_dir.iterdir()) == ["latest.safetensors", "run-3"]
    assert [p.name for p in real_dir.iterdir()] == ["ckpt.safetensors"]
    # the plain atomic_write too, and a dangling link creates its target
    with nvme.atomic_write(link) as f:
        f.sync_pwrite(b"raw", 0)
    assert target.read_bytes() == b"raw" and os.path.islink(link)
    dangling = tmp_dir / "next"
    os.symlink("run-3/next.bin", dangling)
    async with nvme.atomic_write(dangling) as f:
        await f.pwrite(b"created", 0)
    assert os.path.islink(dangling) and (real_dir / "next.bin").read_bytes() == b"created"
