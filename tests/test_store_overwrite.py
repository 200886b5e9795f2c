"""A swap-out of a key that is only on NVMe (``put(k, v, to="nvme")`` again)
overwrites the previous value's blocks in place in a scratch store: the slab
stays the size of the data, readers see the old or the new value and never a
mix, a cancelled put still leaves a whole value, a failed one removes the key."""

from __future__ import annotations

import asyncio
import errno
import os

import numpy as np
import pytest
import torch

import aionvme as nvme
from aionvme.store import StoreKeyError, TieredStore
from aionvme.store._nvme import span

MiB = 1 << 20


def pages(ext) -> list:
    """The (slab, first page) of each piece: what an overwrite keeps."""
    return [(i, span(off, n)[0]) for i, off, _, n in ext]


def full(size: int, fill: int) -> np.ndarray:
    """size bytes of fill, 64 bytes into a page every time (malloc'd arrays come
    at any phase, and a swap-out overwrites in place only where the old value's
    pages hold the new one at its phase)."""
    a = nvme.empty(size + 4096)[64 : 64 + size]
    a[:] = fill
    return a


def _slab_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".slab"))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
async def test_repeated_swap_outs_rewrite_the_same_blocks(tmp_path, kind):
    n, size = 6, 4 * MiB
    async with TieredStore(tmp_path, host=2 * size) as s:
        sizes = []
        for step in range(4):
            vals = {}
            for i in range(n):
                # memory 64 bytes into a page, as torch's allocator gives it (malloc'd
                # arrays come at any phase; a page-aligned one needs one page less)
                raw = nvme.empty(size + 4096)[64 : 64 + size]
                raw[:] = (step * 16 + i) % 251
                vals[i] = raw if kind == "numpy" else torch.from_numpy(raw)
            before = {i: pages(s._index[i].disk) for i in range(n)} if step else None
            await s.put_many(vals, to="nvme")
            if before is not None:  # the very same pages, written over (at the new memory's phase)
                assert all(pages(s._index[i].disk) == before[i] for i in range(n))
            sizes.append(_slab_bytes(tmp_path))
            got = await s.get_many(range(n))
            for i in range(n):
                g = got[i].numpy() if kind == "torch" else got[i]
                assert g.shape == (size,) and (g == (step * 16 + i) % 251).all()
            assert s.where(0) == ["nvme"]
        assert sizes[-1] == sizes[0], sizes  # it did not grow for the later steps


async def test_other_sizes_phases_and_persistent_stores_take_new_space(tmp_path):
    async with TieredStore(tmp_path / "a", host=8 * MiB) as s:
        await s.put("k", np.ones(2 * MiB, np.uint8), to="nvme")
        first = s._index["k"].disk
        await s.put("k", np.ones(3 * MiB, np.uint8), to="nvme")  # another size
        assert s._index["k"].disk != first
        second = s._index["k"].disk
        async with s.hold("k") as held:  # held: its bytes must not change, so new space
            await s.put("k", np.full(3 * MiB, 2, np.uint8), to="nvme")
            assert (held == 1).all()
        assert s._index["k"].disk != second
        assert (await s.get("k") == 2).all()
    async with TieredStore(tmp_path / "b", host=MiB, persist=True) as s:
        await s.put("k", np.ones(2 * MiB, np.uint8), to="nvme")
        first = s._index["k"].disk
        await s.put("k", np.full(2 * MiB, 3, np.uint8), to="nvme")
        assert s._index["k"].disk != first  # the old value stays whole until the new one is durable
        assert (await s.get("k") == 3).all()


async def test_readers_during_an_overwrite_see_one_whole_value(tmp_path):
    size = 32 * MiB
    old, new = np.full(size, 1, np.uint8), np.full(size, 2, np.uint8)
    async with TieredStore(tmp_path, host=2 * size + 4096) as s:
        for rnd in range(3):
            await s.put("k", old, to="nvme")
            put = asyncio.ensure_future(s.put("k", new, to="nvme"))
            await asyncio.sleep(0)  # the put has started overwriting
            readers = [s.get("k"), s.get_many(["k"]), s.get("k", out=np.empty(size, np.uint8))]
            got = await asyncio.gather(*readers)
            await put
            for v in (got[0], got[1][0], got[2]):
                assert (v == 2).all() or (v == 1).all(), f"round {rnd}: a torn value"
            async with s.hold("k") as h:
                assert (h == 2).all()


