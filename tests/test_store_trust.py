"""TieredStore you can trust (issue 32, items 3-6): one owner per directory,
a journal that tells damage from a torn tail, checksums of the values on
NVMe, typed errors for tampered index files, structured dtypes, get(out=)
dtype checks, private file modes, keys."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import aionvme as nvme
from aionvme.exceptions import AionvmeError
from aionvme.store import (
    CorruptValueError,
    JournalError,
    OutBufferError,
    StoreCorruptError,
    StoreError,
    StoreKeyTypeError,
    StoreLockedError,
    SyncTieredStore,
    TieredStore,
)

KiB = 1 << 10
MiB = 1 << 20
JOURNAL = "aionvme-store.journal"
INDEX = "aionvme-store.index"


def val(key: str, n: int = 3000) -> np.ndarray:
    return np.random.default_rng(sum(map(ord, key)) + n).integers(0, 1 << 30, n, dtype=np.int64)


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


# -- one owner per directory ----------------------------------------------------------

OWNER = textwrap.dedent(
    """
    import sys, numpy as np
    from aionvme.store import SyncTieredStore
    d, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def val(key, n=3000):
        return np.random.default_rng(sum(map(ord, key)) + n).integers(0, 1 << 30, n, dtype=np.int64)
    s = SyncTieredStore(d, host="64K", persist=True)
    for i in range(n):
        s.put(f"{who}{i}", val(f"{who}{i}"))
    print("ready", flush=True)
    sys.stdin.readline()
    s.close()
    print("closed", flush=True)
    """
)


def start_owner(d, who: str, n: int = 50) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(d), who, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_second_process_gets_store_locked_and_nothing_is_lost(tmp_path):
    # the finding: two processes each put 50 keys into one persistent
    # directory; on reopen half were gone and some keys gave another's bytes
    a = start_owner(tmp_path, "a")
    try:
        with pytest.raises(StoreLockedError) as ei:
            SyncTieredStore(tmp_path, host="64K", persist=True)
        e = ei.value
        assert e.pid == a.pid and str(a.pid) in str(e) and str(tmp_path) in str(e)
        assert isinstance(e, StoreError) and isinstance(e, OSError) and isinstance(e, AionvmeError)
    finally:
        a.communicate("\n", timeout=60)
    assert a.returncode == 0
    # the owner is gone: the second process opens it and adds its 50 keys
    with SyncTieredStore(tmp_path, host="64K", persist=True) as s:
        for i in range(50):
            s.put(f"b{i}", val(f"b{i}"))
    with SyncTieredStore(tmp_path, host="64K", persist=True) as s:
        assert len(s) == 100
        for k in s.aio:
            assert np.array_equal(s.get(k), val(str(k))), k


def test_a_second_store_in_the_same_process_is_refused(tmp_path):
    with SyncTieredStore(tmp_path / "x", host="64K", persist=True) as s:
        s.put("k", val("k"))
        with pytest.raises(StoreLockedError) as ei:
            TieredStore(tmp_path / "x", host="64K", persist=True)
        assert ei.value.pid == os.getpid() and "this one" in str(ei.value)
        # a scratch store beside it is fine: its files have names of their own
        with SyncTieredStore(tmp_path / "x", host=0) as scratch:
            scratch.put("k", val("other"))
            assert np.array_equal(scratch.get("k"), val("other"))
        assert np.array_equal(s.get("k"), val("k"))
    # closed: the lock is free again (and a failed open does not keep it)
    with pytest.raises(JournalError):
        TieredStore([tmp_path / "x", tmp_path / "y"], host="64K", persist=True)
    with SyncTieredStore(tmp_path / "x", host="64K", persist=True) as s:
        assert np.array_equal(s.get("k"), val("k"))


def test_the_lock_of_a_killed_process_does_not_block(tmp_path):
    a = start_owner(tmp_path, "a", 10)
    os.kill(a.pid, signal.SIGKILL)
    a.wait(timeout=60)
    with SyncTieredStore(tmp_path, host="64K", persist=True) as s:  # no StoreLockedError
        assert sorted(s.keys()) == sorted(f"a{i}" for i in range(10))
        for k in s.aio:
            assert np.array_equal(s.get(k), val(str(k)))


# -- the journal: damage is an error, a torn tail is cut ---------------------------------


def _crash(s: SyncTieredStore) -> None:
    """Leave as a crash would: no snapshot at close, the journal as it is."""
    s.aio._journal.close()
    s.aio._nvme.close(remove=False)
    s.aio._closed = True
    s.close()


def _journal_with_20_keys(d) -> tuple[bytes, list[int]]:
    """A journal of 20 put records (no snapshot since): its bytes and each record's offset."""
    with SyncTieredStore(d, host="16K", persist=True) as s:
        pass
    s = SyncTieredStore(d, host="16K", persist=True)
    for i in range(20):
        s.put(f"k{i}", val(f"k{i}"))
    _crash(s)
    data = (d / JOURNAL).read_bytes()
    offs = []
    pos = data.index(b"\n") + 1
    while pos < len(data):
        offs.append(pos)
        pos += 8 + int.from_bytes(data[pos : pos + 4], "little")
    assert len(offs) == 20
    return data, offs


