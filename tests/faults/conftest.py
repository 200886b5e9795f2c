"""Fixtures for the fault-injection tests. Each one undoes what it did (unmount,
detach the loop device, restore sysctls) even when the test fails, and skips
with the reason when a tool or a privilege is missing."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .faultkit import LoopFS, make_loopfs, need_root, need_tools, sh

HERE = Path(__file__).resolve().parent


@pytest.fixture
def loopfs(tmp_path: Path) -> Iterator[Callable[..., LoopFS]]:
    """loopfs(fstype='ext4', size=32 MiB, sector=512, mkfs_args=(), mount_opts='')
    -> a mounted LoopFS; all of them are unmounted and detached afterwards."""
    made: list[LoopFS] = []

    def make(fstype: str = "ext4", size: int = 32 << 20, **kw: object) -> LoopFS:
        fs = make_loopfs(tmp_path, fstype, size, name=f"fs{len(made)}", **kw)  # type: ignore[arg-type]
        made.append(fs)
        return fs

    try:
        yield make
    finally:
        for fs in reversed(made):
            fs.cleanup()


@pytest.fixture
def ext4(loopfs: Callable[..., LoopFS]) -> LoopFS:
    """A fresh 32 MiB ext4 on a loop device."""
    return loopfs("ext4", 32 << 20)


# xfs refuses filesystems under 300 MiB; the image is sparse (mkfs writes ~64 MiB of log).
XFS_SIZE = 320 << 20


@pytest.fixture(params=["ext4", "xfs"])
def shutdown_fs(request: pytest.FixtureRequest, loopfs: Callable[..., LoopFS]) -> LoopFS:
    """ext4 and xfs, both of which take the shutdown ioctl."""
    if request.param == "xfs":
        return loopfs("xfs", XFS_SIZE)
    return loopfs("ext4", 64 << 20)


# -- FUSE --------------------------------------------------------------------------


class FaultFS:
    """A mounted faultfs (faultfs.c): passthrough to ``backing`` with faults.

    ``set(delay_us=, eio=(start, end), flush_eio=)`` changes them while mounted.
    """

    def __init__(self, binary: Path, backing: Path, mnt: Path) -> None:
        self.binary = binary
        self.backing = backing
        self.mnt = mnt
        self.mounted = False

    def mount(self, delay_us: int = 0) -> None:
        r = subprocess.run(
            [str(self.binary), str(self.backing), str(self.mnt), f"--delay-us={delay_us}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount the FUSE test filesystem: {r.stderr.strip()}")
        self.mounted = True
        for _ in range(100):
            if os.path.ismount(self.mnt):
                return
            time.sleep(0.01)
        pytest.fail("faultfs did not appear as a mount")

    def set(self, delay_us: int = 0, eio: tuple[int, int] = (-1, -1), flush_eio: bool = False) -> None:
        (self.backing / ".faultfs-control").write_text(f"{delay_us} {eio[0]} {eio[1]} {int(flush_eio)}\n")
        # a lookup of /.reload makes the daemon re-read the control file
        assert not (self.mnt / ".reload").exists()

    def umount(self) -> None:
        if self.mounted:
            r = sh("fusermount3", "-u", str(self.mnt), check=False)
            if r.returncode != 0:
                sh("umount", "-l", str(self.mnt), check=False)
            self.mounted = False


@pytest.fixture(scope="session")
def faultfs_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """faultfs.c compiled against libfuse3 (once per session)."""
    need_tools("gcc", "pkg-config", "fusermount3")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    if flags.returncode != 0:
        pytest.skip("libfuse3 development files are missing (apt-get install libfuse3-dev)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse does not exist: no FUSE in this kernel or container")
    out = tmp_path_factory.mktemp("faultfs") / "faultfs"
    r = subprocess.run(
        ["gcc", "-O2", "-Wall", str(HERE / "faultfs.c"), *flags.stdout.split(), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.fail(f"faultfs.c does not compile:\n{r.stderr}")
    return out


@pytest.fixture
def faultfs(faultfs_binary: Path, tmp_path: Path) -> Iterator[FaultFS]:
    need_root()
    backing, mnt = tmp_path / "fuse-backing", tmp_path / "fuse"
    backing.mkdir()
    mnt.mkdir()
    fs = FaultFS(faultfs_binary, backing, mnt)
    fs.mount()
    try:
        yield fs
    finally:
        fs.umount()


# -- machine-wide knobs -----------------------------------------------------------------


@pytest.fixture
def aio_max_nr() -> Iterator[Path]:
    """/proc/sys/fs/aio-max-nr, restored to its value after the test."""
    need_root()
    p = Path("/proc/sys/fs/aio-max-nr")
    if not p.exists():
        pytest.skip("no /proc/sys/fs/aio-max-nr (kernel without AIO)")
    saved = p.read_text()
    try:
        yield p
    finally:
        p.write_text(saved)


@pytest.fixture
def drop_caches() -> Callable[[], None]:
    def drop() -> None:
        if os.geteuid() == 0:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")

    return drop


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say why fault tests were skipped, even under -q (CI runs -q)."""
    reasons = set()
    for rep in terminalreporter.stats.get("skipped", []):
        if "tests/faults/" in rep.nodeid and isinstance(rep.longrepr, tuple):
            reasons.add(rep.longrepr[2])
    if reasons:
        terminalreporter.write_sep("-", "fault tests skipped because")
        for r in sorted(reasons):
            terminalreporter.write_line(r)


# -- the kernel-async engines --------------------------------------------------------


@pytest.fixture(params=["aio", "uring"])
def kernel_engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a fault test on kernel AIO and on io_uring (every transfer through
    the ring), for the faults whose completions come from the kernel."""
    import aionvme as nvme
    from aionvme._engine import Engine

    if request.param == "uring":
        probe = Engine(queue_depth=4, uring=2)
        try:
            if not probe.uring_direct:
                pytest.skip(f"io_uring is unavailable here: {probe.uring_error}")
        finally:
            probe.close()
    with nvme.defaults.set(engine=request.param):
        yield request.param
