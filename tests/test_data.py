"""aionvme.data: the dataset format, the writer, Dataset and Loader, on real
files (every async test runs on asyncio and uvloop)."""

from __future__ import annotations

import asyncio
import os
import struct
import zlib

import numpy as np
import pytest
import torch

import aionvme as nvme
from aionvme.data import (
    BudgetError,
    CorruptDatasetError,
    Dataset,
    DatasetChangedError,
    DatasetError,
    Loader,
    sync_write_dataset,
    write_dataset,
)


def make_samples(n: int, seed: int = 0) -> list[dict]:
    """Fixed-shape x (4096 bytes: page-aligned rows), a scalar id, a variable-length v,
    an odd-sized fixed field (12 bytes: the engine's unaligned path)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append(
            {
                "x": rng.standard_normal(1024).astype(np.float32),
                "id": np.int64(i),
                "v": rng.integers(-1000, 1000, size=int(rng.integers(1, 3000)), dtype=np.int16),
                "odd": rng.integers(0, 255, size=(3, 4), dtype=np.uint8),
            }
        )
    return out


@pytest.fixture(scope="module")
def _ds_template(tmp_path_factory):
    samples = make_samples(300)
    d = tmp_path_factory.mktemp("template") / "ds"
    sync_write_dataset(d, samples, shard_size="256K")
    return d, samples


@pytest.fixture
def ds_dir(tmp_dir, _ds_template):
    """A fresh copy of a 300-sample dataset (tests may damage it)."""
    import shutil

    template, samples = _ds_template
    shutil.copytree(template, tmp_dir / "ds")
    return tmp_dir / "ds", samples


def check_batch(batch: dict, samples: list[dict]) -> list[int]:
    ids = batch["id"].tolist()
    assert batch["x"].shape == (len(ids), 1024)
    assert batch["odd"].shape == (len(ids), 3, 4)
    for r, i in enumerate(ids):
        np.testing.assert_array_equal(batch["x"][r].numpy(), samples[i]["x"])
        np.testing.assert_array_equal(batch["odd"][r].numpy(), samples[i]["odd"])
        np.testing.assert_array_equal(batch["v"][r].numpy(), samples[i]["v"])
    return ids


# -- writing and opening -----------------------------------------------------------


async def test_write_and_get_roundtrip(tmp_dir):
    samples = make_samples(40)
    n = await write_dataset(tmp_dir / "ds", samples, shard_size="64K", meta={"name": "t"})
    assert n == 40
    names = sorted(os.listdir(tmp_dir / "ds"))
    assert names[0] == "index.aionvme" and len(names) > 3  # several shards
    ds = Dataset(tmp_dir / "ds")
    assert len(ds) == 40 and ds.keys == ["x", "id", "v", "odd"] and ds.meta == {"name": "t"}
    assert ds.nbytes == sum(a.nbytes for s in samples for a in map(np.asarray, s.values()))
    for i in (0, 17, 39, -1):
        got = await ds.get(i)
        want = samples[i]
        assert got["id"].shape == () and int(got["id"]) == (i % 40)
        for k in ("x", "v", "odd"):
            np.testing.assert_array_equal(got[k].numpy(), want[k])
    with pytest.raises(IndexError):
        await ds.get(40)
    ds.close()


def test_shard_fields_are_page_aligned(ds_dir):
    """Fields over 2048 bytes start a page; smaller ones share pages, never across one."""
    ds = Dataset(ds_dir[0])
    for f in ds.layout.fields.values():
        big = f.nbytes > 2048
        assert (f.offset[big] % 4096 == 0).all()
        assert (f.offset[~big] // 4096 == (f.offset[~big] + f.nbytes[~big] - 1) // 4096).all()
        assert (f.offset >= 4096).all()  # after the shard header
    assert (ds.layout.fields["id"].offset % 4096 != 0).any()  # packed
    for path in ds.layout.files:
        assert os.path.getsize(path) % 4096 == 0


def test_torch_dtypes_and_shapes_roundtrip(tmp_dir):
    g = torch.Generator().manual_seed(0)
    samples = [
        {
            "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "f8": torch.randn(7, generator=g).to(torch.float8_e4m3fn),
            "b": torch.rand(9, generator=g) > 0.5,
            "raw": bytes([i, i + 1, i + 2]),
            "i": i,
            "f": float(i) / 3,
        }
        for i in range(5)
    ]
    sync_write_dataset(tmp_dir / "t", samples)
    ds = Dataset(tmp_dir / "t")
    for i, s in enumerate(samples):
        got = ds.sync_get(i)
        assert got["bf16"].dtype == torch.bfloat16 and torch.equal(got["bf16"], s["bf16"])
        assert got["f8"].dtype == torch.float8_e4m3fn
        assert torch.equal(got["f8"].view(torch.uint8), s["f8"].view(torch.uint8))
        assert torch.equal(got["b"], s["b"])
        assert got["raw"].tolist() == list(s["raw"])
        assert int(got["i"]) == i and float(got["f"]) == pytest.approx(i / 3)
    with pytest.raises(DatasetError, match="tensors='torch'"):
        Loader(ds, tensors="numpy")
    ds.close()


def test_bad_samples_are_refused(tmp_dir):
    with pytest.raises(ValueError, match="sample 1 has keys"):
        sync_write_dataset(tmp_dir / "a", [{"x": np.zeros(3)}, {"y": np.zeros(3)}])
    with pytest.raises(ValueError, match="sample 1, field 'x'"):
        sync_write_dataset(tmp_dir / "b", [{"x": np.zeros(3)}, {"x": np.zeros((3, 1))}])
    with pytest.raises(TypeError, match="str values"):
        sync_write_dataset(tmp_dir / "c", [{"x": "text"}])
    with pytest.raises(TypeError, match="not a numeric array"):
        sync_write_dataset(tmp_dir / "d", [{"x": np.array(["a"], dtype=object)}])
    for d in "abcd":  # nothing that opens was left behind
        with pytest.raises(DatasetError):
            Dataset(tmp_dir / d)
        assert not [p for p in os.listdir(tmp_dir / d) if p.endswith(".tmp")]


async def test_interrupted_write_leaves_no_dataset(tmp_dir):
    good = make_samples(20)
    await write_dataset(tmp_dir / "ds", good, shard_size="64K")
    assert len(Dataset(tmp_dir / "ds")) == 20

    def failing():
        yield from make_samples(30, seed=1)
        raise RuntimeError("the producer crashed")

    with pytest.raises(RuntimeError, match="producer crashed"):
        await write_dataset(tmp_dir / "ds", failing(), shard_size="64K")
    with pytest.raises(DatasetError, match=r"did not finish|no dataset here"):
        Dataset(tmp_dir / "ds")
    assert not [p for p in os.listdir(tmp_dir / "ds") if p.endswith(".tmp")]


async def test_cancelled_write_leaves_no_dataset(tmp_dir):
    def slow():
        x = np.ones(1024, np.float32)
        for i in range(1_000_000):
            yield {"x": x, "id": i}

    task = asyncio.ensure_future(write_dataset(tmp_dir / "ds", slow(), shard_size="1M"))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(DatasetError):
        Dataset(tmp_dir / "ds")
    assert not [p for p in os.listdir(tmp_dir / "ds") if p.endswith(".tmp")]


def test_progress_bar(tmp_dir, capsys):
    pytest.importorskip("tqdm")
    sync_write_dataset(tmp_dir / "p", make_samples(5), progress=True)
    assert "5/5" in capsys.readouterr().err


# -- the loader ------------------------------------------------------------------


def test_sync_epoch_covers_every_sample_once(ds_dir):
    path, samples = ds_dir
    with Loader(Dataset(path), batch_size=32, shuffle=True, seed=3, prefetch="4M") as loader:
        assert len(loader) == 10
        seen = []
        for batch in loader:
            seen += check_batch(batch, samples)
        assert sorted(seen) == list(range(300))
        assert seen != list(range(300))  # shuffled
        assert loader.epoch == 1 and loader.state_dict()["position"] == 0
        st = loader.stats()
        assert st["samples"] == 300 and st["batches"] == 10
        assert st["bytes"] == Dataset(path).nbytes
        assert st["samples_per_s"] > 0 and st["consumer_wait_s"] >= 0 and st["io_wait_s"] >= 0
        assert st["slabs"] * st["slab_nbytes"] <= 4 << 20


async def test_async_epoch_matches_sync_order(ds_dir):
    path, samples = ds_dir
    a = Loader(path, batch_size=50, shuffle=True, seed=9, prefetch="8M")
    async_ids = []
    async for batch in a:
        async_ids += check_batch(batch, samples)
    await a.aclose()
    b = Loader(path, batch_size=50, shuffle=True, seed=9, prefetch="8M")
    sync_ids = await asyncio.to_thread(lambda: [i for bt in b for i in bt["id"].tolist()])
    b.close()
    assert async_ids == sync_ids
    assert async_ids == nvme.data.epoch_order(300, 9, 0, True).tolist()


def test_batch_memory_is_reused_and_rows_aligned(ds_dir):
    path, samples = ds_dir
    loader = Loader(path, batch_size=16, prefetch="2M", keep=1)
    ptrs = set()
    n = 0
    for batch in loader:
        assert batch["x"].data_ptr() % 4096 == 0 and batch["x"].is_contiguous()
        assert batch["x"].stride() == (1024, 1)  # one [B, 1024] block, each row read in place
        ptrs.add(batch["x"].data_ptr())
        n += 1
    loader.close()
    assert n == 19
    assert len(ptrs) <= loader.stats()["slabs"] < n  # a ring of batch buffers, not one per batch


def test_keep_semantics(ds_dir):
    path, samples = ds_dir
    loader = Loader(path, batch_size=20, prefetch="8M", keep=1)
    it = iter(loader)
    b0 = next(it)
    ids0 = b0["id"].clone()
    x0 = b0["x"].clone()
    next(it)  # b0 stays valid while the consumer works on b1
    assert torch.equal(b0["id"], ids0) and torch.equal(b0["x"], x0)
    it.close()
    loader.close()
    # copy=True: batches are the caller's, nothing is reused under them
    loader = Loader(path, batch_size=20, prefetch="1M", copy=True)
    kept = list(loader)
    loader.close()
    assert [i for b in kept for i in b["id"].tolist()] == list(range(300))
    for b in kept:
        check_batch(b, samples)


def test_drop_last_and_partial_batch(ds_dir):
    path, _ = ds_dir
    with Loader(path, batch_size=64, drop_last=True) as a:
        sizes = [len(b["id"]) for b in a]
    assert sizes == [64] * 4 and len(a) == 4
    with Loader(path, batch_size=64) as b:
        sizes = [len(b_["id"]) for b_ in b]
    assert sizes == [64] * 4 + [44] and len(b) == 5


def test_transform_runs_in_the_consumer(ds_dir):
    path, _ = ds_dir
    import threading

    where = set()

    def tf(batch):
        where.add(threading.get_ident())
        return {"id2": batch["id"] * 2}

    with Loader(path, batch_size=100, transform=tf) as loader:
        out = [b["id2"].tolist() for b in loader]
    assert out[0][:3] == [0, 2, 4]
    assert where == {threading.get_ident()}


def test_budget_refusals(ds_dir):
    path, _ = ds_dir
    ds = Dataset(path)
    with pytest.raises(BudgetError, match="sample") as e:
        Loader(ds, batch_size=1, prefetch=8192)
    assert e.value.sample is not None and isinstance(e.value, ValueError)
    with pytest.raises(BudgetError, match="needs 2"):
        Loader(ds, batch_size=300, prefetch="2M")
    with pytest.raises(ValueError):
        Loader(ds, batch_size=0)


def test_state_dict_resume_mid_epoch_in_a_new_loader(ds_dir):
    path, samples = ds_dir
    full = Loader(path, batch_size=25, shuffle=True, seed=5)
    want = [b["id"].tolist() for b in full]
    full.close()
    first = Loader(path, batch_size=25, shuffle=True, seed=5)
    got = []
    for k, b in enumerate(first):
        got.append(b["id"].tolist())
        if k == 4:
            state = first.state_dict()
            break
    first.close()
    assert state["position"] == 125 and state["epoch"] == 0
    again = Loader(path, batch_size=25, shuffle=True, seed=5)  # "after a restart"
    again.load_state_dict(state)
    again.set_epoch(0)  # torch-style call at the top of the epoch keeps the position
    got += [b["id"].tolist() for b in again]
    assert got == want
    assert again.epoch == 1
    # a different batch size resumes on the same samples
    other = Loader(path, batch_size=40, shuffle=True, seed=5)
    other.load_state_dict(state)
    rest = [i for b in other for i in b["id"].tolist()]
    assert rest == [i for b in want[5:] for i in b]
    other.close()
    with pytest.raises(ValueError, match="seed"):
        Loader(path, batch_size=25, seed=6, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        Loader(path, batch_size=25, seed=5, shuffle=True, rank=0, world_size=2).load_state_dict(state)
    again.close()


def test_break_and_continue_and_set_epoch(ds_dir):
    path, _ = ds_dir
    loader = Loader(path, batch_size=100, shuffle=True, seed=1)
    order0 = nvme.data.epoch_order(300, 1, 0, True).tolist()
    for b in loader:
        assert b["id"].tolist() == order0[:100]
        break
    assert [i for b in loader for i in b["id"].tolist()] == order0[100:]  # continues
    assert loader.epoch == 1
    loader.set_epoch(5)
    assert [i for b in loader for i in b["id"].tolist()] == nvme.data.epoch_order(300, 1, 5, True).tolist()
    loader.close()


def test_ranks_are_disjoint_and_equal(ds_dir):
    path, _ = ds_dir
    for drop_last in (False, True):
        parts = []
        for r in range(4):
            with Loader(
                path, batch_size=16, shuffle=True, seed=2, rank=r, world_size=4, drop_last=drop_last
            ) as ld:
                parts.append([i for b in ld for i in b["id"].tolist()])
        if drop_last:
            assert {len(p) for p in parts} == {75 - 75 % 16}
        else:
            assert {len(p) for p in parts} == {75}
            assert sorted(i for p in parts for i in p) == list(range(300))


def test_rank_from_torch_distributed(ds_dir, tmp_dir):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    store = dist.FileStore(str(tmp_dir / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ld = Loader(ds_dir[0], batch_size=8)
        assert (ld.rank, ld.world_size) == (0, 1)
        ld.close()
    finally:
        dist.destroy_process_group()


def test_torch_bridge(ds_dir):
    path, samples = ds_dir
    loader = Loader(path, batch_size=30, shuffle=True, seed=4)
    it = loader.as_torch()
    assert isinstance(it, torch.utils.data.IterableDataset)
    assert isinstance(it, nvme.data.TorchIterable)
    dl = torch.utils.data.DataLoader(it, batch_size=None, num_workers=0)
    ids = []
    for batch in dl:
        ids += check_batch(batch, samples)
    assert sorted(ids) == list(range(300)) and len(dl) == 10
    loader.close()


def test_numpy_tensors(ds_dir):
    path, samples = ds_dir
    with Loader(path, batch_size=64, tensors="numpy") as loader:
        b = next(iter(loader))
        assert isinstance(b["x"], np.ndarray) and isinstance(b["v"][0], np.ndarray)
        np.testing.assert_array_equal(b["x"][3], samples[3]["x"])


@pytest.mark.gpu
def test_cuda_device(ds_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path, samples = ds_dir
    with Loader(path, batch_size=32, device="cuda") as loader:
        for batch in loader:
            assert batch["x"].is_cuda
            ids = batch["id"].cpu().tolist()
            for r, i in enumerate(ids):
                np.testing.assert_array_equal(batch["x"][r].cpu().numpy(), samples[i]["x"])


# -- bad input ---------------------------------------------------------------------


def test_truncated_shard_is_refused_at_open(ds_dir):
    path, _ = ds_dir
    shard = path / "shard-00001.bin"
    os.truncate(shard, os.path.getsize(shard) - 4096)
    with pytest.raises(CorruptDatasetError, match="truncated") as e:
        Dataset(path)
    assert e.value.filename == str(shard)


def test_damaged_index_is_refused(ds_dir):
    path, _ = ds_dir
    idx = path / "index.aionvme"
    data = bytearray(idx.read_bytes())
    data[len(data) // 2] ^= 0x40
    idx.write_bytes(bytes(data))
    with pytest.raises(CorruptDatasetError, match="checksum") as e:
        Dataset(path)
    assert e.value.filename == str(idx)
    idx.write_bytes(bytes(data[:100]))
    with pytest.raises(CorruptDatasetError, match="truncated"):
        Dataset(path)


def test_shard_from_another_write_is_refused(tmp_dir):
    sync_write_dataset(tmp_dir / "a", make_samples(20), shard_size="64K")
    sync_write_dataset(tmp_dir / "b", make_samples(20), shard_size="64K")
    os.replace(tmp_dir / "b" / "shard-00000.bin", tmp_dir / "a" / "shard-00000.bin")
    with pytest.raises(CorruptDatasetError, match="does not match"):
        Dataset(tmp_dir / "a")


def _flip_sample(path, ds, sample: int, field: str = "x") -> str:
    f = ds.layout.fields[field]
    shard = ds.layout.files[int(f.file[sample])]
    off = int(f.offset[sample]) + 100
    with open(shard, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, ds.layout.stats[int(f.file[sample])].mtime_ns))  # bit rot: same mtime
    return shard


async def test_bit_flip_is_caught_by_verify(ds_dir):
    path, _ = ds_dir
    ds = Dataset(path)
    shard = _flip_sample(path, ds, 123)
    with pytest.raises(CorruptDatasetError, match="checksum") as e:
        await ds.get(123)
    assert e.value.filename == shard and e.value.sample == 123
    loader = Loader(ds, batch_size=50, verify=True)
    got = []
    with pytest.raises(CorruptDatasetError, match="checksum") as e:
        async for b in loader:
            got += b["id"].tolist()
    assert e.value.sample == 123 and 123 not in got  # no wrong data handed out
    await loader.aclose()
    ds.close()


async def test_file_truncated_under_a_running_loader(ds_dir):
    path, _ = ds_dir
    ds = Dataset(path)
    loader = Loader(ds, batch_size=20, prefetch="1M")
    it = aiter(loader)
    await anext(it)
    for shard in ds.layout.files:
        os.truncate(shard, 8192)
    with pytest.raises(DatasetChangedError, match="size changed") as e:
        async for _ in it:
            pass
    assert e.value.filename in ds.layout.files and isinstance(e.value, RuntimeError)
    await loader.aclose()
    ds.close()


def test_file_replaced_under_a_loader(ds_dir, tmp_dir):
    path, _ = ds_dir
    ds = Dataset(path)
    sync_write_dataset(tmp_dir / "other", make_samples(300, seed=7), shard_size="256K")
    for name in os.listdir(tmp_dir / "other"):
        if name.startswith("shard"):
            os.replace(tmp_dir / "other" / name, path / name)
    loader = Loader(ds, batch_size=20)
    with pytest.raises(DatasetChangedError, match="replaced"):
        list(loader)
    loader.close()
    ds.close()


def test_index_offsets_out_of_range_are_refused(ds_dir):
    """A well-formed index (good checksum) that points past a shard's end."""
    from aionvme.data._format import decode_index, encode_index

    path, _ = ds_dir
    idx = path / "index.aionvme"
    header, arrays = decode_index(idx.read_bytes(), str(idx))
    ia = header["fields"][0]["arrays"]["offset"]
    arrays = [a.copy() for a in arrays]
    arrays[ia][7] = 1 << 40
    header.pop("arrays")
    idx.write_bytes(encode_index(header, arrays))
    with pytest.raises(CorruptDatasetError, match="outside its shard") as e:
        Dataset(path)
    assert e.value.sample == 7


