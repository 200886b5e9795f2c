"""What a new user trips on: error messages and the blocking twins.

UnsupportedOperation says what went wrong and names the file (not "[Errno
None] None"); ShortReadError knows the file's size for path calls as for File
calls and says it the same way; the blocking File/Handle calls refuse to run
on a thread whose event loop runs, as sync_load does; dir(aionvme) is the API.
"""

from __future__ import annotations

import asyncio
import pickle
import types

import numpy as np
import pytest

import aionvme as nvme
from aionvme.exceptions import BlockingCallError


def test_unsupported_operation_has_a_message_and_the_path(make_file):
    path, _ = make_file(100)
    with nvme.open(path, "r") as f, pytest.raises(nvme.UnsupportedOperation) as ei:
        f.sync_pwrite(b"abc", 0)
    e = ei.value
    assert str(e) == f"file not open for writing: {path!r}"
    assert "Errno" not in str(e) and "None" not in str(e)
    assert e.filename == path and e.errno is None
    assert isinstance(e, OSError) and isinstance(e, nvme.AionvmeError)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e) and str(back) == str(e) and back.filename == path
    # made without the path in the message, the path is added once
    plain = nvme.UnsupportedOperation("file not open for reading", "w.bin")
    assert str(plain) == "file not open for reading: 'w.bin'"


async def test_unsupported_operation_async_says_the_same(make_file):
    path, _ = make_file(100)
    with nvme.open(path, "r") as f:
        with pytest.raises(nvme.UnsupportedOperation) as ei:
            await f.pwrite(b"abc", 0)
        assert str(ei.value) == f"file not open for writing: {path!r}"
        with pytest.raises(nvme.UnsupportedOperation) as ei:
            await nvme.pwrite(b"abc", f)
        assert str(ei.value) == f"file not open for writing: {path!r}"


async def test_short_read_knows_the_file_size_for_path_calls_too(make_file):
    path, _ = make_file(100)
    errors = []
    for offset in (0, 50, 100, 300):
        buf = np.zeros(200, np.uint8)
        with pytest.raises(nvme.ShortReadError) as by_path:
            await nvme.pread(buf, path, offset)
        with nvme.open(path) as f, pytest.raises(nvme.ShortReadError) as by_file:
            await f.pread(buf, offset)
        with pytest.raises(nvme.ShortReadError) as by_sync_path:
            await asyncio.to_thread(nvme.Handle().sync_pread, buf, path, offset)
        for ei in (by_path, by_file, by_sync_path):
            errors.append(ei.value)
            assert ei.value.file_size == 100
            assert str(ei.value) == str(by_file.value)
            assert "the file is 100 bytes long" in str(ei.value)
    assert pickle.loads(pickle.dumps(errors[0])).file_size == 100


def test_short_read_size_is_not_made_up():
    # no such path, an fd's stand-in name, a size past where the read stopped: unknown
    assert nvme.ShortReadError("/nonexistent/x.bin", 0, 10, 5).file_size is None
    assert nvme.ShortReadError("<fd 3>", 0, 10, 5).file_size is None
    assert nvme.ShortReadError(__file__, 0, 10, 5).file_size is None  # this file is longer than 5


async def test_blocking_file_calls_refuse_a_running_loop_like_sync_load(make_file):
    path, data = make_file(8192)
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(BlockingCallError) as load_err:
        nvme.sync_load(path)
    assert isinstance(load_err.value, RuntimeError)
    with nvme.open(path, "r+") as f, nvme.Handle() as h:
        calls = {
            "File.sync_pread": lambda: f.sync_pread(buf, 0),
            "File.sync_pwrite": lambda: f.sync_pwrite(buf, 0),
            "File.sync_pread_many": lambda: f.sync_pread_many([(buf, 0)]),
            "File.sync_pread_rows": lambda: f.sync_pread_rows(buf, [0]),
            "File.sync_pwrite_many": lambda: f.sync_pwrite_many([(buf, 0)]),
            "File.sync_pwrite_rows": lambda: f.sync_pwrite_rows(buf, [0]),
            "File.sync_fsync": f.sync_fsync,
            "Handle.sync_pread": lambda: h.sync_pread(buf, path),
            "Handle.sync_pwrite": lambda: h.sync_pwrite(buf, path),
            "Handle.sync_fsync": lambda: h.sync_fsync(path),
        }
        for name, call in calls.items():
            with pytest.raises(BlockingCallError) as ei:
                call()
            assert type(ei.value) is type(load_err.value), name
            assert str(ei.value).startswith(f"{name}() blocks, and this thread runs an event loop")
            assert ei.value.call == name
        # from another thread they work, as sync_load does
        assert await asyncio.to_thread(f.sync_pread, buf, 0) == 4096
        assert np.array_equal(buf, data[:4096])
        assert await asyncio.to_thread(h.sync_pread, buf, path, 4096) == 4096
    assert np.array_equal(buf, data[4096:])


def test_blocking_calls_work_without_a_loop(make_file):
    path, data = make_file(4096)
    buf = np.zeros(4096, np.uint8)
    with nvme.open(path) as f:
        assert f.sync_pread(buf, 0) == 4096
    assert np.array_equal(buf, data)


def test_the_package_namespace_is_the_api():
    leaked = [
        n
        for n in dir(nvme)
        if not n.startswith("__")
        and n not in nvme.__all__
        and not isinstance(getattr(nvme, n), types.ModuleType)
    ]
    assert leaked == []
    assert "Any" not in dir(nvme) and "annotations" not in dir(nvme)
    assert nvme.BlockingCallError is BlockingCallError and "UnsafeSymlinkError" in nvme.__all__