def test_a_damaged_record_in_the_middle_is_an_error_and_changes_nothing(tmp_path):
    data, offs = _journal_with_20_keys(tmp_path)
    bad = bytearray(data)
    bad[offs[4] + 20] ^= 0xFF  # a flipped byte in record 4 of 20
    (tmp_path / JOURNAL).write_bytes(bad)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.endswith(".slab")}
    with pytest.raises(StoreCorruptError) as ei:
        SyncTieredStore(tmp_path, host="16K", persist=True)
    e = ei.value
    assert e.filename.endswith(JOURNAL) and e.offset == offs[4] and f"byte {offs[4]}" in str(e)
    assert "recover=True" in str(e) and isinstance(e, JournalError)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.endswith(".slab")}
    assert after == before  # the evidence is kept: nothing cut, nothing rewritten
    # explicit recovery: every intact record, a copy of the journal, a report
    with pytest.warns(RuntimeWarning, match="recovered 19 intact records"):
        s = SyncTieredStore(tmp_path, host="16K", persist=True, recover=True)
    with s:
        r = s.aio.recovered
        assert r is not None and r["records"] == 19 and r["lost_keys"] == []
        assert r["dropped"] == [(offs[4], offs[5])]
        assert open(r["copy"], "rb").read() == bytes(bad)
        assert sorted(s.keys()) == sorted(f"k{i}" for i in range(20) if i != 4)
        for k in s.aio:
            assert np.array_equal(s.get(k), val(str(k)))
    with SyncTieredStore(tmp_path, host="16K", persist=True) as s:  # recovered for good
        assert len(s) == 19 and s.aio.recovered is None


def test_a_torn_tail_is_still_cut_silently(tmp_path):
    data, offs = _journal_with_20_keys(tmp_path)
    (tmp_path / JOURNAL).write_bytes(data[: offs[19] + 30])  # the last write torn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with SyncTieredStore(tmp_path, host="16K", persist=True) as s:
            assert sorted(s.keys()) == sorted(f"k{i}" for i in range(19))