def test_index_format_has_a_trailing_crc(ds_dir):
    data = (ds_dir[0] / "index.aionvme").read_bytes()
    assert data[-8:] == b"AIONVEND"
    assert struct.unpack("<I", data[-12:-8])[0] == zlib.crc32(data[:-12])


# -- other datasets through the same Loader -------------------------------------------


def test_npy_directory(tmp_dir):
    rng = np.random.default_rng(0)
    d = tmp_dir / "npy"
    d.mkdir()
    arrays = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(37)]
    for i, a in enumerate(arrays):
        np.save(d / f"{i:04d}.npy", a)
    ds = Dataset(d)
    assert ds.format == "npy" and len(ds) == 37 and ds.keys == ["data"]
    with Loader(ds, batch_size=8, shuffle=True, seed=0, prefetch="1M") as loader:
        seen = 0
        order = nvme.data.epoch_order(37, 0, 0, True).tolist()
        for b in loader:
            assert b["data"].shape[1:] == (8, 16)
            for r in range(len(b["data"])):
                np.testing.assert_array_equal(b["data"][r].numpy(), arrays[order[seen]])
                seen += 1
    assert seen == 37
    # variable shapes: a list per batch
    np.save(d / "9999.npy", np.arange(5, dtype=np.float32).reshape(5, 1, 1))
    with pytest.raises(DatasetError, match="dimensions"):
        Dataset(d)
    np.save(d / "9999.npy", np.ones((3, 16), dtype=np.float32))
    ds = Dataset(d)
    got = ds.sync_get(37)
    np.testing.assert_array_equal(got["data"].numpy(), np.ones((3, 16), dtype=np.float32))
    ds.close()


