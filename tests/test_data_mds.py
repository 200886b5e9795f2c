"""MosaicML streaming MDS datasets written by the real ``streaming.MDSWriter``,
read by aionvme.data's own MDS parser through the same Loader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from _mds_stub import import_streaming
from aionvme.data import CorruptDatasetError, Dataset, Loader, UnsupportedDatasetError


@pytest.fixture(scope="module")
def streaming():
    return import_streaming()


def mixed_samples(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        out.append(
            {
                "x": rng.standard_normal((4, 4)).astype(np.float32),  # ndarray:float32:4,4 (static)
                "v": rng.integers(0, 9, size=int(rng.integers(1, 50)), dtype=np.int16),  # ndarray:int16
                "dyn": rng.standard_normal((2, int(rng.integers(1, 6)))).astype(np.float64),  # ndarray
                "b": bytes(rng.integers(0, 256, size=int(rng.integers(0, 40)), dtype=np.uint8)),
                "s": f"sample {i} " + "é" * (i % 5),
                "i": i * 1000 - 7,
                "f": float(i) / 7,
                "j": {"k": i, "l": [i, str(i)]},
            }
        )
    return out


MIXED = {
    "x": "ndarray:float32:4,4",
    "v": "ndarray:int16",
    "dyn": "ndarray",
    "b": "bytes",
    "s": "str",
    "i": "int",
    "f": "float64",
    "j": "json",
}


def write_mds(streaming, out, columns, samples, size_limit=1 << 12):
    with streaming.MDSWriter(out=str(out), columns=columns, size_limit=size_limit) as w:
        for s in samples:
            w.write(s)


def check_mixed(batch, samples):
    ids = [(i + 7) // 1000 for i in batch["i"].tolist()]
    assert batch["x"].shape == (len(ids), 4, 4) and batch["x"].dtype == torch.float32
    for r, k in enumerate(ids):
        want = samples[k]
        assert torch.equal(batch["x"][r], torch.from_numpy(want["x"]))
        assert torch.equal(batch["v"][r], torch.from_numpy(want["v"]))
        assert torch.equal(batch["dyn"][r], torch.from_numpy(want["dyn"]))
        assert batch["b"][r] == want["b"]
        assert batch["s"][r] == want["s"]
        assert batch["f"][r].item() == want["f"]
        assert batch["j"][r] == want["j"]
    return ids


def test_mds_mixed_columns(streaming, tmp_dir):
    samples = mixed_samples(120)
    write_mds(streaming, tmp_dir / "mds", MIXED, samples)
    index = json.loads((tmp_dir / "mds" / "index.json").read_text())
    assert len(index["shards"]) > 2  # several shards
    ds = Dataset(tmp_dir / "mds")
    assert ds.format == "mds" and len(ds) == 120 and ds.keys == sorted(MIXED)  # MDSWriter sorts its columns
    got = ds.sync_get(33)
    assert got["s"] == samples[33]["s"] and torch.equal(got["v"], torch.from_numpy(samples[33]["v"]))
    with Loader(ds, batch_size=16, shuffle=True, seed=1, prefetch="1M") as loader:
        seen = []
        for batch in loader:
            seen += check_mixed(batch, samples)
    assert sorted(seen) == list(range(120))
    ds.close()


async def test_mds_async_and_against_streamings_reader(streaming, tmp_dir):
    """Our decoding agrees with streaming's own reader, sample by sample."""
    from streaming.base.format import reader_from_json

    samples = mixed_samples(40)
    write_mds(streaming, tmp_dir / "mds", MIXED, samples, size_limit=1 << 20)
    index = json.loads((tmp_dir / "mds" / "index.json").read_text())
    reader = reader_from_json(str(tmp_dir / "mds"), None, index["shards"][0])
    loader = Loader(tmp_dir / "mds", batch_size=8)
    k = 0
    async for batch in loader:
        for r in range(len(batch["s"])):
            theirs = reader.get_item(k)
            assert theirs["s"] == batch["s"][r] and theirs["b"] == batch["b"][r]
            np.testing.assert_array_equal(theirs["dyn"], batch["dyn"][r].numpy())
            np.testing.assert_array_equal(theirs["x"], batch["x"][r].numpy())
            assert theirs["i"] == batch["i"][r].item()
            k += 1
    assert k == 40
    await loader.aclose()


def test_mds_fixed_columns_are_read_in_place(streaming, tmp_dir):
    """All columns fixed-size: each column is read straight into the batch rows."""
    rng = np.random.default_rng(1)
    samples = [
        {"img": rng.standard_normal((16, 64)).astype(np.float32), "label": int(i), "w": np.uint8(i % 256)}
        for i in range(50)
    ]
    write_mds(
        streaming, tmp_dir / "mds", {"img": "ndarray:float32:16,64", "label": "int", "w": "uint8"}, samples
    )
    ds = Dataset(tmp_dir / "mds")
    assert ds.layout.decoded is None and ds.layout.fields["img"].shape == (16, 64)
    with Loader(ds, batch_size=7, shuffle=True, seed=2, prefetch="1M") as loader:
        n = 0
        for batch in loader:
            assert batch["img"].shape[1:] == (16, 64) and batch["img"].data_ptr() % 4096 == 0
            for r, lab in enumerate(batch["label"].tolist()):
                assert torch.equal(batch["img"][r], torch.from_numpy(samples[lab]["img"]))
                assert batch["w"][r].item() == lab % 256
                n += 1
    assert n == 50
    ds.close()


def test_mds_unsupported_columns(streaming, tmp_dir):
    write_mds(streaming, tmp_dir / "pkl", {"o": "pkl"}, [{"o": {"a": 1}}])
    with pytest.raises(UnsupportedDatasetError, match="pkl"):
        Dataset(tmp_dir / "pkl")


def test_mds_truncated_shard(streaming, tmp_dir):
    write_mds(streaming, tmp_dir / "mds", MIXED, mixed_samples(30))
    shard = tmp_dir / "mds" / "shard.00001.mds"
    os.truncate(shard, os.path.getsize(shard) - 3)
    with pytest.raises(CorruptDatasetError, match="truncated") as e:
        Dataset(tmp_dir / "mds")
    assert e.value.filename == str(shard)


def test_mds_damaged_sample_header(streaming, tmp_dir):
    """A sample whose column-size header is damaged raises naming the file and sample."""
    samples = mixed_samples(10)
    write_mds(streaming, tmp_dir / "mds", MIXED, samples, size_limit=1 << 20)
    shard = tmp_dir / "mds" / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    begin = int(np.frombuffer(bytes(data[4 + 4 * 4 : 4 + 4 * 5]), np.uint32)[0])  # sample 4
    data[begin : begin + 4] = (10**6).to_bytes(4, "little")  # first variable column: absurd size
    with open(shard, "r+b") as fh:  # same size, in place
        fh.write(bytes(data))
    ds = Dataset(tmp_dir / "mds")
    for i in range(4):
        ds.sync_get(i)
    with pytest.raises(CorruptDatasetError, match="does not decode") as e:
        ds.sync_get(4)
    assert e.value.sample == 4 and e.value.filename == str(shard)
    ds.close()