def test_a_format_1_store_is_read_and_migrated(tmp_path):
    # written by the release before checksums: no checksums, no commit marks
    with SyncTieredStore(tmp_path, host=0, persist=True) as s:
        s.put("old", val("old"))
        s.put("gone", val("gone"))
    snap = json.loads((tmp_path / INDEX).read_bytes())
    ents = {k: v[:2] for k, v in snap["entries"].items()}
    (tmp_path / INDEX).write_text(json.dumps({**snap, "format": "aionvme-store/1", "entries": ents}))
    from aionvme.store._journal import encode

    rec = encode({"op": "del", "k": "gone"})
    (tmp_path / JOURNAL).write_bytes(b"AIONVME-STORE-JOURNAL %d\n" % snap["generation"] + rec)
    with SyncTieredStore(tmp_path, host=0, persist=True) as s:
        assert s.keys() == ["old"] and np.array_equal(s.get("old"), val("old"))
        assert (tmp_path / JOURNAL).read_bytes().startswith(b"AIONVME-STORE-JOURNAL/2 ")
    assert json.loads((tmp_path / INDEX).read_bytes())["format"] == "aionvme-store/2"


def _mutations(blob: bytes, rng: np.random.Generator) -> list[bytes]:
    out = [blob[: int(rng.integers(0, len(blob)))] for _ in range(4)]
    for _ in range(8):
        b = bytearray(blob)
        b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
        out.append(bytes(b))
    return out


def _index_variants(snap: dict) -> list[object]:
    k, v = next(iter(snap["entries"].items()))
    meta, ext, c = v
    bad_entries = [
        None, 7, "x", [], [meta], [meta, ext, c, 1], [None, ext, c], [meta, None, c], [meta, ext, "x"],
        [["numpy", "<i8", [3000], 1], ext, c], [["numpy", "float99", [3000], 24000], ext, c],
        [["nope", "<i8", [3000], 24000], ext, c], [["numpy", "<i8", ["3000"], 24000], ext, c],
        [["numpy", "<i8", [10**30], 8 * 10**30], ext, c], [["numpy", "npy:[(", [1], 1], ext, c],
        [meta, [[0, 10**30, 0, 24000]], c], [meta, [[5, 0, 0, 24000]], c], [meta, [[0, -4096, 0, 24000]], c],
        [meta, [[0, 0, 0]], c], [meta, [["0", 0, 0, 24000]], c], [meta, [[0, 1 << 40, 0, 24000]], c],
        [meta, [], c], [meta, ext, -1], [meta, ext, 1 << 64], [meta, [[0, 0.5, 0, 24000]], c],
    ]  # fmt: skip
    out: list[object] = [None, [], "x", {**snap, "generation": "1"}, {**snap, "slabs": None}]
    out += [{**snap, "entries": 3}, {k2: v2 for k2, v2 in snap.items() if k2 != "entries"}]
    out += [{**snap, "entries": {**snap["entries"], k: b}} for b in bad_entries]
    return out


def test_tampered_index_and_journal_files_raise_the_store_error(tmp_path):
    d = tmp_path / "s"
    with SyncTieredStore(d, host=0, persist=True) as s:
        s.put_many({f"k{i}": val(f"k{i}") for i in range(3)})
    snap_bytes = (d / INDEX).read_bytes()
    snap = json.loads(snap_bytes)
    s = SyncTieredStore(d, host=0, persist=True)
    s.put("j0", val("j0"))
    s.delete("k0")
    s.put("j1", val("j1"))
    _crash(s)
    journal = (d / JOURNAL).read_bytes()
    rng = np.random.default_rng(3)
    cases: list[tuple[bytes, bytes]] = []
    for v in _index_variants(snap):
        cases.append((json.dumps(v).encode(), journal))
    cases += [(m, journal) for m in _mutations(snap_bytes, rng)]
    cases += [(snap_bytes, m) for m in _mutations(journal, rng)]
    from aionvme.store._journal import encode

    head = journal[: journal.index(b"\n") + 1]
    for r in ({"op": "put", "k": 3}, {"op": "zap", "k": "a"}, {"op": "put", "k": "a", "m": 1, "x": []}, [1]):
        cases.append((snap_bytes, head + encode(r) + encode({"op": "del", "k": "k1", "e": 1})))  # type: ignore[arg-type]
    opened = 0
    for sb, jb in cases:
        (d / INDEX).write_bytes(sb)
        (d / JOURNAL).write_bytes(jb)
        try:
            with SyncTieredStore(d, host=0, persist=True) as s:
                for k in s.aio:
                    # a tampered extent or checksum: the value's bytes do not match
                    with contextlib.suppress(CorruptValueError):
                        s.get(k)
            opened += 1
        except StoreError:
            pass  # JournalError / StoreCorruptError: a typed refusal
    assert 0 < opened < len(cases)


