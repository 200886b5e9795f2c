"""Tools for the fault-injection tests: real filesystems on loop devices, the
filesystem shutdown ioctl, loop size limits, subprocess runs and loop-latency
probes. Fixtures built on these live in conftest.py next to this file."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

IS_ROOT = os.geteuid() == 0

# <linux/fs.h> / xfs_fs.h: EXT4_IOC_SHUTDOWN and XFS_IOC_GOINGDOWN are the same
# ioctl, _IOR('X', 125, __u32), with the same flags.
FS_IOC_SHUTDOWN = 0x8004587D
SHUTDOWN_DEFAULT = 0  # freeze, flush, then shut down
SHUTDOWN_LOGFLUSH = 1  # flush the journal, not the data
SHUTDOWN_NOLOGFLUSH = 2  # stop dead: like pulling the plug

# <linux/loop.h>
LOOP_SET_STATUS64 = 0x4C04
LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64 = struct.Struct("QQQQQIIII64s64s32sQQ")  # struct loop_info64, 232 bytes
_SIZELIMIT_FIELD = 4


def need_root() -> None:
    if not IS_ROOT:
        pytest.skip("needs root (loop devices, mounts)")


def need_tools(*names: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install; see .ci/run)")


def sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


class LoopFS:
    """A filesystem on a loop device over a sparse image file.

    ``dev`` is the loop device, ``mnt`` the mount point. ``cleanup()`` is
    idempotent: unmount (lazily if busy) and detach the loop device.
    """

    def __init__(self, image: Path, mnt: Path, fstype: str, sector: int, mount_opts: str) -> None:
        self.image = image
        self.mnt = mnt
        self.fstype = fstype
        self.sector = sector
        self.mount_opts = mount_opts
        self.dev: str | None = None
        self.mounted = False

    def attach(self) -> None:
        cmd = ["losetup", "-f", "--show"]
        if self.sector != 512:
            cmd += ["-b", str(self.sector)]
        r = sh(*cmd, str(self.image), check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot attach a loop device: {r.stderr.strip()}")
        self.dev = r.stdout.strip()

    def mkfs(self, *args: str) -> None:
        assert self.dev is not None
        if self.fstype == "ext4":
            sh("mkfs.ext4", "-q", "-F", "-E", "nodiscard", *args, self.dev)
        elif self.fstype == "xfs":
            sh("mkfs.xfs", "-q", "-f", "-K", *args, self.dev)
        else:
            raise ValueError(self.fstype)

    def mount(self) -> None:
        assert self.dev is not None
        self.mnt.mkdir(exist_ok=True)
        cmd = ["mount", "-t", self.fstype]
        if self.mount_opts:
            cmd += ["-o", self.mount_opts]
        r = sh(*cmd, self.dev, str(self.mnt), check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot mount {self.fstype} on {self.dev}: {r.stderr.strip()}")
        self.mounted = True

    def umount(self) -> None:
        if self.mounted:
            r = sh("umount", str(self.mnt), check=False)
            if r.returncode != 0:
                sh("umount", "-l", str(self.mnt), check=False)
            self.mounted = False

    def remount(self) -> None:
        """Unmount and mount again: after a shutdown, the journal is replayed."""
        self.umount()
        self.mount()

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.umount()
        if self.dev is not None:
            sh("losetup", "-d", self.dev, check=False)
            self.dev = None

    # -- faults ----------------------------------------------------------------

    def shutdown(self, flags: int = SHUTDOWN_NOLOGFLUSH) -> None:
        """The filesystem shutdown ioctl: every later I/O on it fails (EIO)."""
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, FS_IOC_SHUTDOWN, struct.pack("I", flags))
        finally:
            os.close(fd)

    def set_size_limit(self, nbytes: int) -> None:
        """Shrink (or restore, 0 = whole file) the live device's size limit."""
        assert self.dev is not None
        fd = os.open(self.dev, os.O_RDONLY)
        try:
            raw = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_LOOP_INFO64.size))
            info = list(_LOOP_INFO64.unpack(raw))
            info[_SIZELIMIT_FIELD] = nbytes
            fcntl.ioctl(fd, LOOP_SET_STATUS64, _LOOP_INFO64.pack(*info))
        finally:
            os.close(fd)

    def device_size(self) -> int:
        assert self.dev is not None
        fd = os.open(self.dev, os.O_RDONLY)
        try:
            return os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)


