"""aionvme.integrations.vllm.AionvmeTier against vLLM's real tiering interface.

Built through vLLM's own SecondaryTierFactory (by module path, as an engine
loads it), over a page-aligned primary tier, and driven as vLLM's tests drive
its file tier (tests/v1/kv_offload/tiering/test_fs_tier.py): submit, drain,
poll, look up; and end to end under vLLM's TieringOffloadingManager.
Real store, real files, real kernel AIO.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "vllm.v1.kv_offload.tiering.factory",
    reason="needs vllm (pip install --no-deps vllm==0.33.0 and its interface's imports: README)",
)

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import (  # noqa: E402
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from aionvme.exceptions import InvalidOffsetError  # noqa: E402
from aionvme.integrations.vllm import AionvmeTier  # noqa: E402

pytestmark = pytest.mark.peers

NCHUNKS = 8
CHUNK = 64 * mmap.PAGESIZE  # 256 KiB a chunk
CTX = ReqContext(req_id="test")


def spec(events: bool = False, rank: int = 0, model: str = "test/model") -> MagicMock:
    """vLLM's test spec: a mock with a real OffloadingConfig."""
    s = MagicMock()
    s.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name=model, dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=2,
            tp_size=2,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    s.blocks_per_chunk = 1
    s.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=events, self_describing_kv_events=False
    )
    return s


def primary(n: int = NCHUNKS) -> torch.Tensor:
    """A page-aligned (n, CHUNK) uint8 tensor: vLLM's primary tier."""
    raw = torch.zeros(n * CHUNK + mmap.PAGESIZE, dtype=torch.uint8)
    shift = -raw.data_ptr() % mmap.PAGESIZE
    return raw[shift : shift + n * CHUNK].view(n, CHUNK)


def make_tier(
    root: Path, mem: torch.Tensor, capacity: int | str = "16M", s: Any = None, **kw: Any
) -> AionvmeTier:
    cfg = {"type": "AionvmeTier", "module_path": "aionvme.integrations.vllm", "root_dir": str(root)}
    cfg.update(capacity=capacity, **kw)
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(mem.numpy()), s or spec())
    assert isinstance(tier, AionvmeTier)
    return tier


def key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), group)


def job(job_id: int, keys: list[OffloadKey], chunk_ids: list[int], load: bool = False, ctx: ReqContext = CTX):
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=load,
        req_context=ctx,
    )


def drain(tier: AionvmeTier) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def fill(mem: torch.Tensor, rows: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for r in rows:
        mem[r] = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=g)


def slab_bytes(path: str) -> int:
    """Disk space the store's slab files hold (allocated blocks)."""
    return sum(
        os.stat(os.path.join(d, f)).st_blocks * 512
        for d, _, files in os.walk(path)
        for f in files
        if f.endswith(".slab")
    )


@pytest.fixture
def mem() -> torch.Tensor:
    return primary()


@pytest.fixture
def tier(tmp_path: Path, mem: torch.Tensor):
    t = make_tier(tmp_path, mem)
    yield t
    t.shutdown()


def test_the_factory_loads_it_by_module_path(tier: AionvmeTier) -> None:
    assert isinstance(tier, SecondaryTierManager)
    assert tier.medium is Medium.STORAGE
    assert tier.tier_type == "AionvmeTier"
    assert tier.block_size_bytes == CHUNK
    assert os.path.isdir(tier.path) and "test-model-r0-" in os.path.basename(tier.path)


