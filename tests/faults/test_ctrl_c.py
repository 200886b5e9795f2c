"""Ctrl-C during a blocking transfer (issue 12 §3).

A 48 MiB read from a loop device throttled to 4 MiB/s takes ~12 s. SIGINT is
sent to the main thread 1.5 s in: KeyboardInterrupt must arrive within 1 s,
and once it has, the kernel must not write into the buffer any more (the
chunks in flight were waited for, as with async cancellation).

Kernel AIO cannot cancel a transfer (io_cancel answers EINVAL), so the
exception can only come once the chunks in flight have landed. With explicit
small knobs (256 KiB chunks, 4 at a time) 1 MiB is in flight, which the device
delivers in 0.25 s. With the defaults (1 MiB chunks, 64 MiB in flight per
engine) blocking calls keep in flight only what the device completes in about
0.25 s, measured from its completions (the engine's adaptive window), so
Ctrl-C arrives as fast; the same 48 MiB written at 4 MiB/s too. An async call
with the defaults still has the whole request in flight: asyncio code cancels
with the task instead.
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
SMALL = {"block_size": "256K", "parallelism": 4}

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
    with blkio_throttle(fs.dev, read_bps=RATE, write_bps=RATE):
        yield path


def _transfer(how: str, knobs: dict[str, object], path: str, buf: np.ndarray) -> None:
    if how == "File.sync_pread":
        with nvme.open(path, **knobs) as f:
            f.sync_pread(buf, 0)
    elif how == "File.sync_pwrite":
        with nvme.open(path, "r+", **knobs) as f:
            f.sync_pwrite(buf, 0)
    elif how == "Handle.sync_pread":
        handle_knobs = {"intra_op_parallelism" if k == "parallelism" else k: v for k, v in knobs.items()}
        nvme.Handle(**handle_knobs).sync_pread(buf, path, 0)
    else:

        async def main() -> None:
            await nvme.pread(buf, path, **knobs)

        asyncio.run(main())


@pytest.mark.parametrize(
    "how, knobs",
    [
        ("File.sync_pread", SMALL),
        ("Handle.sync_pread", SMALL),
        ("asyncio.run(pread)", SMALL),
        ("File.sync_pread", {}),
        ("Handle.sync_pread", {}),
        ("File.sync_pwrite", {}),
    ],
    ids=[
        "File.sync_pread-small",
        "Handle.sync_pread-small",
        "asyncio.run(pread)-small",
        "File.sync_pread-defaults",
        "Handle.sync_pread-defaults",
        "File.sync_pwrite-defaults",
    ],
)
def test_ctrl_c_interrupts_a_blocking_transfer(slow_file, how, knobs):
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    buf = nvme.empty(SIZE)
    if how == "File.sync_pwrite":
        buf[:] = 0x5A
    sent: list[float] = []
    timer = _sigint_after(SIGNAL_AT, sent)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            _transfer(how, knobs, slow_file, buf)
    finally:
        timer.cancel()
    raised = time.monotonic()
    assert sent, "the read ended before the signal was sent: the device is not slow"
    late = raised - sent[0]
    assert late < 1.0, f"KeyboardInterrupt came {late:.2f} s after SIGINT ({raised - t0:.1f} s in)"
    if how == "File.sync_pwrite":
        return  # the engine holds no chunk any more: the autouse fixture checks it
    # The buffer promise: nothing of this read lands after the exception.
    buf[:] = SENTINEL
    time.sleep(1.0)
    changed = int(np.count_nonzero(buf != SENTINEL))
    assert changed == 0, f"{changed} bytes of the buffer were written after KeyboardInterrupt"


@pytest.fixture
def slow_checkpoint(loopfs, drop_caches):
    fs = loopfs("ext4", 64 * MiB)
    path = str(fs.mnt / "ckpt.safetensors")
    nvme.sync_save({"w": np.random.default_rng(4).integers(0, 256, 40 * MiB, dtype=np.uint8)}, path)
    drop_caches()
    with blkio_throttle(fs.dev, read_bps=RATE):
        yield path


def test_ctrl_c_interrupts_sync_load(slow_checkpoint):
    # sync_load runs on aionvme's background loop: Ctrl-C cancels the load and
    # waits for its reads in flight, which the loop's engine keeps to what the
    # device completes in ~0.25 s, as the engines of blocking calls do.
    sent: list[float] = []
    timer = _sigint_after(SIGNAL_AT, sent)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            nvme.sync_load(slow_checkpoint)
    finally:
        timer.cancel()
    raised = time.monotonic()
    assert sent, "the load ended before the signal was sent: the device is not slow"
    late = raised - sent[0]
    assert late < 1.0, f"KeyboardInterrupt came {late:.2f} s after SIGINT ({raised - t0:.1f} s in)"