def make_loopfs(
    tmp_path: Path,
    fstype: str = "ext4",
    size: int = 32 << 20,
    sector: int = 512,
    mkfs_args: Sequence[str] = (),
    mount_opts: str = "",
    name: str = "fs",
) -> LoopFS:
    """Create, attach, format and mount; the caller must call cleanup()."""
    need_root()
    need_tools("losetup", "mount", "umount", f"mkfs.{fstype}")
    image = tmp_path / f"{name}.img"
    with open(image, "wb") as f:
        f.truncate(size)  # sparse
    fs = LoopFS(image, tmp_path / name, fstype, sector, mount_opts)
    try:
        fs.attach()
        fs.mkfs(*mkfs_args)
        fs.mount()
    except BaseException:
        fs.cleanup()
        raise
    return fs


def fiemap(fd: int, length: int) -> list[tuple[int, int, int]]:
    """The file's extents as (logical, physical, length) from FS_IOC_FIEMAP."""
    fs_ioc_fiemap = 0xC020660B
    n = 64
    hdr = struct.Struct("QQIIII")  # fm_start, fm_length, fm_flags, mapped, count, reserved
    ext = struct.Struct("QQQQQIIII")  # logical, physical, length, 2 reserved, flags, 3 reserved
    req = bytearray(hdr.pack(0, length, 1, 0, n, 0) + bytes(ext.size * n))  # FIEMAP_FLAG_SYNC
    fcntl.ioctl(fd, fs_ioc_fiemap, req)
    mapped = hdr.unpack_from(req)[3]
    out = []
    for i in range(mapped):
        lo, ph, ln, *_ = ext.unpack_from(req, hdr.size + i * ext.size)
        out.append((lo, ph, ln))
    return out


# -- subprocesses ------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.update(extra)
    return env


def run_python(
    code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter (a crash there fails the test, not pytest)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or child_env(),
    )


# -- loop responsiveness ---------------------------------------------------------------


