"""TieredStore.attach: read-only values whose NVMe tier is a region of an
existing file (a safetensors shard), read through the store's host tier."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402

from aionvme.store import AttachError, SyncTieredStore, TieredStore  # noqa: E402


def _shard(tmp_path):
    """A real safetensors file and (name, dtype, shape, offset) of each tensor in it."""
    import json
    import struct

    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(300, 17),  # not a multiple of the page size anywhere
        "b": torch.randn(1000).to(torch.bfloat16),
        "c": torch.arange(5000, dtype=torch.int64),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    spans = {
        k: (v["dtype"], v["shape"], 8 + n + v["data_offsets"][0]) for k, v in header.items() if k in tensors
    }
    names = {"F32": "float32", "BF16": "bfloat16", "I64": "int64"}
    return path, tensors, {k: (names[d], s, off) for k, (d, s, off) in spans.items()}


async def test_attached_values_read_through_the_host_tier_and_are_never_copied(tmp_path):
    path, tensors, spans = _shard(tmp_path)
    before = path.read_bytes()
    # a host tier that holds one of the values at a time: the others are evicted by dropping
    host = max(t.numel() * t.element_size() for t in tensors.values()) + 4096
    async with TieredStore(tmp_path / "slabs", host=host) as store:
        for k, (dtype, shape, off) in spans.items():
            await store.attach(k, path, off, shape, dtype)
        assert store.where("a") == ["nvme"]
        assert store.stats()["nvme"]["used"] == 0  # no slab space: the file is the NVMe tier
        for _ in range(2):
            for k, t in tensors.items():
                got = await store.get(k)
                assert got.dtype == t.dtype and torch.equal(got, t)
                async with store.hold(k) as v:
                    assert torch.equal(v, t)
        st = store.stats()
        assert st["host"]["evictions"] > 0
        assert st["host"]["used"] <= host
        assert st["nvme"]["bytes_in"] == 0  # nothing was ever written back
        got = await store.get_many(["c", "a"])
        assert torch.equal(got[0], tensors["c"]) and torch.equal(got[1], tensors["a"])
        await store.evict("b")
        assert store.where("b") == ["nvme"]
        # a put replaces the attached value and leaves the file alone
        await store.put("a", torch.zeros(3))
        assert torch.equal(await store.get("a"), torch.zeros(3))
        await store.delete("b")
    assert path.read_bytes() == before and os.path.exists(path)


async def test_attach_errors(tmp_path):
    path, _, spans = _shard(tmp_path)
    size = os.path.getsize(path)
    async with TieredStore(tmp_path / "s", host="1M") as store:
        with pytest.raises(AttachError, match="past the end"):
            await store.attach("x", path, size - 8, (4,), "float32")
        with pytest.raises(AttachError):
            await store.attach("x", path, -1, (4,), "float32")
        with pytest.raises(FileNotFoundError) as ei:
            await store.attach("x", tmp_path / "missing", 0, (4,))
        assert ei.value.filename and "missing" in str(ei.value.filename)
        assert "x" not in store
    async with TieredStore(tmp_path / "p", host="1M", persist=True) as store:
        with pytest.raises(AttachError, match="persist"):
            await store.attach("x", path, 0, (4,))


def test_sync_attach_numpy(tmp_path):
    data = np.arange(3000, dtype=np.float32)
    p = tmp_path / "raw.bin"
    p.write_bytes(data.tobytes())
    with SyncTieredStore(tmp_path / "s", host=0) as store:  # no host tier: straight from the file
        store.attach("tail", p, 4 * 1000, (2000,), "float32", like="numpy")
        got = store.get("tail")
        assert isinstance(got, np.ndarray) and np.array_equal(got, data[1000:])
