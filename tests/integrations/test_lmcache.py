"""aionvme.integrations.lmcache against LMCache's real L2 adapter interface.

The adapter is driven the way LMCache drives its own file-system L2 adapter
(``FSL2Adapter``) in its tests and its controllers: real ``TensorMemoryObj``
buffers and ``ObjectKey`` keys, submit, poll the eventfd of the kind, collect
(``pop_completed_store_tasks`` / ``query_*_result``). It is created the way
LMCache's config creates an adapter (``--l2-adapter`` JSON of type ``plugin``,
by module path), and the last tests run it under LMCache's own
``StorageManager`` (L1 in host memory, its store and prefetch controllers).
Every store goes to real files on the local disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lmcache.v1.distributed.l2_adapters.base",
    reason="needs lmcache (pip install --no-deps lmcache==0.5.6 and the modules its L2 interface imports)",
)
torch = pytest.importorskip("torch")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.internal_api import L2AdapterListener  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from aionvme.integrations.lmcache import (  # noqa: E402
    AionvmeL2Adapter,
    AionvmeL2AdapterConfig,
    object_key_bytes,
)

pytestmark = pytest.mark.peers

CHUNK = 64 * 1024  # bytes per KV chunk in these tests
CAP = 16 * CHUNK  # the adapter's disk budget


def key(i: int, model: str = "org/model", salt: str = "", group: int = 0) -> Any:
    return ObjectKey(
        chunk_hash=i.to_bytes(32, "big"), model_name=model, kv_rank=0, object_group_id=group, cache_salt=salt
    )


def chunk(seed: int, nbytes: int = CHUNK) -> Any:
    """A MemoryObj as LMCache's allocator makes one: a flat buffer with a
    bfloat16 layout; its bytes are a pattern unique to ``seed``."""
    raw = torch.empty(nbytes // 2, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    raw.view(torch.int16).copy_(torch.randint(-32768, 32767, (nbytes // 2,), generator=g, dtype=torch.int16))
    meta = MemoryObjMetadata(
        shape=torch.Size([nbytes // 2]),
        dtype=torch.bfloat16,
        address=0,
        phy_size=nbytes,
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def empty(nbytes: int = CHUNK) -> Any:
    obj = chunk(0, nbytes)
    obj.tensor.zero_()
    return obj


def same(a: Any, b: Any) -> bool:
    return bytes(a.byte_array) == bytes(b.byte_array)


def wait_fd(fd: int, timeout: float = 10.0) -> None:
    """Poll an adapter's eventfd as LMCache's controllers do, then consume it."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(int(timeout * 1000)), "no completion signalled"
    with contextlib.suppress(BlockingIOError):  # another wakeup consumed it
        os.eventfd_read(fd)


def store(a: AionvmeL2Adapter, keys: list[Any], objs: list[Any]) -> Any:
    tid = a.submit_store_task(keys, objs)
    deadline = time.monotonic() + 10
    done: dict[int, Any] = {}
    while tid not in done:  # counts coalesce: one wakeup may cover several tasks
        wait_fd(a.get_store_event_fd(), max(0.0, deadline - time.monotonic()))
        done.update(a.pop_completed_store_tasks())
    return done[tid]


def lookup(a: AionvmeL2Adapter, keys: list[Any]) -> list[int]:
    tid = a.submit_lookup_and_lock_task(keys, {})
    wait_fd(a.get_lookup_and_lock_event_fd())
    bitmap = a.query_lookup_and_lock_result(tid)
    assert bitmap is not None
    assert a.query_lookup_and_lock_result(tid) is None  # a result is given once
    return list(bitmap.get_indices_list())


def load(a: AionvmeL2Adapter, keys: list[Any], objs: list[Any]) -> list[int]:
    tid = a.submit_load_task(keys, objs)
    deadline = time.monotonic() + 10
    while True:
        wait_fd(a.get_load_event_fd(), max(0.0, deadline - time.monotonic()))
        bitmap = a.query_load_result(tid)
        if bitmap is not None:
            assert a.query_load_result(tid) is None
            return list(bitmap.get_indices_list())