def test_lookup_of_an_empty_tier_misses(tier: AionvmeTier) -> None:
    assert [tier.lookup(key(1), CTX), tier.lookup(key(2), CTX)] == [LookupResult.MISS] * 2


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_store_then_load_gives_back_the_bytes(tier: AionvmeTier, mem: torch.Tensor, n: int) -> None:
    fill(mem, list(range(NCHUNKS)), seed=n)
    keys = [key(i) for i in range(n)]
    expected = mem[:n].clone()
    tier.submit_store(job(1, keys, list(range(n))))
    (r,) = drain(tier)
    assert (r.job_id, r.success, r.transfer_bytes) == (1, True, n * CHUNK)
    assert [tier.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * n
    mem.zero_()
    # into other chunks than they came from, as vLLM's test does
    dest = list(range(NCHUNKS - n, NCHUNKS))
    tier.submit_load(job(2, keys, dest, load=True))
    (r,) = drain(tier)
    assert (r.job_id, r.success, r.successful_keys) == (2, True, None)
    for i, c in enumerate(dest):
        assert torch.equal(mem[c], expected[i])
    assert not tier.has_pending_work()


def test_a_missing_chunk_fails_only_itself(tier: AionvmeTier, mem: torch.Tensor) -> None:
    fill(mem, [0, 1], seed=1)
    expected = mem[:2].clone()
    tier.submit_store(job(1, [key(10), key(11)], [0, 1]))
    assert all(r.success for r in drain(tier))
    mem[2:5] = 7
    tier.submit_load(job(2, [key(10), key(99), key(11)], [2, 3, 4], load=True))
    (r,) = drain(tier)
    assert not r.success
    assert set(r.successful_keys) == {key(10), key(11)}
    assert torch.equal(mem[2], expected[0]) and torch.equal(mem[4], expected[1])
    assert bool((mem[3] == 7).all())  # the missing one's slot is untouched


def test_jobs_are_tracked_independently_and_present_chunks_are_not_rewritten(
    tier: AionvmeTier, mem: torch.Tensor
) -> None:
    fill(mem, [0, 1], seed=2)
    first = mem[0].clone()
    tier.submit_store(job(1, [key(1)], [0]))
    tier.submit_store(job(2, [key(2)], [1]))
    assert {r.job_id for r in drain(tier) if r.success} == {1, 2}
    mem[0] = 0  # a key names its content: a second store of it writes nothing
    tier.submit_store(job(3, [key(1)], [0]))
    (r,) = drain(tier)
    assert (r.success, r.transfer_bytes) == (True, 0)
    tier.submit_load(job(4, [key(1)], [5], load=True))
    assert drain(tier)[0].success
    assert torch.equal(mem[5], first)


def test_keys_of_other_kv_groups_are_other_chunks(tier: AionvmeTier, mem: torch.Tensor) -> None:
    fill(mem, [0], seed=3)
    tier.submit_store(job(1, [key(1, group=0)], [0]))
    drain(tier)
    assert tier.lookup(key(1, group=1), CTX) is LookupResult.MISS


def test_a_chunk_id_outside_the_primary_tier_is_refused(tier: AionvmeTier) -> None:
    with pytest.raises(InvalidOffsetError, match="chunk id 8"):
        tier.submit_store(job(1, [key(1)], [NCHUNKS]))
    with pytest.raises(ValueError, match="chunk id -1"):
        tier.submit_load(job(2, [key(1)], [-1], load=True))
    assert not tier.has_pending_work()


def test_disk_use_stays_within_capacity_and_drops_are_events(tmp_path: Path) -> None:
    mem = primary()
    cap = 4 * CHUNK
    tier = make_tier(
        tmp_path, mem, capacity=cap, s=spec(events=True), enable_kv_events=True, locality="LOCAL"
    )
    try:
        stored, removed = [], []
        for j in range(6):  # 12 chunks into a tier of 4
            fill(mem, [0, 1], seed=10 + j)
            tier.submit_store(job(j, [key(2 * j), key(2 * j + 1)], [0, 1]))
            assert all(r.success for r in drain(tier))
            assert slab_bytes(tier.path) <= cap
            for ev in tier.take_events():
                (removed if ev.removed else stored).extend(ev.keys)
                assert ev.medium is Medium.STORAGE and ev.locality.value == "LOCAL"
        present = [
            k for k in map(key, range(12)) if tier.lookup(k, ReqContext(req_id="probe")) is LookupResult.HIT
        ]
        assert 0 < len(present) <= 4
        assert key(11) in present  # the newest stays
        assert set(stored) == set(map(key, range(12)))
        assert set(removed) == set(map(key, range(12))) - set(present)
    finally:
        tier.shutdown()


def test_a_chunk_a_request_was_told_about_is_not_evicted_before_it_loads(tmp_path: Path) -> None:
    mem = primary()
    tier = make_tier(tmp_path, mem, capacity=4 * CHUNK)
    try:
        fill(mem, [0], seed=5)
        expected = mem[0].clone()
        tier.submit_store(job(1, [key(0)], [0]))
        drain(tier)
        reader = ReqContext(req_id="reader")
        assert tier.lookup(key(0), reader) is LookupResult.HIT  # pinned for "reader"
        for j in range(1, 9):  # 8 more chunks into a tier of 4
            fill(mem, [1], seed=j)
            tier.submit_store(job(10 + j, [key(j)], [1]))
            assert all(r.success for r in drain(tier))
        assert tier.lookup(key(0), ReqContext(req_id="other")) is LookupResult.HIT
        tier.on_request_finished(ReqContext(req_id="other"))
        tier.submit_load(job(30, [key(0)], [7], load=True, ctx=reader))
        assert drain(tier)[0].success
        assert torch.equal(mem[7], expected)
        # loaded: its pin went with the load, so the bound takes it now
        for j in range(20, 26):
            tier.submit_store(job(j, [key(j)], [1]))
            drain(tier)
        assert tier.lookup(key(0), ReqContext(req_id="late")) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_a_damaged_chunk_fails_its_load_and_leaves_the_tier(tier: AionvmeTier, mem: torch.Tensor) -> None:
    fill(mem, [0], seed=6)
    head = mem[0, :64].numpy().tobytes()
    tier.submit_store(job(1, [key(1)], [0]))
    drain(tier)
    slabs = [os.path.join(tier.path, f) for f in os.listdir(tier.path) if f.endswith(".slab")]
    hits = [(p, open(p, "rb").read().find(head)) for p in slabs]
    path, at = next((p, i) for p, i in hits if i >= 0)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes([head[0] ^ 0xFF]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    tier.submit_load(job(2, [key(1)], [3], load=True))
    (r,) = drain(tier)
    assert (r.success, r.successful_keys) == (False, None)
    assert tier.lookup(key(1), ReqContext(req_id="after")) is LookupResult.MISS


def test_ranks_and_models_get_their_own_directories(tmp_path: Path, mem: torch.Tensor) -> None:
    a = make_tier(tmp_path, mem, s=spec(rank=0))
    b = make_tier(tmp_path, primary(), s=spec(rank=1))
    try:
        assert a.path != b.path and "-r1-" in os.path.basename(b.path)
        fill(mem, [0], seed=7)
        a.submit_store(job(1, [key(1)], [0]))
        drain(a)
        assert b.lookup(key(1), CTX) is LookupResult.MISS
    finally:
        a.shutdown()
        b.shutdown()


def test_end_to_end_under_vllms_tiering_manager(tmp_path: Path) -> None:
    """Chunks cascade from the CPU primary tier into this one; once the
    primary tier has dropped them, a lookup promotes them back from NVMe."""
    n = 4
    mem = primary(n)
    region = MagicMock()
    region.create_kv_memoryview.return_value = memoryview(mem.numpy())
    cpu = CPUPrimaryTierOffloadingManager(num_chunks=n, mmap_region=region)
    tier = make_tier(tmp_path, mem)
    manager = TieringOffloadingManager(primary_tier=cpu, secondary_tiers=[tier])

    def step() -> None:
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    try:
        writer = ReqContext(req_id="writer")
        manager.on_new_request(writer)
        keys = [key(i) for i in range(8)]
        data = {}
        for i in range(0, 8, 2):  # 8 chunks through a primary tier of 4
            out = manager.prepare_store(keys[i : i + 2], writer)
            for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
                fill(mem, [int(c)], seed=100 + i)
                data[k] = mem[int(c)].clone()
            manager.complete_store(keys[i : i + 2], writer, success=True)
            tier.drain_jobs()
            step()
        manager.on_request_finished(writer)
        assert [cpu.lookup(k, writer) for k in keys[:2]] == [LookupResult.MISS] * 2

        reader = ReqContext(req_id="reader")
        manager.on_new_request(reader)
        assert [manager.lookup(k, reader) for k in keys[:2]] == [LookupResult.HIT_PENDING] * 2
        step()  # submits the promotion to this tier
        tier.drain_jobs()
        step()
        assert [manager.lookup(k, reader) for k in keys[:2]] == [LookupResult.HIT] * 2
        load = manager.prepare_load(keys[:2], reader)
        for k, c in zip(keys[:2], load.chunk_ids):
            assert torch.equal(mem[int(c)], data[k])
    finally:
        manager.shutdown()


def test_persist_keeps_the_chunks_across_a_restart(tmp_path: Path) -> None:
    """persist=True: block-hash keys (bytes) and their bytes come back in the next engine."""
    mem = primary()
    fill(mem, [0, 1], seed=8)
    expected = mem[:2].clone()
    first = make_tier(tmp_path, mem, persist=True)
    first.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert drain(first)[0].success
    first.shutdown()
    mem.zero_()
    again = make_tier(tmp_path, mem, persist=True)
    try:
        assert again.path == first.path
        assert [again.lookup(k, CTX) for k in (key(1), key(2), key(3))] == [
            LookupResult.HIT,
            LookupResult.HIT,
            LookupResult.MISS,
        ]
        again.submit_load(job(2, [key(2), key(1)], [6, 7], load=True))
        assert drain(again)[0].success
        assert torch.equal(mem[6], expected[1]) and torch.equal(mem[7], expected[0])
    finally:
        again.shutdown()


def test_touch_keeps_a_chunk_vllm_used_again_over_colder_ones(tmp_path: Path) -> None:
    mem = primary()
    tier = make_tier(tmp_path, mem, capacity=8 * CHUNK)
    try:
        for j in range(6):  # the tier holds 7 (less the filesystem's part)
            fill(mem, [0], seed=40 + j)
            tier.submit_store(job(j, [key(j)], [0]))
            assert all(r.success for r in drain(tier))
        tier.touch([key(0)], CTX)  # the oldest chunk, used again: now the warmest
        for j in range(6, 10):  # 4 more: the 3 coldest go
            fill(mem, [0], seed=40 + j)
            tier.submit_store(job(j, [key(j)], [0]))
            assert all(r.success for r in drain(tier))
        probe = ReqContext(req_id="probe")
        assert tier.lookup(key(0), probe) is LookupResult.HIT
        assert tier.lookup(key(1), probe) is LookupResult.MISS
        tier.on_request_finished(probe)
    finally:
        tier.shutdown()
