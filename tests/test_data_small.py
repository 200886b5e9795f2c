"""Small samples: the write says what the 4 KiB alignment costs on disk, and
``ds[i]`` reads one sample from plain code (every async test runs on asyncio
and uvloop)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from aionvme.data import Dataset, PaddingWarning, sync_write_dataset


def _disk(path) -> int:
    return sum(os.path.getsize(path / n) for n in os.listdir(path) if n.startswith("shard-"))


def test_small_samples_warn_with_the_overhead(tmp_dir):
    """500 samples of 72 bytes: each field takes a 4 KiB page; the write says
    so, with the figures (on main: silently 57x)."""
    samples = [{"x": np.full(18, i, np.float32)} for i in range(500)]
    with pytest.warns(
        PaddingWarning, match=r"500 samples of 36000 bytes take \d+ bytes on disk \(\d+x\)"
    ) as rec:
        sync_write_dataset(tmp_dir / "small", samples)
    disk = _disk(tmp_dir / "small")
    assert disk >= 500 * 4096 and f"take {disk} bytes" in str(rec[0].message)
    with warnings.catch_warnings():  # 4 KiB fields: no padding to speak of
        warnings.simplefilter("error", PaddingWarning)
        sync_write_dataset(tmp_dir / "pages", [{"x": np.zeros(1024, np.float32)} for _ in range(500)])


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