def test_npy_truncated_is_refused(tmp_dir):
    d = tmp_dir / "npy"
    d.mkdir()
    np.save(d / "a.npy", np.zeros(1000))
    os.truncate(d / "a.npy", 500)
    with pytest.raises(CorruptDatasetError, match="truncated") as e:
        Dataset(d)
    assert e.value.filename == str(d / "a.npy")


def test_safetensors_directory(tmp_dir):
    from safetensors.torch import save_file

    d = tmp_dir / "st"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(12):
        s = {
            "img": torch.randn(3, 8, 8, generator=g),
            "tok": torch.randint(0, 100, (i + 1,), generator=g),
            "w": torch.randn(4, generator=g).to(torch.bfloat16),
        }
        save_file(s, str(d / f"s{i:03d}.safetensors"))
        samples.append(s)
    ds = Dataset(d)
    assert ds.format == "safetensors" and sorted(ds.keys) == ["img", "tok", "w"]
    with Loader(ds, batch_size=5, prefetch="1M") as loader:
        i = 0
        for b in loader:
            assert b["img"].shape[1:] == (3, 8, 8) and isinstance(b["tok"], list)
            for r in range(len(b["img"])):
                assert torch.equal(b["img"][r], samples[i]["img"])
                assert torch.equal(b["tok"][r], samples[i]["tok"])
                assert torch.equal(b["w"][r], samples[i]["w"])
                i += 1
    assert i == 12
    ds.close()


