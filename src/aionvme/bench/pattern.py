"""The data the benchmarks write and check: every 8-byte word of a file is
its own offset XOR a seed, so any block read back can be verified without
keeping a copy."""

from __future__ import annotations

import errno
import os

import numpy as np

from .. import empty
from .. import open as nvme_open

__all__ = ["SEED", "check_pattern", "fill_pattern", "holds_pattern", "make_file", "touched_buffers"]

SEED = 0x5A5A_1234_9E37_79B9


def fill_pattern(buf: np.ndarray, offset: int, seed: int = SEED) -> None:
    """Fill ``buf`` (uint8; length and offset multiples of 8) with the pattern
    of the file bytes at [offset, offset + len)."""
    words = buf.view(np.uint64)
    np.add(np.arange(len(words), dtype=np.uint64) * np.uint64(8), np.uint64(offset), out=words)
    np.bitwise_xor(words, np.uint64(seed), out=words)


def check_pattern(buf: np.ndarray, offset: int, seed: int = SEED) -> bool:
    """Whether ``buf`` holds the pattern of the file bytes at ``offset`` (8-aligned)."""
    words = buf.view(np.uint64)
    expect = np.arange(len(words), dtype=np.uint64) * np.uint64(8) + np.uint64(offset)
    np.bitwise_xor(expect, np.uint64(seed), out=expect)
    return bool(np.array_equal(words, expect))


def holds_pattern(buf: np.ndarray, offset: int, seed: int = SEED) -> bool:
    """Whether ``buf`` (uint8, any length) holds the file bytes at any ``offset``."""
    if offset % 8 == 0 and len(buf) % 8 == 0:
        return check_pattern(buf, offset, seed)
    lo = offset - offset % 8
    expect = np.empty(-(-(offset + len(buf) - lo) // 8) * 8, np.uint8)
    fill_pattern(expect, lo, seed)
    return bool(np.array_equal(buf, expect[offset - lo : offset - lo + len(buf)]))


def make_file(
    path: str, size: int, chunk: int = 64 << 20, seed: int = SEED, *, overwrite: bool = False
) -> None:
    """Write the pattern to ``path`` (``size`` a multiple of 8), fsynced,
    unless a file of that size with the right first and last words is already there.

    Raises
    ------
    FileExistsError
        ``path`` exists, is not empty and does not start with the pattern (it
        is somebody's data), and ``overwrite`` is false.
    """
    if os.path.exists(path):
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(8), np.uint8).copy()
            have = os.fstat(f.fileno()).st_size
            ours = head.size == 8 and check_pattern(head, 0, seed)
            if ours and have == size and size >= 16:
                f.seek(size - 8)
                tail = np.frombuffer(f.read(8), np.uint8).copy()
                if check_pattern(tail, size - 8, seed):
                    return
        if not ours and have > 0 and not overwrite:
            raise FileExistsError(
                errno.EEXIST, "exists and is not an aionvme benchmark file: not overwriting it", path
            )
    buf = empty(min(chunk, size))
    with nvme_open(path, "w") as f:
        f._loop_ok = True  # setup before anything is timed, also from a workload on the loop
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            fill_pattern(buf[:n], off, seed)
            f.sync_pwrite(buf[:n], off)
        f.sync_fsync()


def touched_buffers(size: int, request_size: int, misalign: int = 0) -> list[np.ndarray]:
    """Page-aligned buffers (shifted by ``misalign % 4096``) for ``size`` bytes
    in pieces of ``request_size``, every page faulted in: first-touch faults
    are a memory cost, not an I/O one (fio's buffers are touched too)."""
    base = empty(size + 2 * 4096)
    base[::4096] = 1
    shift = misalign % 4096
    return [
        base[shift + off : shift + off + min(request_size, size - off)]
        for off in range(0, size, request_size)
    ]
