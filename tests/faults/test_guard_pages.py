"""Memory safety: buffers placed flush against PROT_NONE guard pages (after
their last byte, and before their first). Reads and writes of every awkward
size, offset and address must neither touch a guard page (a SIGSEGV in our
copies, EFAULT from the kernel's DMA) nor get a byte wrong: O_DIRECT round-up
and bounce copies stay inside the caller's buffer.

Runs in a child process so that a fault fails the test instead of pytest."""

from __future__ import annotations

import pytest

from .faultkit import run_python

CHILD = """
import asyncio, ctypes, mmap, os, sys
import numpy as np
import aionvme as nvme

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

class Guarded:
    # [guard page][data pages][guard page]: data is readable and writable, a
    # touch one byte outside it faults.
    def __init__(self, npages):
        self.mm = mmap.mmap(-1, (npages + 2) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        for at in (base, base + (npages + 1) * PAGE):
            if libc.mprotect(at, PAGE, 0) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")
        self.data = np.frombuffer(self.mm, np.uint8)[PAGE : (npages + 1) * PAGE]
    def at_end(self, n):       # the last byte touches the trailing guard page
        return self.data[self.data.nbytes - n :]
    def at_start(self, n, shift=0):  # the first byte follows the leading guard page
        return self.data[shift : shift + n]

path, direct, engine = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
FILE = 3 << 20
rng = np.random.default_rng(0)
model = rng.integers(0, 256, FILE + (1 << 20), dtype=np.uint8)
model[FILE:] = 0
with open(path, "wb") as f:
    f.write(model[:FILE].tobytes())
SIZES = [1, 2, 511, 512, 513, 4095, 4096, 4097, 8191, 65537, (1 << 20) - 1, (1 << 20) + 1]
OFFSETS = [0, 1, 511, 4095, 4096, 4097, (1 << 20) + 3]
g = Guarded(((1 << 20) + 1) // PAGE + 2)
count = 0
# the guard is real: the kernel stops copying at it (a short count)
fd = os.open(path, os.O_RDONLY)
end = PAGE + g.data.nbytes
try:
    n = os.preadv(fd, [memoryview(g.mm)[end - 8 : end + 8]], 0)
    assert n == 8, f"a read across the guard page copied {n} bytes"
finally:
    os.close(fd)

async def main():
    global count
    size_now = FILE
    with nvme.open(path, "r+", direct=direct) as f:
        assert f.direct == direct, f.info
        for n in SIZES:
            for off in OFFSETS:
                for place in ("end", "start", "start+1"):
                    buf = g.at_end(n) if place == "end" else g.at_start(n, 0 if place == "start" else 1)
                    # read into it
                    buf[:] = 0xEE
                    want = min(n, max(0, size_now - off))
                    try:
                        got = await f.pread(buf, off)
                    except nvme.ShortReadError as e:
                        got = e.received
                    assert got == want, (n, off, place, got, want)
                    assert np.array_equal(buf[:want], model[off : off + want]), (n, off, place)
                    # write from it (read-modify-write at both ends when unaligned)
                    buf[:] = rng.integers(0, 256, n, dtype=np.uint8)
                    assert await f.pwrite(buf, off) == n
                    model[off : off + n] = buf
                    size_now = max(size_now, off + n)
                    count += 2
        assert f.size() == size_now
        back = np.fromfile(path, np.uint8)
        assert np.array_equal(back, model[:size_now])

with nvme.defaults.set(engine=engine):
    asyncio.run(main())
print("ok", count)
"""


@pytest.mark.parametrize("engine", ["auto", "thread"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_transfers_flush_against_guard_pages(tmp_path, direct, engine):
    r = run_python(CHILD, str(tmp_path / "g.bin"), "1" if direct else "0", engine, timeout=240)
    assert r.returncode == 0, f"child died ({r.returncode}): {r.stderr[-3000:]}"
    assert r.stdout.split()[0] == "ok" and int(r.stdout.split()[1]) == 12 * 7 * 3 * 2