def test_not_a_dataset(tmp_dir):
    with pytest.raises(FileNotFoundError):
        Dataset(tmp_dir / "nope")
    (tmp_dir / "empty").mkdir()
    with pytest.raises(DatasetError, match="no dataset here"):
        Dataset(tmp_dir / "empty")
    with pytest.raises(ValueError):
        Dataset(tmp_dir / "empty", format="zip")


def test_import_aionvme_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, aionvme; import aionvme.data; print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip() == "False", r.stderr


def test_file_modified_between_epochs(ds_dir):
    path, _ = ds_dir
    loader = Loader(path, batch_size=100)
    assert len(list(loader)) == 3
    shard = path / "shard-00000.bin"
    os.utime(shard, ns=(0, 10**18))  # touched: a pass must not trust it any more
    with pytest.raises(DatasetChangedError, match="modified") as e:
        list(loader)
    assert e.value.filename == str(shard)
    loader.close()


def test_pin_memory_without_cuda_is_refused_at_once(ds_dir):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(nvme.DeviceError):
        Loader(ds_dir[0], batch_size=8, pin_memory=True)
    with pytest.raises(nvme.DeviceError):
        Loader(ds_dir[0], batch_size=8, device="cuda")


def test_pad_batch_transform(ds_dir):
    path, samples = ds_dir
    with Loader(path, batch_size=10, transform=nvme.data.pad_batch) as loader:
        b = next(iter(loader))
    lens = [len(samples[i]["v"]) for i in b["id"].tolist()]
    assert b["v"].shape == (10, max(lens)) and b["v_mask"].sum(1).tolist() == lens
    for r, i in enumerate(b["id"].tolist()):
        np.testing.assert_array_equal(b["v"][r, : lens[r]].numpy(), samples[i]["v"])
        assert (b["v"][r, lens[r] :] == 0).all()
    assert b["x"].shape == (10, 1024)  # fixed fields untouched


