"""fork() while another thread is inside the engine (issue 12 §2).

A thread keeps doing unaligned ``File.sync_pwrite``s, so the file's
read-modify-write lock is often held at the instant of fork(); the child
inherits that lock in its locked state. Every lock a child can inherit held
must be re-initialised in the child, or the child hangs in ``open`` (which
records the file's size under that lock) or in its first write.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest

import aionvme as nvme

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

CHILD_TIMEOUT_S = 20.0


def _child(path: str, st_path: str, expect: np.ndarray) -> int:
    # Runs in the forked child: every step must finish; any failure -> exit code.
    try:
        buf = np.zeros(100, dtype=np.uint8)
        with nvme.open(path, "r") as f:
            f.sync_pread(buf, 3)
        with nvme.open(path, "r+") as f:
            f.sync_pwrite(np.full(10, 7, dtype=np.uint8), 1 << 20)  # away from the writer's range
            f.sync_pread(buf, 1 << 20)
        if not (buf[:10] == 7).all():
            return 3
        got = asyncio.run(nvme.load_safetensors(st_path, like="numpy"))
        if not np.array_equal(got["w"], expect):
            return 4
        return 0
    except BaseException:  # the exit code is the child's only report
        import traceback

        traceback.print_exc()
        return 2


def _wait_all(pids: list[int], timeout: float) -> dict[int, int | None]:
    """Exit status per child, None for one that was still running at the deadline (then killed)."""
    status: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout
    while len(status) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid in status:
                continue
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = os.waitstatus_to_exitcode(st)
        time.sleep(0.02)
    for pid in pids:
        if pid not in status:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status[pid] = None
    return status


def test_forked_children_do_not_inherit_held_locks(tmp_dir):
    from safetensors.numpy import save_file

    path = str(tmp_dir / "rmw.bin")
    with open(path, "wb") as fh:
        fh.write(os.urandom(2 << 20))
    st_path = str(tmp_dir / "small.safetensors")
    expect = np.arange(1000, dtype=np.float32)
    save_file({"w": expect}, st_path)

    stop = threading.Event()
    writes = [0]

    def writer() -> None:
        # Unaligned 100-byte writes: each one is a read-modify-write of one
        # block under the file's per-inode lock (on O_DIRECT files).
        data = np.full(100, 1, dtype=np.uint8)
        with nvme.open(path, "r+") as f:
            i = 0
            while not stop.is_set():
                f.sync_pwrite(data, 17 + (i % 64) * 4099)
                i += 1
                writes[0] = i

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        while writes[0] < 5:
            time.sleep(0.001)
        pids = []
        for _ in range(10):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    code = _child(path, st_path, expect)
                finally:
                    os._exit(code)
            pids.append(pid)
            time.sleep(0.003)
        status = _wait_all(pids, CHILD_TIMEOUT_S)
    finally:
        stop.set()
        t.join(30)
    hung = [pid for pid, code in status.items() if code is None]
    failed = {pid: code for pid, code in status.items() if code not in (0, None)}
    assert not hung, f"{len(hung)} of 10 children hung (killed after {CHILD_TIMEOUT_S} s)"
    assert not failed, f"children failed: {failed}"
    assert writes[0] > 5
