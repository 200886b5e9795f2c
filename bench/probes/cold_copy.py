"""How fast a 1 MiB memcpy into a buffer is right after the thread paused.

    python3 bench/probes/cold_copy.py [DIR]

A put into the TieredStore copies the value into the host tier, often just
after the loop thread slept in a write. On the 2-vCPU VM of bench/README.md a
memcpy into memory that went cold (a sleep of 1-10 ms, or an O_DIRECT write or
read of the buffer) runs several times slower than the same copy in a hot loop:
this prints the median time of a 1 MiB copy after each kind of pause.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np

SIZE = 1 << 20


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=tempfile.gettempdir(), help="where the scratch file goes")
    d = ap.parse_args(argv).dir
    path = os.path.join(d, "aionvme-cold-copy.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 64 * SIZE)
        m = mmap.mmap(-1, SIZE)  # page-aligned, as O_DIRECT needs
        buf = np.frombuffer(m, np.uint8)
        buf[:] = 1
        src = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
        for label, io in (
            ("no I/O", None),
            ("an O_DIRECT write of it", os.pwritev),
            ("an O_DIRECT read into it", os.preadv),
        ):
            for delay in (0.0, 0.001, 0.01):
                times = []
                for i in range(40):
                    if io is not None:
                        io(fd, [m], (i % 64) * SIZE)
                    if delay:
                        time.sleep(delay)
                    t0 = time.perf_counter()
                    np.copyto(buf, src)
                    times.append(time.perf_counter() - t0)
                print(
                    f"after {label:26s} and a {delay * 1e3:4.0f} ms sleep: "
                    f"1 MiB memcpy {statistics.median(times) * 1e6:7.1f} µs"
                )
    finally:
        os.close(fd)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