async def test_many_abandoned_passes_never_leak_batch_memory(ds_dir):
    """Break out of `async for` again and again (reads in flight, the producer
    waiting for memory): every batch buffer comes back, nothing deadlocks."""
    path, samples = ds_dir
    loader = Loader(path, batch_size=10, prefetch=2 * 10 * 4096 * 3 + 8192 * 10, keep=1)
    assert loader.stats()["prefetch"] // loader.slab_nbytes == 2  # the smallest pool keep=1 allows
    got = []
    for _ in range(12):
        async for b in loader:
            got += b["id"].tolist()
            break
    rest = []
    async with asyncio.timeout(60):
        async for b in loader:
            rest += check_batch(b, samples)
    assert got + rest == list(range(300))
    assert loader.stats()["slabs"] == 2
    await loader.aclose()


async def test_shard_removed_mid_pass(ds_dir):
    """A shard removed after the pass began: the batch that needs it raises, after
    the reads it already sent to other shards have finished (the autouse check
    then finds no request left in flight)."""
    path, _ = ds_dir
    ds = Dataset(path)
    assert len(ds.layout.files) > 3
    loader = Loader(ds, batch_size=40, prefetch="1M")  # in order: a batch spans two shards at times
    it = aiter(loader)
    await anext(it)
    os.unlink(ds.layout.files[-1])
    with pytest.raises(DatasetChangedError, match="removed") as e:
        async for _ in it:
            pass
    assert e.value.filename == ds.layout.files[-1]
    await loader.aclose()


