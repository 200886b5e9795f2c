"""Errors that depend on the file system arrive at the await, never from the
call (issue 12 section 1): EACCES at open, EIO on a shut-down filesystem
(at open and in a transfer), ENOSPC on a full one."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aionvme as nvme

from .faultkit import need_root

MiB = 1 << 20


async def _at_the_await(call: Callable[[], Awaitable[Any]], err: int) -> None:
    aw = call()  # must not raise
    with pytest.raises(OSError) as ei:
        await aw
    assert ei.value.errno == err, ei.value
    # and the same through a Task
    with pytest.raises(OSError) as ei:
        await asyncio.create_task(call())
    assert ei.value.errno == err


def test_eacces_at_open_arrives_at_the_await():
    # As root the permission bits do not apply: a forked child drops to
    # nobody and opens a root-only file in a directory it may search.
    need_root()
    d = tempfile.mkdtemp(dir="/var/tmp")
    try:
        os.chmod(d, 0o755)
        path = os.path.join(d, "private.bin")
        with open(path, "wb") as f:
            f.write(b"x" * 8192)
        os.chmod(path, 0o600)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports by its exit status
            code = 1
            try:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                buf = np.zeros(4096, np.uint8)

                async def main() -> None:
                    await _at_the_await(lambda: nvme.pread(buf, path), errno.EACCES)
                    await _at_the_await(lambda: nvme.pwrite(buf, path), errno.EACCES)
                    await _at_the_await(lambda: nvme.pread_many([(buf, 0)], path), errno.EACCES)
                    with nvme.Handle() as h:
                        await _at_the_await(lambda: h.pread(buf, path), errno.EACCES)

                asyncio.run(main())
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        shutil.rmtree(d)


async def test_eio_on_a_dead_filesystem_arrives_at_the_await(shutdown_fs):
    fs = shutdown_fs
    path = str(fs.mnt / "a.bin")
    await nvme.pwrite(np.ones(MiB, np.uint8), path)
    await nvme.fsync(path)
    f = nvme.open(path, "r+")
    try:
        fs.shutdown()
        buf = np.zeros(4096, np.uint8)
        await _at_the_await(lambda: nvme.pread(buf, path), errno.EIO)
        await _at_the_await(lambda: nvme.pwrite(buf, str(fs.mnt / "new.bin")), errno.EIO)  # open fails
        await _at_the_await(lambda: f.pread(buf, 0), errno.EIO)
        await _at_the_await(lambda: f.pwrite(buf, 0), errno.EIO)
        await _at_the_await(lambda: f.fsync(), errno.EIO)
    finally:
        f.close()


async def test_enospc_arrives_at_the_await(ext4):
    st = os.statvfs(ext4.mnt)
    with open(ext4.mnt / "ballast", "wb") as b:
        os.posix_fallocate(b.fileno(), 0, st.f_bavail * st.f_frsize - MiB)
    big = nvme.empty(8 * MiB)
    await _at_the_await(lambda: nvme.pwrite(big, str(ext4.mnt / "full.bin")), errno.ENOSPC)
    await _at_the_await(lambda: nvme.pwrite_many([(big, 0)], str(ext4.mnt / "full2.bin")), errno.ENOSPC)
