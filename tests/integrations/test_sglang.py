"""aionvme.integrations.sglang.AionvmeHiCache against SGLang's real storage interface.

Created through SGLang's own StorageBackendFactory as a ``dynamic`` backend
(module path and class name in the extra config, as the server loads it),
and driven as SGLang's tests drive HiCacheFile (set/get/exists,
batch_exists) and as its cache controller drives a zero-copy backend
(batch_set_v1/batch_get_v1 with host-pool indices, ``interface_v1``).

SGLang's host pools (sglang.srt.mem_cache.pool_host) cannot be imported on a
CPU-only torch: their package imports SGLang's model configs, which import
torchvision, whose PyPI wheel needs CUDA. The pools here are written from
MHATokenToKVPoolHost and MLATokenToKVPoolHost (pool_host/mha.py, SGLang
0.5.23): the same buffer shapes per layout and the same get_data_page /
set_from_flat_data_page / get_dummy_flat_data_page.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "sglang.srt.mem_cache.storage.backend_factory",
    reason="needs sglang (pip install --no-deps sglang==0.5.23 and its interface's imports: README)",
)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from aionvme.integrations.sglang import AionvmeHiCache  # noqa: E402

pytestmark = pytest.mark.peers

PAGE = 16  # tokens a page
LAYERS, HEADS, DIM = 4, 2, 128  # bf16: 32 KiB per MHA page, 16 KiB per MLA page


class MHAPool:
    """SGLang's MHA host pool: kv_buffer (2, tokens, L, H, D) page-first, (2, L, tokens, H, D) layer-first."""

    def __init__(self, size: int, layout: str = "page_first") -> None:
        self.page_size, self.layout, self.dtype = PAGE, layout, torch.bfloat16
        dims = (2, size, LAYERS, HEADS, DIM) if layout == "page_first" else (2, LAYERS, size, HEADS, DIM)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def _page(self, i: int) -> Any:
        if self.layout == "page_first":
            return self.kv_buffer[:, i : i + PAGE]
        return self.kv_buffer[:, :, i : i + PAGE]

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        p = self._page(index)
        return p.flatten() if flat else p

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros((2, LAYERS, PAGE, HEADS, DIM), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        p = self._page(index)
        p.copy_(data_page.reshape(p.shape))


class MLAPool(MHAPool):
    """SGLang's MLA host pool, page-first: kv_buffer (tokens, L, 1, D): a page is contiguous."""

    def __init__(self, size: int) -> None:
        self.page_size, self.layout, self.dtype = PAGE, "page_first", torch.bfloat16
        self.kv_buffer = torch.zeros((size, LAYERS, 1, DIM), dtype=self.dtype)

    def _page(self, i: int) -> Any:
        return self.kv_buffer[i : i + PAGE]

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros((PAGE, LAYERS, 1, DIM), dtype=self.dtype).flatten()


def config(root: Path, tp_rank: int = 0, metrics: bool = False, **extra: Any) -> HiCacheStorageConfig:
    ext = {
        "backend_name": "aionvme",
        "module_path": "aionvme.integrations.sglang",
        "class_name": "AionvmeHiCache",
        "interface_v1": 1,
        "file_storage_path": str(root),
        "max_size": "16M",
    }
    ext.update(extra)
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=metrics,
        is_page_first_layout=True,
        model_name="test/model",
        extra_config=ext,
    )


def backend(root: Path, pool: Any = None, **kw: Any) -> AionvmeHiCache:
    b = StorageBackendFactory.create_backend("dynamic", config(root, **kw), pool)
    assert isinstance(b, AionvmeHiCache)
    if pool is not None:
        b.register_mem_pool_host(pool)  # as the cache controller does after creating it
    return b


def randomize(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.dtype))


def pages(*starts: int) -> Any:
    """host_indices of whole pages starting at these token slots."""
    return torch.cat([torch.arange(s, s + PAGE) for s in starts])


def slab_bytes(path: str) -> int:
    return sum(
        os.stat(os.path.join(path, f)).st_blocks * 512 for f in os.listdir(path) if f.endswith(".slab")
    )


@pytest.fixture(autouse=True)
def _no_env_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)