async def test_a_consumer_cancelled_at_the_end_of_an_epoch_is_told_the_epoch_ended(ds_dir):
    """Cancelled at any await point of the call that meets the epoch's end (the pass closing
    included), the consumer is still told the epoch ended: the same iterator stops, and so does
    a new pass, which finds nothing left of it; the next epoch starts once, after that."""
    path, _ = ds_dir
    seen_cancelled = 0
    for k in range(12):
        loader = Loader(path, batch_size=100, shuffle=False, prefetch="8M")
        it = aiter(loader)
        for _ in range(3):
            await anext(it)
        t = asyncio.ensure_future(anext(it))
        for _ in range(k):
            await asyncio.sleep(0)
        t.cancel()
        try:
            await t
        except StopAsyncIteration:
            pass
        except asyncio.CancelledError:
            seen_cancelled += 1
            with pytest.raises(StopAsyncIteration):
                await anext(aiter(loader) if k % 2 else it)
        assert loader.epoch == 1 and loader.state_dict()["position"] == 0, k
        assert len([b async for b in loader]) == 3  # epoch 1, whole, once
        assert loader.epoch == 2
        await loader.aclose()
    assert seen_cancelled > 0


async def test_cancelled_consumer_resumes_exactly(ds_dir):
    """A consumer cancelled at any point while it waits for a batch (reads in
    flight, the batch being assembled) loses nothing: the batch it did not get
    comes next, in order, whether it asks the same iterator or a new one."""
    path, samples = ds_dir
    loader = Loader(path, batch_size=25, shuffle=True, seed=11, prefetch="2M")
    want = nvme.data.epoch_order(300, 11, 0, True).tolist()
    got: list[int] = []
    cancelled = 0
    it = aiter(loader)
    for step in range(200):
        t = asyncio.ensure_future(anext(it))
        if step % 2 == 0:
            for _ in range(step % 7):  # cancel at different await points inside the loader
                await asyncio.sleep(0)
            t.cancel()
        try:
            b = await t
        except asyncio.CancelledError:
            cancelled += 1
            if step % 3 == 0:
                it = aiter(loader)  # a new pass continues where the last one stopped
            continue
        except StopAsyncIteration:
            break
        got += check_batch(b, samples)
        assert loader.state_dict()["position"] == len(got) or loader.epoch == 1
    assert got == want and cancelled > 5
    await loader.aclose()


