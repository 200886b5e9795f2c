"""Shared fixtures: every async test runs on asyncio's loop and on uvloop;
files are real files on the local disk (ext4 here) unless a test mounts its own."""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import re
import shutil
import site
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aionvme  # builds/imports the engine before tests are collected
import aionvme._engine as _engine
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


# Peers that the README's test command cannot install (their packages need --no-deps: DeepSpeed's
# bare torch requirement, mosaicml-streaming's torchvision): their tests skip there, with the reason,
# and .ci/run's extra job installs them and runs `pytest -m peers`.
# The serving engines (vLLM, SGLang, LMCache), Lightning, diffusers and Ray join them: their tests
# mark themselves (`pytestmark = pytest.mark.peers`) or name the package in a skipif reason.
PEER_FILES = {"test_deepspeed_compat.py", "test_data_mds.py"}
PEER_MODULES = re.compile(r"\b(deepspeed|streaming|vllm|sglang|lmcache|ray|lightning|diffusers)\b")


def _needs_a_peer(item: pytest.Item) -> bool:
    if item.path.name in PEER_FILES:
        return True
    return any(
        PEER_MODULES.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif")
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_a_peer(item):
            item.add_marker(pytest.mark.peers)


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


# Files libraries keep open on purpose (matplotlib's font cache, ...), not leaks of ours.
_NOT_OURS = tuple(
    {"/dev/", "/proc/", sys.prefix + "/", sys.base_prefix + "/", *(p + "/" for p in site.getsitepackages())}
)


def _open_files() -> dict[int, str]:
    """This process's fds that name regular files (not pipes, sockets, ttys or
    anonymous inodes such as eventfds, which pytest, asyncio and uvloop open)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the fd of the listing itself, gone already
            continue
        if target.startswith("/") and not target.startswith(_NOT_OURS):
            out[int(name)] = target
    return out


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    """After every test: no engine still holds a request, a chunk, or a buffer;
    no file the test opened is still open; no bounce buffer outlives its engine."""
    files_before = _open_files()
    yield
    # A full gc.collect() costs 0.1-0.5 s once torch is imported; most tests
    # leave nothing behind, so collect only when the first look finds
    # something, then judge what is left after the collection.
    problems = _leaks(files_before)
    if problems:
        gc.collect()
        problems = _leaks(files_before)
    assert not problems, "\n".join(problems)


def _leaks(files_before: dict[int, str]) -> list[str]:
    out = []
    live_bounce = seen = 0
    for eng in list(_reactor._engines):
        s = eng.stats()
        if s["closed"]:
            continue
        if s["live_requests"] != 0:
            out.append(f"requests left in an engine: {s}")
        if s["inflight"] != 0:
            out.append(f"chunks left in flight: {s}")
        live_bounce += s["bounce_live"]
        seen += 1
    c = _engine.counters()
    if seen == c["engines"] and c["bounce_buffers"] > live_bounce:
        # every live engine is in view (a Handle's pooled ones are not)
        out.append(f"bounce buffers outlived their engines: {c}")
    if c["engine_fds"] > c["engines"] + c["refill_threads"] or c["refill_threads"] > c["engines"]:
        out.append(f"eventfds or refill threads outlived their engines: {c}")
    if c["debug"] and c["checks_failed"] != 0:
        out.append(f"the debug engine's invariant checks failed: {c}")
    leaked = {fd: t for fd, t in _open_files().items() if files_before.get(fd) != t}
    if leaked:
        out.append(f"files left open by the test: {leaked}")
    return out


def _uring_error() -> str | None:
    probe = _engine.Engine(queue_depth=4, uring=2)
    try:
        return None if probe.uring_direct else str(probe.uring_error)
    finally:
        probe.close()


@pytest.fixture(params=["aio", "uring", "thread", "aio+refill"])
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on the kernel-AIO engine with and without its refill
    thread (``aio+refill`` and ``aio``: ``defaults.refill_thread``; the test
    sees "aio" in both), the io_uring engine and the worker-thread engine.

    Loops made for the test get a reactor with this engine; blocking calls in
    the test's thread get a fresh engine of this kind, closed afterwards."""
    name, _, extra = request.param.partition("+")
    if name == "aio" and _engine.aio_probe() is not None:
        pytest.skip(f"kernel AIO is unavailable here: {_engine.aio_probe()}")
    if name == "uring" and (why := _uring_error()) is not None:
        pytest.skip(f"io_uring is unavailable here: {why}")
    tls = _blocking_state()
    saved = getattr(tls, "pair", None)
    tls.pair = None
    try:
        with aionvme.defaults.set(engine=name, refill_thread=extra == "refill"):
            yield name
    finally:
        pair = getattr(tls, "pair", None)
        if pair is not None:
            pair[0].close()
        tls.pair = saved


def _blocking_state() -> Any:
    """The thread-local that holds each thread's engine for blocking calls."""
    for name in ("aionvme._runtime.blocking",):
        try:
            return importlib.import_module(name)._tls
        except (ImportError, AttributeError):
            continue
    raise RuntimeError("cannot find the blocking-call engine of this thread")


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
