"""Shared fixtures: every async test runs on asyncio's loop and on uvloop;
files are real files on the local disk (ext4 here) unless a test mounts its own."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import aionvme  # noqa: F401 - builds/imports the engine before tests are collected
from aionvme._runtime import reactor as _reactor

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a test dependency
    uvloop = None


def pytest_asyncio_loop_factories(config, item):
    factories = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (mounts, loop devices, page cache)")


@pytest.fixture
def tmp_dir(tmp_path: Path) -> Path:
    """A directory on the local disk (pytest's tmp_path), not tmpfs."""
    return tmp_path


@pytest.fixture
def make_file(tmp_dir: Path) -> Callable[..., tuple[str, np.ndarray]]:
    """make_file(nbytes, seed=0, name=None) -> (path, its bytes as a numpy array)."""
    counter = iter(range(10**9))

    def make(nbytes: int, seed: int = 0, name: str | None = None, directory: Path | None = None):
        data = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
        path = (directory or tmp_dir) / (name or f"data{next(counter)}.bin")
        data.tofile(path)
        return str(path), data

    return make


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    """After every test: no engine still holds a request, a chunk, or a buffer."""
    yield
    gc.collect()
    for eng in list(_reactor._engines):
        s = eng.stats()
        if s["closed"]:
            continue
        assert s["live_requests"] == 0, f"requests left in an engine: {s}"
        assert s["inflight"] == 0, f"chunks left in flight: {s}"


@pytest.fixture
def ramfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh ramfs mount (refuses O_DIRECT at open with EINVAL)."""
    if not IS_ROOT or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to mount ramfs")
    d = tmp_path / "ramfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "none", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount ramfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    if not IS_ROOT:
        pytest.skip("needs root to mount tmpfs")
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m", "none", str(d)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
