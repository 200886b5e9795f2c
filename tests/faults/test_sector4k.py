"""A device with 4096-byte logical sectors (``losetup -b 4096``), where a
512-byte-aligned O_DIRECT transfer is refused: every unaligned buffer, offset,
size and tail still moves every byte right (peers assume 512)."""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import struct

import numpy as np
import pytest

import aionvme as nvme

SIZES = [1, 511, 512, 513, 2048, 4095, 4096, 4097, 8191, 65537, (1 << 20) + 5]
OFFSETS = [0, 1, 512, 2048, 4095, 4096, 4097, (1 << 20) - 512]
SHIFTS = [0, 1, 512, 2048]  # buffer address past a page boundary
FILE_SIZE = 3 << 20


def _shifted(n: int, shift: int) -> np.ndarray:
    return nvme.empty(n + 8192)[shift : shift + n]


@pytest.fixture
def fs4k(loopfs):
    fs = loopfs("ext4", 32 << 20, sector=4096, mkfs_args=("-b", "4096"))
    fd = os.open(fs.dev, os.O_RDONLY)
    try:
        got = struct.unpack("i", fcntl.ioctl(fd, 0x1268, b"\0" * 4))[0]  # BLKSSZGET
    finally:
        os.close(fd)
    if got != 4096:
        pytest.skip(f"loop device reports {got}-byte sectors; losetup -b 4096 not honoured")
    return fs


def _direct_512_is_refused(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        m = mmap.mmap(-1, 8192)
        try:
            os.preadv(fd, [memoryview(m)[:4096]], 512)
        except OSError as e:
            return e.errno == errno.EINVAL
        finally:
            m.close()
        return False
    finally:
        os.close(fd)


async def test_file_on_4k_sectors_every_alignment(fs4k):
    path = str(fs4k.mnt / "f.bin")
    rng = np.random.default_rng(11)
    model = bytearray(rng.integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes())
    with open(path, "wb") as f:
        f.write(model)
    assert _direct_512_is_refused(path), "the device took a 512-aligned O_DIRECT read: not a 4K device"
    with nvme.open(path, "r+") as f:
        assert f.direct and f.info.align == 4096, f.info
        for size, off, shift in itertools.product(SIZES, OFFSETS, SHIFTS):
            if (size + off + shift) % 3:  # a third of the grid per pass keeps it quick
                continue
            buf = _shifted(size, shift)
            assert await f.pread(buf, off) == size
            assert buf.tobytes() == model[off : off + size], (size, off, shift)
            payload = rng.integers(0, 256, size, dtype=np.uint8)
            src = _shifted(size, shift)
            src[:] = payload
            assert await f.pwrite(src, off) == size
            model[off : off + size] = payload.tobytes()
        # tails: writes that end the file at every unaligned length
        for end in (FILE_SIZE + 1, FILE_SIZE + 511, FILE_SIZE + 4095, FILE_SIZE + 4097):
            payload = rng.integers(0, 256, end - (FILE_SIZE - 100), dtype=np.uint8)
            await f.pwrite(_copy_shifted(payload, 1), FILE_SIZE - 100)
            model[FILE_SIZE - 100 : end] = payload.tobytes()
            assert f.size() == len(model)
            tail = _shifted(len(model) - (FILE_SIZE - 3000), 512)
            await f.pread(tail, FILE_SIZE - 3000)
            assert tail.tobytes() == model[FILE_SIZE - 3000 :]
    with open(path, "rb") as f:
        assert f.read() == bytes(model)


def _copy_shifted(a: np.ndarray, shift: int) -> np.ndarray:
    b = _shifted(a.nbytes, shift)
    b[:] = a
    return b


async def test_raw_4k_block_device(fs4k):
    # the device itself, as a file: its alignment comes from statx/BLKSSZGET
    fs4k.umount()
    dev = fs4k.dev
    rng = np.random.default_rng(12)
    with nvme.open(dev, "r+") as f, open(dev, "rb", buffering=0) as raw:
        assert f.direct and f.info.align == 4096, f.info
        for size, off, shift in [(1, 1, 1), (513, 4095, 512), (8191, 513, 0), ((1 << 20) + 7, 2049, 2048)]:
            before = os.pread(raw.fileno(), off + size + 8192, 0)
            payload = _copy_shifted(rng.integers(0, 256, size, dtype=np.uint8), shift)
            assert await f.pwrite(payload, off) == size
            after = os.pread(raw.fileno(), off + size + 8192, 0)
            # exactly the written bytes changed; the neighbours did not
            assert after[off : off + size] == payload.tobytes()
            assert after[:off] == before[:off]
            assert after[off + size :] == before[off + size :]
            back = _shifted(size, (shift + 1) % 4096)
            assert await f.pread(back, off) == size
            assert back.tobytes() == payload.tobytes()