def test_stats_see_a_slow_consumer(ds_dir):
    """A consumer slower than the disk: the loader's reads sit idle, and stats() says so."""
    import time

    path, _ = ds_dir
    with Loader(path, batch_size=30, prefetch="1M") as loader:
        for _ in loader:
            time.sleep(0.05)
        st = loader.stats()
    assert st["batches"] == 10 and st["elapsed_s"] >= 0.5
    assert 0.1 < st["io_wait_s"] <= st["memory_wait_s"] <= st["elapsed_s"]


@pytest.mark.skipif(not hasattr(asyncio, "TaskGroup"), reason="asyncio.TaskGroup needs Python 3.11")
async def test_taskgroup_failure_keeps_the_buffer_promise(ds_dir):
    """A sibling task fails: the consuming task is cancelled in the middle of
    an epoch; after aclose() no read is in flight (the autouse check) and the
    next pass starts exactly after the last batch the consumer got."""
    path, samples = ds_dir
    loader = Loader(path, batch_size=20, shuffle=True, seed=4, prefetch="2M")
    got: list[int] = []

    async def consume():
        async for b in loader:
            got.extend(check_batch(b, samples))
            await asyncio.sleep(0)

    async def fail():
        while len(got) < 60:
            await asyncio.sleep(0)
        raise RuntimeError("sibling failed")

    with pytest.raises(Exception, match="unhandled errors in a TaskGroup"):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(consume())
            tg.create_task(fail())
    await loader.aclose()
    assert loader.state_dict()["position"] == len(got)
    rest = []
    async for b in loader:
        rest += b["id"].tolist()
    assert got + rest == nvme.data.epoch_order(300, 4, 0, True).tolist()
    await loader.aclose()