class LatencyProbe:
    """A callback due every ``period`` seconds; records how late each one ran.

    ``lateness`` holds, per tick, how much later than due the callback ran
    (seconds). Uses call_at on the loop's own clock, so the timer's own
    overhead is the same with and without I/O.
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lateness: list[float] = []
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + self.period
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self.lateness.append(now - self._due)
        self._due = max(self._due + self.period, now)
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def worst(self) -> float:
        return max(self.lateness, default=0.0)

    def quantile(self, q: float) -> float:
        s = sorted(self.lateness)
        return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


class ReactorTimer:
    """Times every callback aionvme's reactor runs on the loop thread (its
    flush after submissions and its eventfd reader): the loop is blocked by
    aionvme exactly while one of these runs.

    Per callback it records wall time, the thread's CPU time and its run
    delay (time spent runnable but waiting for a CPU, from
    /proc/thread-self/schedstat). ``held`` = wall - run delay is the time
    aionvme itself held the loop: computing, or asleep in a syscall (an
    io_submit waiting for a device or a FUSE daemon). What it leaves out is
    time the scheduler gave to other threads and processes, i.e. machine
    noise on a busy 2-core VM.
    """

    def __init__(self, reactor: object) -> None:
        self.reactor = reactor
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.runq: list[float] = []
        self._sched = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        r = reactor
        self._orig_flush = r._flush  # type: ignore[attr-defined]
        self._orig_pump = r._pump  # type: ignore[attr-defined]
        r._flush = self._timed(self._orig_flush)  # type: ignore[attr-defined]
        loop, fd = r.loop, r._fd  # type: ignore[attr-defined]
        loop.remove_reader(fd)
        loop.add_reader(fd, self._timed(self._orig_pump))

    def _run_delay(self) -> float:
        return int(os.pread(self._sched, 100, 0).split()[1]) * 1e-9

    def _timed(self, fn):  # type: ignore[no-untyped-def]
        def run() -> None:
            if self._sched < 0:
                # Restored, but a callback queued before (e.g. the flush the
                # reactor schedules after delivering) still runs: run it plain.
                fn()
                return
            q0, c0, w0 = self._run_delay(), time.thread_time(), time.perf_counter()
            try:
                fn()
            finally:
                w1, c1, q1 = time.perf_counter(), time.thread_time(), self._run_delay()
                self.wall.append(w1 - w0)
                self.cpu.append(c1 - c0)
                self.runq.append(q1 - q0)

        return run

    @property
    def held(self) -> list[float]:
        return [max(0.0, w - q) for w, q in zip(self.wall, self.runq)]

    def restore(self) -> None:
        r = self.reactor
        r._flush = self._orig_flush  # type: ignore[attr-defined]
        if not r.closed:  # type: ignore[attr-defined]
            r.loop.remove_reader(r._fd)  # type: ignore[attr-defined]
            r.loop.add_reader(r._fd, self._orig_pump)  # type: ignore[attr-defined]
        fd, self._sched = self._sched, -1
        os.close(fd)

    def worst(self) -> float:
        return max(self.held, default=0.0)


async def responsiveness(work, *, attempts: int = 3, limit: float = 0.005, period: float = 0.001) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Run ``await work()`` under a 1 ms probe while timing aionvme's loop callbacks.

    Passes (returns the figures) on the first attempt in which no aionvme
    callback held the loop (see ReactorTimer.held) for ``limit`` seconds or
    more; raises AssertionError with every attempt's figures when none did.
    A stall that aionvme causes recurs on every attempt; a VM hiccup that the
    run-delay correction misses does not. The probe's lateness, with a
    baseline taken just before without I/O, is reported for the record.
    """
    from aionvme._runtime import reactor as _reactor

    tries = []
    for _ in range(attempts):
        base = LatencyProbe(period)
        base.start()
        await asyncio.sleep(0.2)
        base.stop()
        timer = ReactorTimer(_reactor.get_reactor())
        probe = LatencyProbe(period)
        probe.start()
        t0 = time.perf_counter()
        try:
            await work()
        finally:
            probe.stop()
            timer.restore()
        worst = max(range(len(timer.wall)), key=lambda i: timer.held[i], default=None)
        fig = {
            "seconds": round(time.perf_counter() - t0, 3),
            "callbacks": len(timer.wall),
            "held_max_ms": round(timer.worst() * 1e3, 3),
            "held_max_cpu_ms": round(timer.cpu[worst] * 1e3, 3) if worst is not None else 0.0,
            "wall_max_ms": round(max(timer.wall, default=0.0) * 1e3, 3),
            "probe_p99_ms": round(probe.quantile(0.99) * 1e3, 3),
            "probe_max_ms": round(probe.worst() * 1e3, 3),
            "baseline_p99_ms": round(base.quantile(0.99) * 1e3, 3),
            "baseline_max_ms": round(base.worst() * 1e3, 3),
        }
        tries.append(fig)
        if timer.worst() < limit:
            return fig
    raise AssertionError(f"aionvme held the loop {limit * 1e3:.0f} ms or more in every attempt: {tries}")


# -- blkio throttling (cgroup v1) ------------------------------------------------------

BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")


def _own_blkio_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "blkio" in controllers.split(","):
            return BLKIO_ROOT / path.lstrip("/")
    return None


@contextlib.contextmanager
def blkio_throttle(dev: str, read_bps: int = 0, write_bps: int = 0, read_iops: int = 0):  # type: ignore[no-untyped-def]
    """Throttle this process's I/O to block device ``dev`` (cgroup v1 blkio).

    The whole process (all threads, so the engine's workers too) moves into a
    new cgroup for the block and back to its own afterwards.
    """
    need_root()
    home = _own_blkio_cgroup()
    if home is None or not (BLKIO_ROOT / "blkio.throttle.read_bps_device").exists():
        pytest.skip("no cgroup v1 blkio controller with throttling on this machine")
    st = os.stat(dev)
    majmin = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    cg = BLKIO_ROOT / f"aionvme-test-{os.getpid()}"
    cg.mkdir(exist_ok=True)
    try:
        for name, value in (
            ("read_bps_device", read_bps),
            ("write_bps_device", write_bps),
            ("read_iops_device", read_iops),
        ):
            if value:
                (cg / f"blkio.throttle.{name}").write_text(f"{majmin} {value}\n")
        (cg / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield cg
        finally:
            (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)  # throttled bios still queued in it
