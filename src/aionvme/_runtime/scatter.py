"""Whether an O_DIRECT write should go through the engine's own buffers
because the caller's memory is scattered in physical memory.

The kernel builds an O_DIRECT request from the pinned pages of the caller's
memory; pages that are physically adjacent merge into one segment, and a
request holds at most ``max_segments`` segments and ``max_sectors_kb`` bytes
(``/sys/dev/block/MAJ:MIN/queue``). Memory faulted by 4 KiB pages by several
threads or processes at once (torch's parallel fills, ranks building their
state dicts side by side) comes out interleaved, so its requests end at
``max_segments`` pages: at most 1 MiB on virtio-blk (510 KiB measured: a bio
of 256 pages splits 254 + 2), against the 4 MiB requests the same bytes make
from contiguous memory. The engine keeps its bounce buffers (up to
``inflight_bytes`` of them) for the next copied write. Where the device pays per
request (bench/README.md: 0.26 against 0.49 GB/s for the same 512 MiB written
zero-copy from scattered and from contiguous pages), copying through the
engine's huge-page bounce buffers on its worker threads costs a memcpy and
writes at the device's rate (0.56 GB/s). With ``write_copy='auto'`` (the
default) the large items of each O_DIRECT write are sampled in
``/proc/self/pagemap``; only a process allowed to see physical frame numbers
(CAP_SYS_ADMIN) can, and elsewhere writes stay zero-copy.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
from typing import Any

import numpy as np

from .. import defaults
from .._engine import MODE_COPY, buffer_info

__all__ = ["device_limits", "params_for", "params_for_one", "request_bytes", "requests_of"]

PAGE = 4096
CHECK_MIN = 4 << 20  # items smaller than this are never checked (nor worth a copy)
SAMPLE_PAGES = 4096  # pages sampled per item: its first 16 MiB
_PFN_MASK = (1 << 55) - 1
_PRESENT = 1 << 63

_lock = threading.Lock()
_pagemap: int | None = None  # fd of /proc/self/pagemap (None: not opened yet; -1: cannot be)
_blind = False  # this process sees no physical frame numbers: nothing to check
_limits: dict[int, tuple[int, int] | None] = {}
_first = operator.itemgetter(0)
_nbytes = operator.attrgetter("nbytes")  # numpy arrays, torch tensors, memoryviews


def device_limits(st_dev: int) -> tuple[int, int] | None:
    """(max_segments, max bytes per request) of the block device behind
    st_dev, or None when it is not a block device with a request queue
    (tmpfs, overlay and other anonymous devices). Cached per device."""
    try:
        return _limits[st_dev]
    except KeyError:
        pass
    out: tuple[int, int] | None = None
    major, minor = os.major(st_dev), os.minor(st_dev)
    if major:
        base = f"/sys/dev/block/{major}:{minor}"
        for q in (f"{base}/queue", f"{base}/../queue"):  # a partition's queue is its disk's
            try:
                with open(f"{q}/max_segments") as f:
                    segs = int(f.read())
                with open(f"{q}/max_sectors_kb") as f:
                    kb = int(f.read())
            except (OSError, ValueError):
                continue
            out = (segs, kb * 1024)
            break
    _limits[st_dev] = out
    return out


def _pagemap_fd() -> int:
    global _pagemap, _blind
    if _pagemap is None:
        with _lock:
            if _pagemap is None:
                try:
                    _pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    _pagemap, _blind = -1, True
    return _pagemap


def _forked() -> None:  # the inherited fd reads the parent's pagemap
    global _pagemap
    if _pagemap is not None and _pagemap >= 0:
        with contextlib.suppress(OSError):
            os.close(_pagemap)
    _pagemap = None


os.register_at_fork(after_in_child=_forked)


def request_bytes(addr: int, nbytes: int, limits: tuple[int, int]) -> int | None:
    """The mean size of the requests the kernel would build for an O_DIRECT
    transfer of the whole pages of [addr, addr + nbytes) (its first 16 MiB
    sampled), or None when physical frame numbers cannot be seen here or
    too few of the pages are resident to tell."""
    global _blind
    fd = _pagemap_fd()
    if _blind or fd < 0:
        return None
    first = (addr + PAGE - 1) // PAGE
    n = min((addr + nbytes) // PAGE - first, SAMPLE_PAGES)
    if n < 2:
        return None
    try:
        raw = os.pread(fd, n * 8, first * 8)
    except OSError:
        return None
    e = np.frombuffer(raw, dtype=np.uint64)
    present = (e & np.uint64(_PRESENT)) != 0
    pfn = e & np.uint64(_PFN_MASK)
    if int(present.sum()) < n // 2:
        return None
    if not pfn[present].any():  # resident pages with frame 0: this process may not see them
        _blind = True  # checked no more
        return None
    # pages not resident yet are faulted when the write pins them: left out
    return requests_of(pfn[present], limits)


def requests_of(pfns: np.ndarray, limits: tuple[int, int]) -> int:
    """The mean request size, in bytes, the kernel builds from pages with
    these physical frame numbers (in address order): runs of consecutive
    frames are segments, a request holds max_segments of them and at most
    max bytes."""
    pfns = np.asarray(pfns, dtype=np.uint64)
    if len(pfns) == 0:
        return limits[1]
    segments = 1 + int(np.count_nonzero(pfns[1:] != pfns[:-1] + np.uint64(1)))
    max_segs, max_bytes = limits
    return int(min(len(pfns) * PAGE / segments * max_segs, max_bytes))


def params_for_one(fd: int, buf: Any, p: tuple[int, int, int]) -> tuple[int, int, int]:
    """:func:`params_for` of a write of one buffer to an O_DIRECT file, with the
    common case (a small buffer, no copy asked for) first: ~0.2 µs."""
    n = getattr(buf, "nbytes", None)
    if n is None and isinstance(buf, (bytes, bytearray)):
        n = len(buf)
    if type(n) is int and n < CHECK_MIN and defaults.settings.write_copy != "always":
        return p
    return params_for(fd, True, ((buf, 0),), p)


def params_for(fd: int, direct: bool, items: Any, p: tuple[int, int, int]) -> tuple[int, int, int]:
    """p, with the engine's copy mode added when this O_DIRECT write should go
    through the engine's buffers (``defaults.write_copy``; see the module)."""
    choice = defaults.settings.write_copy
    if choice == "never" or not direct or p[2] & MODE_COPY:
        return p
    if choice == "always":
        return (p[0], p[1], p[2] | MODE_COPY)
    if _blind:
        return p
    try:  # the common case, small items only, in C: ~50 ns an item
        if max(map(_nbytes, map(_first, items)), default=0) < CHECK_MIN:
            return p
    except (AttributeError, TypeError):
        pass  # bytes and other buffers without .nbytes: one by one
    limits: tuple[int, int] | None = None
    for buf, _ in items:
        try:
            if getattr(buf, "nbytes", None) is None and len(buf) < CHECK_MIN:
                continue  # bytes, bytearray: len is at most the byte count
            addr, nbytes = buffer_info(buf)  # the engine's own view (refuses device tensors)
        except Exception:
            return p  # the engine reports a bad buffer
        if nbytes < CHECK_MIN:
            continue
        if limits is None:
            try:
                limits = device_limits(os.fstat(fd).st_dev)
            except OSError:
                return p
            if limits is None or limits[0] * PAGE >= limits[1]:
                return p  # scattered pages fill requests as well as contiguous ones
        got = request_bytes(addr, nbytes, limits)
        if got is None:
            return p
        if got < limits[1] // 2:
            return (p[0], p[1], p[2] | MODE_COPY)
    return p