async def test_a_cancelled_overwrite_leaves_a_whole_value(tmp_path):
    size = 32 * MiB
    async with TieredStore(tmp_path, host=MiB) as s:
        await s.put("k", full(size, 1), to="nvme")
        put = asyncio.ensure_future(s.put("k", full(size, 2), to="nvme"))
        await asyncio.sleep(0)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        v = await s.get("k")
        assert (v == 2).all()  # the write was finished, then the cancellation raised


async def test_a_failed_overwrite_removes_the_key_and_frees_its_space(tmp_path, monkeypatch):
    size = 8 * MiB
    async with TieredStore(tmp_path, host=MiB) as s:
        await s.put("k", full(size, 1), to="nvme")
        await s.put("other", full(size, 5), to="nvme")
        free = s._nvme.free_bytes

        async def failing(jobs, stage=False):
            raise OSError(errno.EIO, "injected", str(tmp_path))

        monkeypatch.setattr(s._nvme, "write", failing)
        with pytest.raises(OSError) as ei:
            await s.put("k", full(size, 2), to="nvme")
        assert ei.value.errno == errno.EIO
        monkeypatch.undo()
        assert "k" not in s
        with pytest.raises(StoreKeyError):
            await s.get("k")
        assert s._nvme.free_bytes >= free + size  # its extents went back
        assert (await s.get("other") == 5).all()
        await s.put("k", full(size, 3), to="nvme")  # the store stays usable
        assert (await s.get("k") == 3).all()


@pytest.mark.parametrize("phased", [False, True])
async def test_a_storm_of_swap_outs_and_reads_on_few_keys(tmp_path, phased):
    """200 calls at once per round on three keys, every put a same-size
    swap-out (so most overwrite in place), against the property test's model:
    every read gives one of the values put, whole."""
    from test_store_property import HOST, KEYS, _check, _phase_min, _round

    rng = np.random.default_rng(11)
    size = 40_000  # the host tier (64 KiB) holds one
    hits = []
    with _phase_min(4096 if phased else None):
        async with TieredStore(tmp_path, host=HOST) as store:
            reusable = store._writes.reusable

            def counted(e, src):
                r = reusable(e, src)
                hits.append(r is not None)
                return r

            store._writes.reusable = counted  # type: ignore[method-assign]
            model: dict = {}
            for _ in range(4):
                rnd = []
                for _ in range(50):
                    op = ["put_nvme", "put_nvme", "get", "get_many", "hold", "evict", "prefetch", "delete"][
                        rng.integers(0, 8)
                    ]
                    k = KEYS[rng.integers(0, 3)]
                    spec = (int(rng.integers(0, 1000)), size, ["numpy", "torch"][rng.integers(0, 2)])
                    rnd.append((op, [k, KEYS[(KEYS.index(k) + 1) % 3]] if op == "get_many" else k, spec))
                await _round(store, model, rnd)
                await _check(store, model)
    assert sum(hits) >= 10, f"only {sum(hits)} of {len(hits)} swap-outs overwrote in place"


async def test_a_put_cancelled_before_its_write_leaves_the_old_value(tmp_path, monkeypatch):
    """The old pages are taken only once every other value of the batch has
    its space: a cancellation while the batch still allocates changes nothing."""
    size = 8 * MiB
    async with TieredStore(tmp_path, host=MiB) as s:
        await s.put("k", full(size, 1), to="nvme")
        gate = asyncio.Event()
        allocate = s._nvme.allocate

        async def slow_allocate(nbytes, phase=0):
            await gate.wait()
            return await allocate(nbytes, phase)

        monkeypatch.setattr(s._nvme, "allocate", slow_allocate)
        put = asyncio.ensure_future(
            s.put_many({"k": full(size, 2), "x": np.full(3 * MiB, 9, np.uint8)}, to="nvme")
        )
        for _ in range(5):
            await asyncio.sleep(0)
        reader = asyncio.ensure_future(s.get("k"))
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        monkeypatch.undo()
        assert (await reader == 1).all() and (await s.get("k") == 1).all()
        assert "x" not in s