def test_sglangs_factory_loads_it_as_a_dynamic_backend(tmp_path: Path) -> None:
    b = backend(tmp_path)
    try:
        assert isinstance(b, HiCacheStorage)
        assert b.path == str(tmp_path / "test-model_0_2")
    finally:
        b.close()
    cfg = config(tmp_path)
    del cfg.extra_config["max_size"]
    with pytest.raises(ValueError, match="max_size"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_set_get_exists_as_sglangs_file_backend_test(tmp_path: Path) -> None:
    b = backend(tmp_path)
    try:
        v1, v2 = torch.arange(4, dtype=torch.float32), torch.arange(8, dtype=torch.float32) * 3
        assert b.set("k1", v1) is True and b.set("k2", v2) is True
        assert b.exists("k1") and b.exists("k2") and not b.exists("k3")
        out = torch.zeros(4)
        assert b.get("k1", out) is out and torch.equal(out, v1)
        assert b.get("missing", torch.zeros(4)) is None
        got = b.batch_get(["k2", "nope"], [torch.zeros(8), torch.zeros(8)])
        assert torch.equal(got[0], v2) and got[1] is None
        assert b.batch_set(["k4", "k5"], [v1, v1]) is True
        assert b.batch_exists(["k1", "k2", "k4", "k3", "k5"]) == 3
        assert b.batch_exists(["k3", "k1"]) == 0
        assert b.clear() is True and not b.exists("k1")
    finally:
        b.close()


@pytest.mark.parametrize(
    "make_pool",
    [lambda: MHAPool(128), lambda: MHAPool(128, "layer_first"), lambda: MLAPool(128)],
    ids=["mha-page-first", "mha-layer-first", "mla-page-first"],
)
def test_batch_v1_moves_pages_between_host_pool_and_nvme(tmp_path: Path, make_pool: Any) -> None:
    pool = make_pool()
    b = backend(tmp_path, pool)
    try:
        randomize(pool, 1)
        before = pool.kv_buffer.clone()
        keys = ["p0", "p1", "p2", "p3"]
        assert b.batch_set_v1(keys, pages(0, 16, 32, 48)) == [True] * 4
        assert b.batch_exists([*keys, "p4"]) == 4
        pool.kv_buffer.fill_(3)
        # pages into other slots, out of order, one missing (its slot untouched)
        got = b.batch_get_v1(["p2", "p0", "p9", "p3"], pages(112, 64, 80, 96))
        assert got == [True, True, False, True]
        for src, dst in ((32, 112), (0, 64), (48, 96)):
            assert torch.equal(pool.get_data_page(dst, flat=False), before_page(pool, before, src))
        assert bool((pool.get_data_page(80) == 3).all())
    finally:
        b.close()


def before_page(pool: Any, buf: Any, start: int) -> Any:
    saved, pool.kv_buffer = pool.kv_buffer, buf
    try:
        return pool.get_data_page(start, flat=False).clone()
    finally:
        pool.kv_buffer = saved


def test_batch_set_v1_skips_pages_already_stored(tmp_path: Path) -> None:
    pool = MHAPool(64)
    b = backend(tmp_path, pool)
    try:
        randomize(pool, 2)
        first = pool.get_data_page(0).clone()
        assert b.batch_set_v1(["a"], pages(0)) == [True]
        pool.kv_buffer.zero_()  # a page hash names its content: nothing rewritten
        assert b.batch_set_v1(["a", "b"], pages(0, 16)) == [True, True]
        assert b.batch_get_v1(["a"], pages(32)) == [True]
        assert torch.equal(pool.get_data_page(32), first)
    finally:
        b.close()


def test_disk_use_stays_within_max_size(tmp_path: Path) -> None:
    pool = MHAPool(64)
    page_bytes = pool.get_data_page(0).numel() * 2
    b = backend(tmp_path, pool, max_size=4 * page_bytes)
    try:
        for j in range(6):  # 12 pages into room for 4
            randomize(pool, 10 + j)
            assert b.batch_set_v1([f"k{2 * j}", f"k{2 * j + 1}"], pages(0, 16)) == [True, True]
            assert slab_bytes(b.path) <= 4 * page_bytes
        keys = [f"k{i}" for i in range(12)]
        present = [k for k in keys if b.exists(k)]
        assert 0 < len(present) <= 4 and "k11" in present
        assert b.batch_exists(keys) == 0  # the oldest went first
        want = pool.get_data_page(16).clone()
        assert b.batch_get_v1(["k11"], pages(48)) == [True]
        assert torch.equal(pool.get_data_page(48), want)
        # SGLang hears of no drops: the store keeps no list of them (it would grow for the run's length)
        assert b.store.drain_evicted() == [] and b.store.evicted_lost == 12 - len(present)
    finally:
        b.close()


def test_a_damaged_page_reads_as_a_miss_and_leaves_the_store(tmp_path: Path) -> None:
    pool = MLAPool(64)
    b = backend(tmp_path, pool)
    try:
        randomize(pool, 3)
        raw = pool.get_data_page(0).view(torch.uint8)[:64].numpy().tobytes()
        assert b.batch_set_v1(["x"], pages(0)) == [True]
        path = next(os.path.join(b.path, f) for f in os.listdir(b.path) if f.endswith(".slab"))
        at = open(path, "rb").read().find(raw)
        assert at >= 0
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes([raw[0] ^ 0xFF]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
        assert b.batch_get_v1(["x"], pages(16)) == [False]
        assert not b.exists("x")
    finally:
        b.close()


def test_ranks_have_their_own_stores(tmp_path: Path) -> None:
    a, c = backend(tmp_path, tp_rank=0), backend(tmp_path, tp_rank=1)
    try:
        assert a.path != c.path
        assert a.set("k", torch.ones(4))
        assert not c.exists("k")
    finally:
        a.close()
        c.close()


def test_stats_report_pages_and_bandwidth_per_batch_and_reset(tmp_path: Path) -> None:
    pool = MHAPool(64)
    b = backend(tmp_path, pool, metrics=True)
    try:
        randomize(pool, 4)
        b.batch_set_v1(["a", "b"], pages(0, 16))
        b.batch_get_v1(["a", "b", "zz"], pages(32, 48, 0))
        s = b.get_stats()
        assert (s.backup_pgs, s.prefetch_pgs) == ([2], [2])
        assert s.backup_bandwidth[0] > 0 and s.prefetch_bandwidth[0] > 0
        s = b.get_stats()
        assert (s.backup_pgs, s.prefetch_pgs, s.prefetch_bandwidth) == ([], [], [])
    finally:
        b.close()


def test_sglangs_threads_may_call_at_once(tmp_path: Path) -> None:
    """SGLang's prefetch and backup threads share the backend."""
    pool = MLAPool(8 * 4 * PAGE)
    b = backend(tmp_path, pool)
    randomize(pool, 5)
    want = pool.kv_buffer.clone()
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            base = t * 4 * PAGE
            keys = [f"t{t}p{i}" for i in range(2)]
            for _ in range(5):
                assert b.batch_set_v1(keys, pages(base, base + PAGE)) == [True, True]
                assert b.batch_get_v1(keys, pages(base + 2 * PAGE, base + 3 * PAGE)) == [True, True]
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        for t in range(8):
            base = t * 4 * PAGE
            assert torch.equal(
                pool.kv_buffer[base + 2 * PAGE : base + 4 * PAGE], want[base : base + 2 * PAGE]
            )
    finally:
        b.close()


def test_max_size_is_read_in_sglangs_units(tmp_path: Path) -> None:
    """As HiCacheFile reads it: "8M" is 8e6 bytes, "8Mi" 8 MiB; nonsense is refused."""
    from aionvme.exceptions import InvalidSettingError

    for given, want in (("8M", 8_000_000), ("8Mi", 8 << 20), (1 << 24, 1 << 24)):
        b = backend(tmp_path, max_size=given)
        try:
            assert want * 0.98 <= b.store.stats()["nvme"]["capacity"] <= want
        finally:
            b.close()
    for bad in ("lots", "-5", 0):
        with pytest.raises(InvalidSettingError, match="max_size"):
            backend(tmp_path, max_size=bad)


def test_persist_keeps_the_pages_across_a_restart(tmp_path: Path) -> None:
    pool = MLAPool(64)
    randomize(pool, 6)
    want = pool.get_data_page(0).clone()
    first = backend(tmp_path, pool, persist=True)
    assert first.batch_set_v1(["h0"], pages(0)) == [True]
    first.close()
    pool.kv_buffer.zero_()
    again = backend(tmp_path, pool, persist=True)
    try:
        assert again.batch_exists(["h0", "h1"]) == 1
        assert again.batch_get_v1(["h0"], pages(32)) == [True]
        assert torch.equal(pool.get_data_page(32), want)
    finally:
        again.close()


def test_staged_pages_go_in_groups_of_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MHA pages (two parts) are staged at most STAGING_KEPT bytes at a time:
    here two pages a group, five pages, one of them missing."""
    import aionvme.integrations.sglang as mod

    pool = MHAPool(256)
    monkeypatch.setattr(mod, "STAGING_KEPT", 2 * pool.get_data_page(0).numel() * 2)
    b = backend(tmp_path, pool)
    try:
        randomize(pool, 7)
        before = pool.kv_buffer.clone()
        keys = [f"g{i}" for i in range(5)]
        assert b.batch_set_v1(keys, pages(0, 16, 32, 48, 64)) == [True] * 5
        pool.kv_buffer.fill_(1)
        got = b.batch_get_v1(["g4", "g3", "nope", "g1", "g0"], pages(128, 144, 160, 176, 192))
        assert got == [True, True, False, True, True]
        for src, dst in ((64, 128), (48, 144), (16, 176), (0, 192)):
            assert torch.equal(pool.get_data_page(dst, flat=False), before_page(pool, before, src))
        assert bool((pool.get_data_page(160) == 1).all())
        assert b._stage.buf.numel() == 2 * pool.get_data_page(0).numel()
    finally:
        b.close()


def test_v2_batches_move_the_pools_of_hybrid_models(tmp_path: Path) -> None:
    """batch_*_v2 as SGLang's hybrid cache controller calls them: the KV pool
    and an extra pool (a Mamba state, kept for the last page only)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv, mamba = MHAPool(128), MLAPool(128)
    b = backend(tmp_path, kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    try:
        randomize(kv, 8)
        randomize(mamba, 9)
        kv_before, mamba_before = kv.kv_buffer.clone(), mamba.kv_buffer.clone()
        trailing = PoolHitPolicy.TRAILING_PAGES
        out = b.batch_set_v2(
            [
                PoolTransfer(name=PoolName.KV, host_indices=pages(0, 16, 32), keys=["a", "b", "c"]),
                PoolTransfer(name=PoolName.MAMBA, host_indices=pages(32), keys=["c"], hit_policy=trailing),
            ]
        )
        assert out == {PoolName.KV: [True] * 3, PoolName.MAMBA: [True]}
        r = b.batch_exists_v2(
            ["a", "b", "c", "d"], [PoolTransfer(name=PoolName.MAMBA, keys=["c"], hit_policy=trailing)]
        )
        assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == (
            3,
            {PoolName.KV: 3, PoolName.MAMBA: 3},
            [3],
        )
        r = b.batch_exists_v2(["a", "b", "c"], [PoolTransfer(name=PoolName.MAMBA, keys=["c"])])  # all pages
        assert r.kv_hit_pages == 0
        kv.kv_buffer.zero_()
        mamba.kv_buffer.zero_()
        got = b.batch_get_v2(
            [
                PoolTransfer(name=PoolName.KV, host_indices=pages(64, 80, 96), keys=["c", "zz", "a"]),
                PoolTransfer(name=PoolName.MAMBA, host_indices=pages(112), keys=["c"], hit_policy=trailing),
            ]
        )
        assert got == {PoolName.KV: [True, False, True], PoolName.MAMBA: [True]}
        assert torch.equal(kv.get_data_page(64, flat=False), before_page(kv, kv_before, 32))
        assert torch.equal(kv.get_data_page(96, flat=False), before_page(kv, kv_before, 0))
        assert torch.equal(mamba.get_data_page(112, flat=False), before_page(mamba, mamba_before, 32))
        # host indices that do not cover the pages: that pool's transfer fails whole
        bad = b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=pages(0), keys=["a", "b"])])
        assert bad == {PoolName.KV: [False, False]}
    finally:
        b.close()