class Recorder(L2AdapterListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.stored: list[Any] = []
        self.deleted: list[Any] = []
        self.accessed: list[Any] = []
        self.order: list[tuple[str, Any]] = []

    def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
        self.stored += keys
        self.order += [("stored", k) for k in keys]

    def on_l2_keys_accessed(self, keys: list[Any]) -> None:
        self.accessed += keys

    def on_l2_keys_deleted(self, keys: list[Any]) -> None:
        self.deleted += keys
        self.order += [("deleted", k) for k in keys]

    def present(self) -> set[Any]:
        """The keys the events say are stored now."""
        live: set[Any] = set()
        for kind, k in self.order:
            (live.add if kind == "stored" else live.discard)(k)
        return live


@pytest.fixture
def adapter(tmp_path: Path) -> Iterator[AionvmeL2Adapter]:
    a = AionvmeL2Adapter(AionvmeL2AdapterConfig(str(tmp_path / "kv"), nvme=CAP))
    yield a
    a.close()


# -- the interface and how LMCache loads it ------------------------------------------------


def test_is_lmcaches_l2_adapter_with_three_distinct_eventfds(adapter: AionvmeL2Adapter) -> None:
    assert isinstance(adapter, L2AdapterInterface)
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3
    assert adapter.supports_global_eviction  # it declares its bound
    assert adapter.get_usage().total_capacity_bytes == CAP


def test_loaded_by_module_path_from_lmcaches_l2_adapter_option(tmp_path: Path) -> None:
    spec = {
        "type": "plugin",
        "module_path": "aionvme.integrations.lmcache",
        "class_name": "AionvmeL2Adapter",
        "adapter_params": {"path": str(tmp_path), "nvme": "1M", "checksum": True},
    }
    args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(["--l2-adapter", json.dumps(spec)])
    (config,) = parse_args_to_l2_adapters_config(args).adapters
    a = create_l2_adapter(config)
    try:
        assert type(a) is AionvmeL2Adapter
        assert a.config.nvme == 1 << 20 and a.config.path == str(tmp_path)
        assert store(a, [key(1)], [chunk(1)]).is_successful()
        assert any(p.name.endswith(".slab") for p in tmp_path.iterdir())  # the store's files, in path
    finally:
        a.close()


@pytest.mark.parametrize(
    "params, word",
    [
        ({"nvme": "1M"}, "path"),
        ({"path": "/tmp"}, "nvme"),
        ({"path": "/tmp", "nvme": "lots"}, "nvme"),
        ({"path": "/tmp", "nvme": 0}, "nvme"),
        ({"path": "/tmp", "nvme": "1M", "checksum": "yes"}, "checksum"),
        ({"path": "/tmp", "nvme": "1M", "capacity": "1M"}, "capacity"),
    ],
)
def test_bad_settings_are_a_value_error_naming_the_setting(params: dict[str, Any], word: str) -> None:
    spec = {"type": "plugin", "module_path": "aionvme.integrations.lmcache", "class_name": "AionvmeL2Adapter"}
    with pytest.raises(ValueError, match=word):
        create_l2_adapter(
            parse_args_to_l2_adapters_config(
                add_l2_adapters_args(argparse.ArgumentParser()).parse_args(
                    ["--l2-adapter", json.dumps({**spec, "adapter_params": params})]
                )
            ).adapters[0]
        )


def test_aionvme_never_imports_lmcache_and_without_it_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "import aionvme, aionvme.integrations\n"
        "assert 'lmcache' not in sys.modules, 'import aionvme loaded lmcache'\n"
        "sys.modules['lmcache'] = None  # as if not installed\n"
        "try:\n"
        "    import aionvme.integrations.lmcache\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install --no-deps lmcache" in out.stdout


def test_object_keys_map_to_distinct_store_keys() -> None:
    ks = [
        key(1),
        key(2),
        key(1, model="org/other"),
        key(1, salt="user7"),
        key(1, group=1),
        ObjectKey(chunk_hash=(1).to_bytes(32, "big"), model_name="org/model", kv_rank=3),
        ObjectKey(chunk_hash=b"@@", model_name="m", kv_rank=0),  # hashes holding the separator
        ObjectKey(chunk_hash=b"@", model_name="m", kv_rank=0, cache_salt="x"),
        ObjectKey(chunk_hash=b"x@", model_name="m", kv_rank=0),
    ]
    assert len({object_key_bytes(k) for k in ks}) == len(ks)
    assert object_key_bytes(key(5)) == object_key_bytes(key(5))


# -- store, lookup and lock, load ----------------------------------------------------------------


def test_store_lookup_load_round_trip_bytes(adapter: AionvmeL2Adapter) -> None:
    keys = [key(i) for i in range(6)]
    src = [chunk(i) for i in range(6)]
    result = store(adapter, keys[:4], src[:4])
    assert result.is_successful() and result.bytes_transferred() == 4 * CHUNK

    assert lookup(adapter, keys) == [0, 1, 2, 3]
    dst = [empty() for _ in keys]
    assert load(adapter, keys, dst) == [0, 1, 2, 3]
    assert all(same(d, s) for d, s in zip(dst[:4], src[:4]))
    assert not any(dst[i].tensor.view(torch.int16).any() for i in (4, 5))  # misses: untouched
    adapter.submit_unlock(keys[:4])


def test_store_of_a_stored_key_writes_nothing_and_counts_once(adapter: AionvmeL2Adapter) -> None:
    rec = Recorder()
    adapter.register_listener(rec)
    assert store(adapter, [key(1)], [chunk(1)]).bytes_transferred() == CHUNK
    again = store(adapter, [key(1), key(1)], [chunk(1), chunk(1)])
    assert again.is_successful() and again.bytes_transferred() == 0
    assert adapter.get_usage().total_bytes_used == CHUNK
    assert rec.stored == [key(1)]


def test_load_into_a_buffer_of_another_size_is_a_miss(adapter: AionvmeL2Adapter) -> None:
    store(adapter, [key(1), key(2)], [chunk(1), chunk(2)])
    small, right = empty(CHUNK // 2), empty()
    assert load(adapter, [key(1), key(2)], [small, right]) == [1]
    assert not small.tensor.view(torch.int16).any()
    assert same(right, chunk(2))


def test_listeners_hear_stores_loads_and_usage_follows(adapter: AionvmeL2Adapter) -> None:
    rec = Recorder()
    adapter.register_listener(rec)
    store(adapter, [key(1, salt="a"), key(2, salt="b")], [chunk(1), chunk(2)])
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 2 * CHUNK
    assert dict(usage.bytes_by_cache_salt) == {"a": CHUNK, "b": CHUNK}
    load(adapter, [key(1, salt="a"), key(3)], [empty(), empty()])
    assert rec.accessed == [key(1, salt="a")]


def test_delete_removes_chunks_but_not_locked_ones(adapter: AionvmeL2Adapter) -> None:
    rec = Recorder()
    adapter.register_listener(rec)
    store(adapter, [key(1), key(2)], [chunk(1), chunk(2)])
    assert lookup(adapter, [key(2)]) == [0]  # key 2 locked
    adapter.delete([key(1), key(2), key(9)])
    assert rec.deleted == [key(1)]
    assert adapter.get_usage().total_bytes_used == CHUNK
    assert lookup(adapter, [key(1)]) == []
    adapter.submit_unlock([key(2)])
    adapter.submit_unlock([key(2)])  # a second unlock, of a pin not held: ignored
    adapter.delete([key(2)])
    assert rec.deleted == [key(1), key(2)]
    assert adapter.get_usage().total_bytes_used == 0
    assert lookup(adapter, [key(2)]) == []


# -- a bounded tier: cache mode, pins --------------------------------------------------------


def test_writing_many_times_the_budget_stays_within_it(adapter: AionvmeL2Adapter, tmp_path: Path) -> None:
    rec = Recorder()
    adapter.register_listener(rec)
    n = 4 * CAP // CHUNK
    srcs = {i: chunk(i) for i in range(n)}
    for first in range(0, n, 5):  # store tasks of 5 chunks (the last may be shorter)
        ids = list(range(first, min(n, first + 5)))
        assert store(adapter, [key(i) for i in ids], [srcs[i] for i in ids]).is_successful()
        sts = [p.stat() for p in (tmp_path / "kv").iterdir()]
        assert sum(st.st_size for st in sts) <= CAP  # the store's space
        # allocated blocks: ext4 may add one extent-tree block once writes split
        # the preallocated extents (file-system metadata, not data)
        assert sum(st.st_blocks * 512 for st in sts) <= CAP + 4096
        assert adapter.get_usage().total_bytes_used <= CAP
    assert len(rec.deleted) >= n - CAP // CHUNK  # what was dropped, LMCache heard of
    live = rec.present()
    assert adapter.get_usage().total_bytes_used == CHUNK * len(live)
    keys = [key(i) for i in range(n)]
    hits = lookup(adapter, keys)
    assert {keys[i] for i in hits} == live  # the events and the tier agree
    dst = [empty() for _ in keys]
    loaded = load(adapter, keys, dst)
    assert loaded == hits
    assert all(same(dst[i], srcs[i]) for i in loaded)  # every hit is its bytes
    adapter.submit_unlock([keys[i] for i in hits])


def test_one_store_task_larger_than_the_budget_keeps_its_last_chunks(adapter: AionvmeL2Adapter) -> None:
    n = 2 * CAP // CHUNK
    keys, srcs = [key(i) for i in range(n)], [chunk(i) for i in range(n)]
    assert store(adapter, keys, srcs).is_successful()
    hits = lookup(adapter, keys)
    assert hits and hits[-1] == n - 1 and len(hits) <= CAP // CHUNK
    dst = [empty() for _ in keys]
    assert load(adapter, keys, dst) == hits
    assert all(same(dst[i], srcs[i]) for i in hits)


def test_a_chunk_larger_than_the_budget_fails_the_task(adapter: AionvmeL2Adapter) -> None:
    result = store(adapter, [key(1), key(2)], [chunk(1, 2 * CAP), chunk(2)])
    assert not result.is_successful()
    assert lookup(adapter, [key(1), key(2)]) == [1]  # the rest was stored


def test_locked_chunks_survive_eviction_until_unlocked(adapter: AionvmeL2Adapter) -> None:
    locked = [key(i) for i in range(4)]
    srcs = [chunk(i) for i in range(4)]
    store(adapter, locked, srcs)
    assert lookup(adapter, locked) == [0, 1, 2, 3]
    assert lookup(adapter, locked[:2]) == [0, 1]  # locked twice: refcounted
    for first in range(100, 100 + 3 * CAP // CHUNK, 4):
        store(adapter, [key(i) for i in range(first, first + 4)], [chunk(i) for i in range(first, first + 4)])
    dst = [empty() for _ in locked]
    assert load(adapter, locked, dst) == [0, 1, 2, 3]
    assert all(same(d, s) for d, s in zip(dst, srcs))
    adapter.submit_unlock(locked)  # keys 0 and 1 still hold one lock each
    for first in range(200, 200 + 3 * CAP // CHUNK, 4):
        store(adapter, [key(i) for i in range(first, first + 4)], [chunk(i) for i in range(first, first + 4)])
    assert lookup(adapter, locked) == [0, 1]
    adapter.submit_unlock(locked[:2])
    adapter.submit_unlock(locked[:2])
    for first in range(300, 300 + 3 * CAP // CHUNK, 4):
        store(adapter, [key(i) for i in range(first, first + 4)], [chunk(i) for i in range(first, first + 4)])
    assert lookup(adapter, locked) == []


# -- integrity ---------------------------------------------------------------------------------


def _flip_on_disk(directory: Path, obj: Any) -> None:
    """Flip one byte of ``obj``'s bytes where they lie in the store's slab file."""
    pattern = bytes(obj.byte_array)[:4096]
    for p in directory.iterdir():
        data = p.read_bytes()
        at = data.find(pattern)
        if at >= 0:
            with open(p, "r+b") as f:
                f.seek(at + 100)
                f.write(bytes([data[at + 100] ^ 0xFF]))
                f.flush()
                os.fsync(f.fileno())
            return
    raise AssertionError("the chunk's bytes are not in the slab files")


def test_a_chunk_that_fails_its_checksum_is_a_miss_and_is_dropped(
    adapter: AionvmeL2Adapter, tmp_path: Path
) -> None:
    rec = Recorder()
    adapter.register_listener(rec)
    keys, srcs = [key(i) for i in range(3)], [chunk(i) for i in range(3)]
    store(adapter, keys, srcs)
    _flip_on_disk(tmp_path / "kv", srcs[1])
    dst = [empty() for _ in keys]
    assert load(adapter, keys, dst) == [0, 2]  # the others of the batch still load
    assert same(dst[0], srcs[0]) and same(dst[2], srcs[2])
    assert rec.deleted == [keys[1]]
    assert lookup(adapter, keys) == [0, 2]
    assert adapter.get_usage().total_bytes_used == 2 * CHUNK


def test_load_tasks_in_flight_together_each_get_their_own_result(adapter: AionvmeL2Adapter) -> None:
    """LMCache keeps several load tasks in flight; the adapter reads those
    queued behind running ones as one batch: each still gets its own bitmap."""
    srcs = [chunk(i) for i in range(12)]
    store(adapter, [key(i) for i in range(12)], srcs)
    adapter.max_reads = 2  # 12 tasks, 2 reads at a time: the others wait and go together
    tasks = {}
    for t in range(12):  # task t: chunk t, a missing chunk, chunk (t + 5) % 12
        ids = [t, 1000 + t, (t + 5) % 12]
        dst = [empty() for _ in ids]
        tasks[adapter.submit_load_task([key(i) for i in ids], dst)] = (ids, dst)
    deadline = time.monotonic() + 20
    while tasks and time.monotonic() < deadline:
        wait_fd(adapter.get_load_event_fd())
        for tid in list(tasks):
            bm = adapter.query_load_result(tid)
            if bm is not None:
                ids, dst = tasks.pop(tid)
                assert list(bm.get_indices_list()) == [0, 2]
                assert same(dst[0], srcs[ids[0]]) and same(dst[2], srcs[ids[2]])
                assert not dst[1].tensor.view(torch.int16).any()
    assert not tasks


@pytest.mark.gpu
def test_loads_into_lmcache_buffers_in_gpu_memory(adapter: AionvmeL2Adapter) -> None:
    """LMCache's L1 can live in GPU memory: stores from CUDA MemoryObjs and
    loads into them (the store's CUDA path), a miss left untouched."""
    if not torch.cuda.is_available():
        pytest.skip(
            "needs a CUDA device (LMCache buffers in GPU memory; bench/gpu_check.sh runs the gpu tests)"
        )

    def on_gpu(obj: Any) -> Any:
        meta = MemoryObjMetadata(
            shape=obj.meta.shape,
            dtype=obj.meta.dtype,
            address=0,
            phy_size=CHUNK,
            ref_count=1,
            fmt=MemoryFormat.KV_2LTD,
        )
        return TensorMemoryObj(obj.raw_data.cuda(), meta, parent_allocator=None)

    srcs = [chunk(i) for i in range(3)]
    assert store(adapter, [key(0), key(1)], [on_gpu(srcs[0]), srcs[1]]).is_successful()
    dst = [on_gpu(empty()) for _ in range(3)]
    assert load(adapter, [key(0), key(9), key(1)], dst) == [0, 2]
    assert torch.equal(dst[0].tensor.cpu(), srcs[0].tensor)
    assert torch.equal(dst[2].tensor.cpu(), srcs[1].tensor)
    assert not dst[1].tensor.view(torch.int16).any()


# -- threads, close ------------------------------------------------------------------------------


def test_store_and_prefetch_threads_at_once(adapter: AionvmeL2Adapter) -> None:
    """LMCache calls from two controller threads: stores from one, lookup +
    load + unlock from the other, while stores drop older chunks."""
    srcs = {i: chunk(i) for i in range(64)}
    errors: list[BaseException] = []
    stop = threading.Event()

    def storer() -> None:
        try:
            for first in range(0, 64, 4):
                ids = range(first, first + 4)
                adapter.submit_store_task([key(i) for i in ids], [srcs[i] for i in ids])
                time.sleep(0.001)
        except BaseException as e:  # reported by the test thread
            errors.append(e)
        finally:
            stop.set()

    def check_loads() -> None:
        try:
            while not stop.is_set():
                keys = [key(i) for i in range(64)]
                tid = adapter.submit_lookup_and_lock_task(keys, {})
                while (bm := adapter.query_lookup_and_lock_result(tid)) is None:
                    time.sleep(0.0005)
                hits = list(bm.get_indices_list())
                dst = [empty() for _ in hits]
                lid = adapter.submit_load_task([keys[i] for i in hits], dst)
                while (got := adapter.query_load_result(lid)) is None:
                    time.sleep(0.0005)
                loaded = list(got.get_indices_list())
                assert loaded == list(range(len(hits)))  # locked chunks always load
                for j in loaded:
                    assert same(dst[j], srcs[hits[j]])
                adapter.submit_unlock([keys[i] for i in hits])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=storer), threading.Thread(target=check_loads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    deadline = time.monotonic() + 10
    while adapter.report_status()["locked"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert adapter.report_status()["locked"] == 0


def test_close_gives_back_pins_closes_the_fds_and_is_idempotent(tmp_path: Path) -> None:
    a = AionvmeL2Adapter({"path": str(tmp_path), "nvme": CAP})
    store(a, [key(1)], [chunk(1)])
    lookup(a, [key(1)])
    fds = [a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()]
    assert a.report_status()["locked"] == 1
    a.close()
    a.close()
    assert not a.report_status()["is_healthy"]
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert not any(p.name.endswith(".slab") for p in tmp_path.iterdir())  # a scratch cache: its files go


# -- under LMCache's own StorageManager ------------------------------------------------------------


@pytest.fixture
def storage_manager(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    sm_mod = pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="LMCache's StorageManager")
    from lmcache.v1.distributed.config import (
        EvictionConfig,
        L1ManagerConfig,
        L1MemoryManagerConfig,
        StorageManagerConfig,
    )

    made: list[Any] = []

    def make(nvme: str = "64M") -> Any:
        spec = {
            "type": "plugin",
            "module_path": "aionvme.integrations.lmcache",
            "class_name": "AionvmeL2Adapter",
            "adapter_params": {"path": str(tmp_path / "kv"), "nvme": nvme},
        }
        args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(["--l2-adapter", json.dumps(spec)])
        mem = L1MemoryManagerConfig(
            size_in_bytes=64 << 20, use_lazy=False, init_size_in_bytes=64 << 20, align_bytes=0x1000
        )
        sm = sm_mod.StorageManager(
            StorageManagerConfig(
                l1_manager_config=L1ManagerConfig(
                    memory_config=mem, write_ttl_seconds=600, read_ttl_seconds=300
                ),
                eviction_config=EvictionConfig(eviction_policy="LRU"),
                l2_adapter_config=parse_args_to_l2_adapters_config(args),
            )
        )
        made.append(sm)
        return sm

    yield make
    for sm in made:
        sm.close()


def wait_until(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_storage_manager_stores_to_l2_and_prefetches_back(storage_manager: Callable[..., Any]) -> None:
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, PrefetchTaskSpec

    sm = storage_manager()
    (_, adapter), *_ = sm.l2_adapters()
    assert isinstance(adapter, AionvmeL2Adapter)
    layout = MemoryLayoutDesc(shapes=[torch.Size([64, 2, 512])], dtypes=[torch.bfloat16])
    keys = [key(i) for i in range(8)]
    objs = sm.reserve_write(keys, layout)
    want = {}
    for i, k in enumerate(keys):
        g = torch.Generator().manual_seed(i)
        objs[k].tensor.view(torch.int16).copy_(
            torch.randint(-32768, 32767, objs[k].tensor.shape, generator=g, dtype=torch.int16)
        )
        want[k] = bytes(objs[k].byte_array)
    sm.finish_write(keys)
    assert wait_until(lambda: adapter.get_usage().total_bytes_used == sum(map(len, want.values())))
    assert sm.delete_l1_keys(keys) == (8, 0)  # now only in the NVMe tier

    handle = sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(keys, 0, layout)]))
    assert sm.wait_prefetch_status(handle, 20.0)
    result = sm.query_prefetch_status(handle)
    assert [str(c) for c in result.l2_hit_cells] == ["1" * 8]  # every chunk came from the NVMe tier
    with sm.read_prefetched_results(keys) as got:
        assert got is not None
        assert [bytes(o.byte_array) for o in got] == [want[k] for k in keys]
    sm.finish_read_prefetched(keys)
    assert wait_until(lambda: adapter.report_status()["locked"] == 0)  # the controller unlocked
