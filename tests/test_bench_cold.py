"""The figures ``aionvme bench`` calls cold are measured cold, for any user:
the page cache holds none of the file a timed load reads when it starts
(checked with mincore, as the load begins), whether or not the page cache
could be dropped (root only)."""

from __future__ import annotations

import asyncio
import os

import pytest

from aionvme.bench import formats, system
from aionvme.bench.system import cached_bytes, evict

torch = pytest.importorskip("torch")


def _cached_file(path: str, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    with open(path, "rb") as f:
        f.read()


def test_evict_drops_a_files_pages_from_the_cache_without_dropping_the_cache(tmp_path):
    path = str(tmp_path / "f.bin")
    _cached_file(path, 4 << 20)  # written (dirty), then read: all cached
    assert cached_bytes(path) == 4 << 20
    evict(path)
    assert cached_bytes(path) == 0
    with open(path, "rb") as f:
        f.seek(1 << 20)
        f.read(4096)
    assert 4096 <= cached_bytes(path) < 4 << 20  # one read brings back its pages (and readahead) only


@pytest.fixture
def not_root(monkeypatch):
    """The page cache cannot be dropped, as for a user who is not root."""

    def refused() -> str:
        return "cannot drop the page cache (Permission denied)"

    monkeypatch.setattr(system, "drop_caches", refused)
    monkeypatch.setattr(formats, "drop_caches", refused)
    monkeypatch.setattr(formats, "_fio_floor", lambda path: {})  # not what this test is about
    small = {f"w{i}": torch.randn(256, 1024).to(torch.bfloat16) for i in range(8)}  # 4 MiB
    monkeypatch.setattr(formats, "transformer_state_dict", lambda total_bytes: small)


def _spy(monkeypatch, module, name: str, seen: list[tuple[str, int]]) -> None:
    """Record how much of the file each call of module.name finds cached as it starts."""
    real = getattr(module, name)

    def spied(path, *args, **kwargs):
        seen.append((os.path.basename(path), cached_bytes(os.fspath(path))))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, name, spied)


def test_safetensors_loads_start_cold_without_root(tmp_path, not_root, monkeypatch):
    st = pytest.importorskip("safetensors.torch")
    import aionvme.formats

    seen: list[tuple[str, int]] = []
    _spy(monkeypatch, st, "load_file", seen)
    _spy(monkeypatch, aionvme.formats, "load_safetensors", seen)
    r = asyncio.run(formats.safetensors(str(tmp_path), 4 << 20))
    assert r.verified
    # both timed loads read the baseline's file, just written and fsynced (so cached), from the device
    timed = seen[:2]
    assert [name for name, _ in timed] == ["ref.safetensors", "ref.safetensors"]
    assert [cached for _, cached in timed] == [0, 0]
    assert r.figures["cold_cache"] == 1.0 and r.figures["cached_bytes_before_load_safetensors"] == 0
    assert not any("NOT COLD" in n for n in r.notes)


def test_checkpoint_loads_start_cold_without_root(tmp_path, not_root, monkeypatch):
    import aionvme.formats

    seen: list[tuple[str, int]] = []
    _spy(monkeypatch, torch, "load", seen)
    _spy(monkeypatch, aionvme.formats, "load", seen)
    r = asyncio.run(formats.checkpoint(str(tmp_path), 4 << 20))
    assert r.verified
    assert [name for name, _ in seen] == ["ours.ckpt", "ref.pt"]
    assert [cached for _, cached in seen] == [0, 0]
    assert r.figures["cold_cache"] == 1.0