# -- checksums of the values ---------------------------------------------------------------


def _flip(s: TieredStore, key: str, at: int = 100) -> None:
    e = s._index[key]
    i, off, _b, _n = e.disk[0]
    path = s._nvme.slabs[i].path
    with open(path, "r+b") as f:
        f.seek(off + at)
        b = f.read(1)
        f.seek(off + at)
        f.write(bytes([b[0] ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("n", [3000, 3 * MiB // 8 + 5])  # a small value, a large one (read in segments)
async def test_a_flipped_byte_in_a_slab_is_a_corrupt_value_error_naming_the_key(tmp_path, n):
    async with TieredStore(tmp_path, host="16M") as s:
        await s.put("good", val("good", n))
        await s.put("bad", val("bad", n))
        await s.evict("good")
        await s.evict("bad")
        _flip(s, "bad", at=n * 8 - 3)
        for read in (
            lambda: s.get("bad"),
            lambda: s.get_many(["good", "bad"]),
            lambda: s.get("bad", out=np.empty(n, np.int64)),
        ):
            with pytest.raises(CorruptValueError) as ei:
                await read()
            assert ei.value.key == "bad" and "'bad'" in str(ei.value)
            assert isinstance(ei.value, OSError) and ei.value.filename.endswith(".slab")
        with pytest.raises(CorruptValueError):  # a load into the host tier (hold, prefetch)
            async with s.hold("bad"):
                pass
        assert s.where("bad") == ["nvme"]  # the bad bytes never reached the host tier
        assert np.array_equal(await s.get("good"), val("good", n))


async def test_checksums_of_phase_placed_and_striped_values(tmp_path):
    raw = nvme.empty(1_200_000 + 4096)  # page-aligned
    t = torch.from_numpy(raw[64 : 64 + 1_200_000]).view(torch.float32)  # 64 bytes past a page
    t.copy_(torch.randn(300_000))  # 1.2 MB: placed on NVMe at that phase
    u = torch.randn(3 * MiB // 4)  # striped over two directories
    async with (
        TieredStore(tmp_path / "one", host=0) as s,
        TieredStore([tmp_path / "a", tmp_path / "b"], host=0, stripe="1M") as s2,
    ):
        await s.put("t", t)
        await s2.put("u", u)
        assert s._index["t"].disk[0][1] % 4096 == t.data_ptr() % 4096 != 0
        assert len(s2._index["u"].disk) == 2
        assert torch.equal(await s.get("t"), t) and torch.equal(await s2.get("u"), u)
        _flip(s, "t", at=t.nbytes - 1)
        i, off, _b, _n = s2._index["u"].disk[1]  # the second piece of the striped value
        with open(s2._nvme.slabs[i].path, "r+b") as f:
            f.seek(off + 5)
            f.write(b"\x00\x01\x02")
        for st, k, like in ((s, "t", t), (s2, "u", u)):
            with pytest.raises(CorruptValueError, match=repr(k)):
                await st.get(k)
            with pytest.raises(CorruptValueError, match=repr(k)):
                await st.get(k, out=torch.empty_like(like))


async def test_checksums_persist_and_the_knob_turns_them_off(tmp_path):
    async with TieredStore(tmp_path, host=0, persist=True) as s:
        await s.put("k", val("k"))
    async with TieredStore(tmp_path, host=0, persist=True) as s:  # the checksum came back from the index
        _flip(s, "k")
        with pytest.raises(CorruptValueError):
            await s.get("k")
    async with TieredStore(tmp_path, host=0, persist=True, checksum=False) as s:
        assert not np.array_equal(await s.get("k"), val("k"))  # wrong bytes: nothing checks
    async with TieredStore(tmp_path / "off", host=0, checksum=False) as s:
        await s.put("k", val("k"))
        assert s._nvme.sums == {}


# -- the small ones ---------------------------------------------------------------------


async def test_structured_dtypes_round_trip(tmp_path):
    dt = np.dtype([("id", "<u4"), ("pos", "<f4", (2,)), ("tag", "S3")], align=True)
    a = np.zeros(50, dt)
    a["id"] = np.arange(50)
    a["pos"] = np.arange(100).reshape(50, 2)
    a["tag"] = b"abc"
    for persist in (False, True):
        async with TieredStore(tmp_path / str(persist), host=0, persist=persist) as s:
            await s.put("a", a)
            got = await s.get("a")
            assert got.dtype == dt and got.dtype.names == ("id", "pos", "tag")
            assert got.tobytes() == a.tobytes()
    async with TieredStore(tmp_path / "True", host=0, persist=True) as s:
        got = await s.get("a")
        assert got.dtype == dt and np.array_equal(got["pos"], a["pos"])


async def test_get_out_of_another_dtype_with_the_same_bytes_is_refused(tmp_path):
    async with TieredStore(tmp_path, host="1M") as s:
        v = np.arange(1000, dtype=np.float32)
        await s.put("v", v)
        await s.put("t", torch.arange(10, dtype=torch.bfloat16))
        for tier in ("host", "nvme"):
            if tier == "nvme":
                await s.evict("v")
                await s.evict("t")
            for out in (np.empty(1000, np.int32), torch.empty(1000, dtype=torch.int32)):
                with pytest.raises(OutBufferError, match="int32"):
                    await s.get("v", out=out)
            with pytest.raises(ValueError):
                await s.get("t", out=torch.empty(10, dtype=torch.float16))
            raw = np.empty(4000, np.uint8)  # uint8: the raw bytes, documented
            assert (await s.get("v", out=raw)).tobytes() == v.tobytes()
            assert torch.equal(await s.get("v", out=torch.empty(1000)), torch.from_numpy(v))


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_files_are_private_by_default_and_mode_widens_them(tmp_path):
    old = os.umask(0o022)
    try:
        for d, mode in ((tmp_path / "private", None), (tmp_path / "shared", 0o640)):
            kw = {} if mode is None else {"mode": mode}
            with SyncTieredStore(d, host=0, persist=True, **kw) as s:
                s.put("k", val("k"))
                names = os.listdir(d)
                assert {JOURNAL, INDEX, "aionvme-store.slab", "aionvme-store.lock"} <= set(names)
                for n in names:
                    assert _mode(d / n) == (mode or 0o600), n
            assert _mode(d) == (0o750 if mode else 0o700)
            with SyncTieredStore(d / "scratch", host=0) as s:
                s.put("k", val("k"))
                (slab,) = [n for n in os.listdir(d / "scratch") if n.endswith(".slab")]
                assert _mode(d / "scratch" / slab) == 0o600
    finally:
        os.umask(old)


async def test_keys_any_hashable_in_a_scratch_store_str_bytes_int_in_a_persistent_one(tmp_path):
    async with TieredStore(tmp_path / "scratch", host=0) as s:
        await s.put(1, val("1"))
        await s.put(("layer", 2), val("2"))
        assert np.array_equal(await s.get(1), val("1"))
    async with TieredStore(tmp_path / "persist", host=0, persist=True) as s:
        for k in (1.5, True, ("a",)):  # str, bytes and int: tests/test_store_cache.py
            with pytest.raises(StoreKeyTypeError):
                await s.put(k, val("x"))
            with pytest.raises(StoreKeyTypeError):
                await s.put_many({"ok": val("ok"), k: val("x")})
        assert s.keys() == []