async def test_batch_memory_is_made_off_the_loop_and_reads_are_capped(ds_dir, monkeypatch):
    """Batch memory is made (and its pages touched) on a worker thread, never on
    the event loop's thread; at most ``read_ahead`` batches are read at once
    (enough to fill the engine's bytes in flight), however large the budget."""
    import threading

    import aionvme.data._batch as batch_mod
    import aionvme.data._memory as loader_mod

    path, samples = ds_dir
    makers: list[int] = []
    real_empty = loader_mod.empty

    def recording_empty(*a, **k):
        makers.append(threading.get_ident())
        return real_empty(*a, **k)

    active = peak = 0
    real_read = batch_mod.BatchPlan.read

    async def counting_read(self, *a, **k):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            return await real_read(self, *a, **k)
        finally:
            active -= 1

    monkeypatch.setattr(loader_mod, "empty", recording_empty)
    monkeypatch.setattr(batch_mod.BatchPlan, "read", counting_read)
    with nvme.defaults.set(inflight_bytes=1):  # one batch in flight fills it: two read at once
        loader = Loader(path, batch_size=5, prefetch="64M")
    st = loader.stats()
    assert st["read_ahead"] == 2 and st["prefetch"] // st["slab_nbytes"] >= 60  # the budget holds every batch
    seen = []
    async for b in loader:
        seen += check_batch(b, samples)
    assert sorted(seen) == list(range(300))
    assert len(makers) == loader.stats()["slabs"] > 0
    await loader.aclose()
    assert threading.get_ident() not in makers
    assert peak == 2


async def test_cancelled_while_batch_memory_is_made(ds_dir, monkeypatch):
    """The pass is closed while a worker still makes a batch buffer: the buffer
    joins the pool when it is done, none is lost, the next pass reads them all."""
    import time

    import aionvme.data._memory as loader_mod

    path, samples = ds_dir
    real_empty = loader_mod.empty

    def slow_empty(*a, **k):
        time.sleep(0.05)
        return real_empty(*a, **k)

    monkeypatch.setattr(loader_mod, "empty", slow_empty)
    loader = Loader(path, batch_size=10, prefetch=2 * 10 * 4096 * 3 + 8192 * 10, keep=1)
    assert loader.stats()["prefetch"] // loader.slab_nbytes == 2
    got: list[int] = []
    for _ in range(4):
        it = aiter(loader)
        t = asyncio.ensure_future(anext(it))
        await asyncio.sleep(0.01)  # the first slab is being made
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await it.aclose()
    async with asyncio.timeout(60):
        async for b in loader:
            got += check_batch(b, samples)
    assert got == list(range(300))
    assert loader.stats()["slabs"] <= 2
    await loader.aclose()
