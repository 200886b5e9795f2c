"""TieredStore: values written from memory that is not page-aligned (a torch
tensor sits 64 bytes past a page, a large numpy array 16) are placed on NVMe
at the same phase in their first page, so their whole pages move with no
copy. Real slab files on ext4 under tmp_path; the engine's counters say
whether a transfer went through bounce buffers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import aionvme as nvme
from aionvme.store import SyncTieredStore, TieredStore
from aionvme.store._nvme import PHASE_MIN

KiB = 1 << 10
MiB = 1 << 20
PAGE = 4096


@pytest.fixture(autouse=True)
def _zero_copy():  # type: ignore[no-untyped-def]
    # These tests count bounce buffers to see the zero-copy path itself; with
    # write_copy='auto' a write from memory the kernel placed scattered would
    # (rightly) go through the engine's buffers instead (tests/test_write_copy.py).
    with nvme.defaults.set(write_copy="never"):
        yield


def at_phase(nbytes: int, phase: int, seed: int) -> np.ndarray:
    """nbytes of random bytes whose first byte is ``phase`` bytes past a page."""
    raw = nvme.empty(nbytes + 2 * PAGE)
    a = raw[phase : phase + nbytes]
    a[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return a


def bounces(f) -> int:  # type: ignore[no-untyped-def]
    before = nvme.stats()["bounce_buffers"]
    f()
    return int(nvme.stats()["bounce_buffers"] - before)


def slab_bytes(d, off: int, n: int) -> bytes:  # type: ignore[no-untyped-def]
    (name,) = [p for p in os.listdir(d) if p.endswith(".slab")]
    with open(os.path.join(d, name), "rb") as f:
        f.seek(off)
        return f.read(n)


@pytest.mark.parametrize("nbytes", [PHASE_MIN, 3 * MiB + 5, 4 * MiB])
@pytest.mark.parametrize("phase", [16, 64, 4032])
async def test_put_to_nvme_from_unaligned_memory_is_placed_at_its_phase(tmp_path, nbytes, phase):
    src = at_phase(nbytes, phase, seed=nbytes + phase)
    # neighbours in the same pages as the value's ends: they must not reach the file
    src.base[:phase] = 0xAB
    src.base[phase + nbytes : phase + nbytes + PAGE] = 0xCD
    async with TieredStore(tmp_path, host="1M") as s:
        before = nvme.stats()["bounce_buffers"]
        await s.put("v", src, to="nvme")
        assert nvme.stats()["bounce_buffers"] == before, "the write bounced"
        ((slab, off, boff, n),) = s._index["v"].disk
        assert (slab, off % PAGE, boff, n) == (0, phase, 0, nbytes)
        # the partial first and last pages were written zero-filled around the value
        base = off - phase
        assert slab_bytes(tmp_path, base, phase) == bytes(phase)
        end = off + nbytes
        tail = -end % PAGE
        assert slab_bytes(tmp_path, end, tail) == bytes(tail)
        # read back: a fresh result (at the same phase: only the end blocks bounce),
        # into out= at the same phase, at another phase, and page-aligned
        before = nvme.stats()["bounce_buffers"]
        got = await s.get("v")  # read whole pages into a result at the same phase: no bounce
        assert nvme.stats()["bounce_buffers"] == before, "the read bounced"
        assert np.array_equal(got, src) and got.ctypes.data % PAGE == phase
        for out_phase in (phase, 0, 512 if phase != 512 else 1024):
            out = at_phase(nbytes, out_phase, seed=1)
            await s.get("v", out=out)
            assert np.array_equal(out, src), out_phase


async def test_same_phase_reads_bounce_only_the_end_blocks(tmp_path):
    n = 8 * MiB + 100
    # where torch's CPU allocator puts a large tensor (64 bytes past a page when
    # it comes from its own mmap'd block)
    t = torch.from_numpy(at_phase(n, 64, seed=5)).view(torch.float32)
    async with TieredStore(tmp_path, host=0) as s:
        w0 = nvme.stats()["bounce_buffers"]
        await s.put("t", t, to="nvme")
        assert nvme.stats()["bounce_buffers"] == w0
        out = torch.from_numpy(at_phase(n, 64, seed=6)).view(torch.float32)
        r0 = nvme.stats()["bounce_buffers"]
        await s.get("t", out=out)
        assert nvme.stats()["bounce_buffers"] - r0 <= 2  # the head and the tail block
        u8 = t.view(torch.uint8)  # random bytes: NaNs among them, compared as bytes
        assert torch.equal(out.view(torch.uint8), u8)
        got = await s.get("t")
        assert torch.equal(got.view(torch.uint8), u8) and got.data_ptr() % PAGE == 64


async def test_small_values_and_odd_phases_stay_page_aligned(tmp_path):
    async with TieredStore(tmp_path, host=0) as s:
        small = at_phase(PHASE_MIN - 16, 64, seed=3)
        odd = at_phase(PHASE_MIN, 8, seed=4)  # not a multiple of 16: no dtype-safe phase
        await s.put_many({"small": small, "odd": odd}, to="nvme")
        for k, v in (("small", small), ("odd", odd)):
            ((_, off, _, _),) = s._index[k].disk
            assert off % PAGE == 0
            assert np.array_equal(await s.get(k), v)


async def test_phased_values_promote_evict_compact_and_free_their_whole_span(tmp_path):
    n = MiB + 48
    vals = {i: at_phase(n, 64 * (i + 1), seed=i) for i in range(6)}
    async with TieredStore(tmp_path, host=3 * MiB) as s:
        await s.put_many(vals, to="nvme")
        cap = s.stats()["nvme"]["used"]
        assert cap == sum(-(-(n + 64 * (i + 1)) // PAGE) * PAGE for i in range(6))
        # a get promotes into the host tier at the value's phase; evicting it back
        # writes from there with no copy; neither the reads nor the writes bounce
        before = nvme.stats()["bounce_buffers"]
        for i in range(6):
            got = await s.get(i)
            assert np.array_equal(got, vals[i])
        got = await s.get_many(range(6))
        assert all(np.array_equal(g, vals[i]) for i, g in enumerate(got))
        assert nvme.stats()["bounce_buffers"] == before
        host = s._host
        promoted = [e for e in s._index.values() if e.host is not None]
        assert promoted
        for e in promoted:
            assert e.host % PAGE == 64 * (e.key + 1)
        # holes, then a compaction: the moved values keep their phase and bytes
        for i in (0, 2, 4):
            await s.delete(i)
        moved = await s.compact()
        assert moved > 0
        for i in (1, 3, 5):
            ((_, off, _, _),) = s._index[i].disk
            assert off % PAGE == 64 * (i + 1)
            await s.evict(i, to="nvme")
            assert np.array_equal(await s.get(i), vals[i])
        for i in (1, 3, 5):
            await s.delete(i)
        st = s.stats()["nvme"]
        assert st["used"] == 0 and st["free_extents"] == 1  # every span came back whole
        assert host.used == 0


def test_persisted_phased_values_reopen(tmp_path):
    v = at_phase(2 * MiB + 7, 64, seed=9)
    t = torch.arange(300_000, dtype=torch.float64)
    with SyncTieredStore(tmp_path, host=0, persist=True) as s:
        s.put("v", v, to="nvme")
        s.put("t", t, to="nvme")
    with SyncTieredStore(tmp_path, host=0, persist=True) as s:
        assert np.array_equal(s.get("v"), v)
        assert torch.equal(s.get("t"), t)
        s.put("w", at_phase(PHASE_MIN * 2, 128, seed=10), to="nvme")  # allocates around the reserved spans
        assert np.array_equal(s.get("v"), v)


async def test_a_fixed_size_tier_packs_values_at_page_boundaries(tmp_path):
    # a tier sized for its values holds them: no page of slack per value
    n = PHASE_MIN
    vals = {i: at_phase(n, 64, seed=20 + i) for i in range(4)}
    async with TieredStore(tmp_path, host=0, nvme=4 * n) as s:
        await s.put_many(vals, to="nvme")
        for i, v in vals.items():
            ((_, off, _, _),) = s._index[i].disk
            assert off % PAGE == 0
            assert np.array_equal(await s.get(i), v)
