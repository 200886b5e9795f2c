"""One validation for knobs: every entry point refuses the same bad values
with the same error types (InvalidSettingError, SettingTypeError for a
wrong type), and the environment, config files and modes follow suit."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aionvme as nvme
from aionvme import Handle, InvalidSettingError, SettingTypeError, defaults
from aionvme.compat import deepspeed as ds

ROOT = Path(__file__).resolve().parent.parent

# value -> the error every entry point gives for it
BAD_BLOCK_SIZES: list[tuple[Any, type[Exception]]] = [
    (0, InvalidSettingError),
    (-4096, InvalidSettingError),
    (1000, InvalidSettingError),  # not a multiple of 4096
    ("1K", InvalidSettingError),
    ("lots", InvalidSettingError),
    ("0.3K", InvalidSettingError),  # 307.2 bytes
    ("1.5", InvalidSettingError),  # 1.5 bytes
    (1.5, SettingTypeError),
    (True, SettingTypeError),
    ([4096], SettingTypeError),
]
BAD_PARALLELISM: list[tuple[Any, type[Exception]]] = [
    (-1, InvalidSettingError),
    (1.5, SettingTypeError),
    (True, SettingTypeError),
    ("many", InvalidSettingError),
]
BAD_QUEUE_DEPTH: list[tuple[Any, type[Exception]]] = [
    (0, InvalidSettingError),
    (-3, InvalidSettingError),
    (1 << 20, InvalidSettingError),
    (2.0, SettingTypeError),
    (False, SettingTypeError),
]


def _check(call: Callable[[], Any], exc: type[Exception], what: str) -> None:
    with pytest.raises(exc) as ei:
        call()
    assert isinstance(ei.value, nvme.AionvmeError), what
    # the exact type: SettingTypeError only where the type is wrong
    assert type(ei.value) is exc, f"{what}: {type(ei.value).__name__} instead of {exc.__name__}"


async def _check_async(call: Callable[[], Any], exc: type[Exception], what: str) -> None:
    aw = call()  # never raises: the error arrives at the await
    with pytest.raises(exc) as ei:
        await aw
    assert type(ei.value) is exc, f"{what}: {type(ei.value).__name__} instead of {exc.__name__}"


def test_the_errors_are_the_builtins_they_resemble():
    assert issubclass(InvalidSettingError, ValueError) and issubclass(InvalidSettingError, nvme.AionvmeError)
    assert issubclass(SettingTypeError, TypeError) and issubclass(SettingTypeError, InvalidSettingError)


async def test_every_entry_point_refuses_the_same_block_sizes(make_file):
    path, _ = make_file(8192)
    buf = np.zeros(4096, np.uint8)
    for value, exc in BAD_BLOCK_SIZES:
        w = f"block_size={value!r}"
        await _check_async(lambda v=value: nvme.pread(buf, path, block_size=v), exc, f"pread {w}")
        await _check_async(lambda v=value: nvme.pwrite(buf, path, block_size=v), exc, f"pwrite {w}")
        await _check_async(lambda v=value: nvme.pread_many([(buf, 0)], path, block_size=v), exc, w)
        await _check_async(lambda v=value: nvme.pwrite_many([(buf, 0)], path, block_size=v), exc, w)
        _check(lambda v=value: nvme.open(path, block_size=v), exc, f"open {w}")
        _check(lambda v=value: nvme.File(path, block_size=v), exc, f"File {w}")
        _check(lambda v=value: Handle(block_size=v), exc, f"Handle {w}")
        _check(lambda v=value: Handle.from_config({"aionvme": {"block_size": v}}), exc, w)
        _check(lambda v=value: Handle.from_config({"aionvme": {}}, block_size=v), exc, w)
        _check(lambda v=value: defaults.set(block_size=v), exc, f"defaults.set {w}")
        if value != 1000:  # DeepNVMe takes any positive size: the handle rounds it up to 4096
            _check(lambda v=value: ds.aio_handle(block_size=v), exc, f"aio_handle {w}")
    with ds.aio_handle(block_size=1000).handle as h:
        assert h.block_size == 4096


async def test_every_entry_point_refuses_the_same_parallelism(make_file):
    path, _ = make_file(8192)
    buf = np.zeros(4096, np.uint8)
    for value, exc in BAD_PARALLELISM:
        w = f"parallelism={value!r}"
        await _check_async(lambda v=value: nvme.pread(buf, path, parallelism=v), exc, f"pread {w}")
        await _check_async(lambda v=value: nvme.pwrite_many([(buf, 0)], path, parallelism=v), exc, w)
        _check(lambda v=value: nvme.open(path, parallelism=v), exc, f"open {w}")
        _check(lambda v=value: Handle(intra_op_parallelism=v), exc, f"Handle {w}")
        _check(lambda v=value: defaults.set(max_inflight=v), exc, f"defaults.set {w}")
        _check(lambda v=value: ds.aio_handle(intra_op_parallelism=v), exc, f"aio_handle {w}")


async def test_sizes_take_fractions_of_a_unit(tmp_path):
    """'1.5G' is what people write for a budget or a tier: it is 1.5 x 2**30
    bytes wherever a size is taken; a fraction that is no whole number of
    bytes is refused, naming the value."""
    assert defaults.parse_size("1.5G") == 3 << 29
    assert defaults.parse_size("0.5K") == 512
    assert defaults.parse_size(" 2.25 MiB ") == 9 << 18
    with pytest.raises(InvalidSettingError, match=r"'0\.3K' is not a whole number of bytes"):
        defaults.parse_size("0.3K")
    for bad in ("1.", ".5M", "1e3", "1,5G"):
        with pytest.raises(InvalidSettingError, match="not a size"):
            defaults.parse_size(bad)
    with defaults.set(block_size="0.5M"):
        assert defaults.get("block_size") == 512 << 10
    async with nvme.TieredStore(str(tmp_path / "s"), host="1.5M") as s:
        assert s.stats()["host"]["capacity"] == 3 << 19
        v = np.arange(1 << 18, dtype=np.uint8)
        await s.put("k", v)
        assert np.array_equal(await s.get("k"), v)


def test_every_entry_point_refuses_the_same_queue_depths():
    for value, exc in BAD_QUEUE_DEPTH:
        w = f"queue_depth={value!r}"
        _check(lambda v=value: Handle(queue_depth=v), exc, f"Handle {w}")
        _check(lambda v=value: defaults.set(queue_depth=v), exc, f"defaults.set {w}")
        if value != 1 << 20:  # DeepNVMe has no upper bound per part
            _check(lambda v=value: ds.aio_handle(queue_depth=v), exc, f"aio_handle {w}")


def test_unknown_settings_and_engines():
    _check(lambda: defaults.set(nonsense=1), SettingTypeError, "unknown setting")
    _check(lambda: Handle(backend="io_uring"), InvalidSettingError, "backend")
    _check(lambda: defaults.set(engine="fast"), InvalidSettingError, "engine")
    _check(lambda: Handle.from_config({"aionvme": {"nonsense": 1}}), SettingTypeError, "config key")
    _check(lambda: Handle.from_config({}, nonsense=1), SettingTypeError, "override")


async def test_modes_are_checked_alike_and_b_means_binary(make_file, tmp_path):
    path, data = make_file(4096)
    for mode in ("rb", "br", "r+b", "rb+"):
        with nvme.open(path, mode) as f:
            out = np.zeros(4096, np.uint8)
            assert await f.pread(out) == 4096 and np.array_equal(out, data)
    with nvme.open(tmp_path / "new.bin", "wb") as f:
        assert await asyncio.to_thread(f.sync_pwrite, data) == 4096  # blocking: off the loop thread
    with Handle() as h:
        for bad in ("rt", "rbb", "ab", "a", "q", "", "r+t"):
            _check(lambda m=bad: nvme.open(path, m), InvalidSettingError, f"open mode {bad!r}")
            _check(lambda m=bad: nvme.File(path, m), InvalidSettingError, f"File mode {bad!r}")
            _check(lambda m=bad: h.open(path, m), InvalidSettingError, f"Handle.open mode {bad!r}")
        _check(lambda: nvme.open(path, 1), SettingTypeError, "mode of the wrong type")


def _import_with(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **env)
    return subprocess.run(
        [sys.executable, "-c", "import aionvme"], env=e, capture_output=True, text=True, timeout=120
    )


def test_a_bad_environment_value_names_the_variable():
    for var, value in (
        ("AIONVME_BLOCK_SIZE", "lots"),
        ("AIONVME_QUEUE_DEPTH", "0"),
        ("AIONVME_DIRECT", "maybe"),
        ("AIONVME_ENGINE", "io_uring"),
    ):
        r = _import_with({var: value})
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("aionvme.exceptions.InvalidSettingError") and var in last, r.stderr
    r = _import_with({"AIONVME_GPU_BLOCK_SIZE": "64M"})  # bigger than half the pinned pool
    assert r.returncode != 0 and "AIONVME_GPU_BLOCK_SIZE" in r.stderr.strip().splitlines()[-1]
    assert _import_with({"AIONVME_BLOCK_SIZE": "2M", "AIONVME_DIRECT": "off"}).returncode == 0


def test_from_config_leaves_the_process_defaults_alone(monkeypatch):
    # Handle.from_config used to apply threads/ring_reap as process-wide defaults
    # for a moment; now it builds the handle from its own Settings.
    def refuse(**kw: Any) -> Any:
        raise AssertionError(f"defaults.set({kw}) called")

    before = defaults.settings
    seen = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(defaults.settings)

    t = threading.Thread(target=watch)
    monkeypatch.setattr(defaults, "set", refuse)
    t.start()
    try:
        for _ in range(50):
            h = Handle.from_config({"aionvme": {"threads": 3, "ring_reap": False, "block_size": "2M"}})
            assert h.block_size == 2 << 20
            assert h._settings.threads == 3 and h._settings.ring_reap is False
            h.close()
    finally:
        stop.set()
        t.join()
    assert defaults.settings is before
    assert all(s is before for s in seen)


def test_public_aliases_keep_working():
    with Handle(intra_op_parallelism=4, backend="thread", block_size="64K") as h:
        assert h.config()["intra_op_parallelism"] == 4 and h.backend == "thread"
    assert defaults.Settings.coerce(intra_op_parallelism="3", backend="AIO") == {
        "max_inflight": 3,
        "engine": "aio",
    }
