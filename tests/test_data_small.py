"""Small samples: small fields are packed into shared pages, and
``ds[i]`` reads one sample from plain code (every async test runs on asyncio
and uvloop)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from aionvme.data import Dataset, Loader, sync_write_dataset


def _disk(path) -> int:
    return sum(os.path.getsize(path / n) for n in os.listdir(path) if n.startswith("shard-"))


def test_small_samples_are_packed(tmp_dir):
    """500 samples of 72 bytes (on main: 4096 bytes each on disk) take about
    their own size; they read back (crc verified) in order and shuffled."""
    samples = [
        {"x": np.full(18, i, np.float32), "id": np.int64(i), "e": np.zeros(0, np.uint8)} for i in range(500)
    ]
    sync_write_dataset(tmp_dir / "small", samples)
    disk = _disk(tmp_dir / "small")
    assert disk <= 4096 + 500 * 80 * 1.1 + 4096, disk
    with Dataset(tmp_dir / "small") as ds, Loader(ds, batch_size=64, shuffle=True, verify=True) as loader:
        seen = []
        for b in loader:
            ids = b["id"].tolist()
            assert torch.equal(b["x"], torch.tensor(ids, dtype=torch.float32)[:, None].expand(-1, 18))
            seen += ids
        assert sorted(seen) == list(range(500))
        assert int(ds[499]["id"]) == 499 and ds[7]["e"].shape == (0,)


def test_mixed_sizes_keep_big_fields_aligned(tmp_dir):
    rng = np.random.default_rng(0)
    samples = [
        {
            "big": rng.standard_normal(1024).astype(np.float32),
            "v": np.arange(i % 900, dtype=np.int32),
            "t": np.int8(i % 100),
        }
        for i in range(200)
    ]
    sync_write_dataset(tmp_dir / "mixed", samples, shard_size="64K")
    with Dataset(tmp_dir / "mixed") as ds:
        assert len(ds.layout.files) > 3
        f = ds.layout.fields["big"]
        assert (f.offset % 4096 == 0).all()
        for i in (0, 1, 150, 199):
            s = ds[i]
            assert np.array_equal(s["big"].numpy(), samples[i]["big"]) and int(s["t"]) == i % 100
            assert np.array_equal(s["v"].numpy(), samples[i]["v"])


def test_getitem_in_plain_code(tmp_dir):
    sync_write_dataset(tmp_dir / "ds", [{"x": np.full(8, i, np.int32), "id": np.int64(i)} for i in range(10)])
    with Dataset(tmp_dir / "ds") as ds:
        s = ds[3]
        assert int(s["id"]) == 3 and torch.equal(s["x"], torch.full((8,), 3, dtype=torch.int32))
        assert int(ds[-1]["id"]) == 9
        with pytest.raises(IndexError):
            ds[10]
        with pytest.raises(TypeError):
            ds["a"]  # type: ignore[index]


async def test_getitem_refuses_a_running_loop(tmp_dir):
    """As the formats' blocking twins do: it would stall every task of the loop."""
    sync_write_dataset(tmp_dir / "ds", [{"x": np.zeros(4, np.int32)} for _ in range(3)])
    with Dataset(tmp_dir / "ds") as ds:
        with pytest.raises(RuntimeError, match=r"await aionvme\.data\.Dataset\.get"):
            ds[0]
        assert (await ds.get(0))["x"].shape == (4,)
