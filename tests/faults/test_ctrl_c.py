"""Ctrl-C during a blocking transfer (issue 12 §3).

A 48 MiB read from a loop device throttled to 4 MiB/s takes ~12 s. SIGINT is
sent to the main thread 1.5 s in: KeyboardInterrupt must arrive within 1 s,
and once it has, the kernel must not write into the buffer any more (the
chunks in flight were waited for, as with async cancellation).

Kernel AIO cannot cancel a transfer (io_cancel answers EINVAL), so the
exception can only come once the chunks in flight have landed: the reads
here keep 1 MiB in flight (256 KiB chunks, 4 at a time), which the device
delivers in 0.25 s. With the defaults a whole 48 MiB request is in flight at
once, and Ctrl-C waits for all of it, in blocking and async calls alike.
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

from .faultkit import blkio_throttle

MiB = 1 << 20
SIZE = 48 * MiB
RATE = 4 * MiB
SIGNAL_AT = 1.5
SENTINEL = 0xA5
BLOCK = "256K"
PARALLEL = 4

pytestmark = pytest.mark.slow


def _sigint_after(delay: float, sent: list[float]) -> threading.Timer:
    def fire() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)  # process-directed, as Ctrl-C in a terminal

    t = threading.Timer(delay, fire)
    t.start()
    return t


@pytest.fixture
def slow_file(loopfs, drop_caches):
    fs = loopfs("ext4", 64 * MiB)
    path = str(fs.mnt / "slow.bin")
    with open(path, "wb") as f:
        f.write(np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8).tobytes())
    drop_caches()
    with blkio_throttle(fs.dev, read_bps=RATE):
        yield path


def _read_blocking(how: str, path: str, buf: np.ndarray) -> None:
    if how == "File.sync_pread":
        with nvme.open(path, block_size=BLOCK, parallelism=PARALLEL) as f:
            f.sync_pread(buf, 0)
    elif how == "Handle.sync_pread":
        nvme.Handle(block_size=BLOCK, intra_op_parallelism=PARALLEL).sync_pread(buf, path, 0)
    else:

        async def main() -> None:
            await nvme.pread(buf, path, block_size=BLOCK, parallelism=PARALLEL)

        asyncio.run(main())


@pytest.mark.parametrize("how", ["File.sync_pread", "Handle.sync_pread", "asyncio.run(pread)"])
def test_ctrl_c_interrupts_a_blocking_read(slow_file, how):
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    buf = nvme.empty(SIZE)
    sent: list[float] = []
    timer = _sigint_after(SIGNAL_AT, sent)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            _read_blocking(how, slow_file, buf)
    finally:
        timer.cancel()
    raised = time.monotonic()
    assert sent, "the read ended before the signal was sent: the device is not slow"
    late = raised - sent[0]
    assert late < 1.0, f"KeyboardInterrupt came {late:.2f} s after SIGINT ({raised - t0:.1f} s in)"
    # The buffer promise: nothing of this read lands after the exception.
    buf[:] = SENTINEL
    time.sleep(1.0)
    changed = int(np.count_nonzero(buf != SENTINEL))
    assert changed == 0, f"{changed} bytes of the buffer were written after KeyboardInterrupt"
