"""aionvme.memory.populate: pages faulted in before something fills them
(formats' prefault thread, DCP's receive ring), bytes never changed, and a
plain False where madvise is missing or refuses."""

from __future__ import annotations

import numpy as np

import aionvme as nvme
from aionvme import memory


def _resident(buf: np.ndarray) -> int:
    """How many of buf's pages are present (bit 63 of /proc/self/pagemap)."""
    page = 4096
    first = buf.ctypes.data // page
    n = (buf.ctypes.data + buf.nbytes - 1) // page - first + 1
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = np.frombuffer(f.read(n * 8), np.uint64)
    return int(((raw >> np.uint64(63)) & np.uint64(1)).sum())


def test_populate_faults_pages_in_and_keeps_the_bytes():
    filled = nvme.empty(1 << 20)
    filled[:] = 7
    assert memory.populate(filled.ctypes.data + 5, filled.nbytes - 10)  # rounded out to whole pages
    assert (filled == 7).all()
    fresh = nvme.empty(8 << 20)  # anonymous memory, never touched
    before = _resident(fresh)
    assert memory.populate(fresh.ctypes.data, fresh.nbytes)
    assert _resident(fresh) == fresh.nbytes // 4096 > before
    assert not fresh.any()
    assert memory.populate(fresh.ctypes.data, 0)  # nothing to do, and madvise is there


def test_populate_without_madvise_says_false_and_stops_trying(monkeypatch):
    calls = []

    def refusing(addr: int, n: int, advice: int) -> int:
        calls.append(advice)
        return -1  # EINVAL before Linux 5.14, EPERM under seccomp

    monkeypatch.setattr(memory, "_madvise", [refusing])
    buf = nvme.empty(1 << 16)
    assert not memory.populate(buf.ctypes.data, buf.nbytes)
    assert not memory.populate(buf.ctypes.data, buf.nbytes)
    assert calls == [23]  # refused once: not asked again
    monkeypatch.setattr(memory, "_madvise", [None])
    assert not memory.populate(buf.ctypes.data, buf.nbytes)
