"""aionvme.dcp in one process: the format against torch's own FileSystemWriter
and FileSystemReader (both ways), the file layout, overwriting, the read
paths (direct, scratch, torch.load fallback), staging for async_save."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import aionvme  # noqa: E402
import aionvme.dcp  # noqa: E402
from aionvme.dcp import _reader, _record  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(1000, 777, generator=g)  # not a whole number of pages
    base = torch.randn(40, 30, generator=g)
    return {
        "model": {
            "big": big,
            "f16": torch.randn(513, generator=g).half(),
            "bf16": torch.randn(64, 3, generator=g).bfloat16(),
            "fp8": torch.randn(100, generator=g).to(torch.float8_e4m3fn),
            "i64": torch.randint(-(2**40), 2**40, (17, 3), generator=g),
            "u8": torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=g),
            "bool": torch.rand(33, generator=g) > 0.5,
            "c64": torch.randn(5, 5, dtype=torch.complex64, generator=g),
            "conj": torch.randn(4, 4, dtype=torch.complex64, generator=g).conj(),  # a lazy conjugate view
            "scalar": torch.tensor(seed * 1.5),
            "empty": torch.zeros(0, 7),
            "transposed": base.t(),  # not contiguous
            "view": base[5:9],  # a view with a storage offset
        },
        "optim": {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(8, generator=g)}}},
        "step": seed,
        "name": f"run-{seed}",
        "lst": [1, "two", 3.0, {"k": (seed, None)}],
    }


def _zeros_like(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):  # DCP flattens lists: lst.0, lst.1, ...
        return [_zeros_like(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def _equal(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _equal(a, b, f"{where}.{i}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        if want.dtype == torch.float8_e4m3fn:  # no equality kernel for fp8: compare the bytes
            got, want = got.view(torch.uint8), want.contiguous().view(torch.uint8)
        assert torch.equal(got, want), where
    else:
        assert got == want, (where, got, want)


def _save(sd: Any, path: Path, writer: str, **kw: Any) -> None:
    w = aionvme.dcp.Writer(path, **kw) if writer == "ours" else dcp.FileSystemWriter(path, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=w)


def _load(sd: Any, path: Path, reader: str) -> Any:
    rd = aionvme.dcp.Reader(path) if reader == "ours" else dcp.FileSystemReader(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=rd)
    return rd


@pytest.mark.parametrize("writer", ["ours", "torch"])
@pytest.mark.parametrize("reader", ["ours", "torch"])
def test_checkpoints_load_with_either_reader(tmp_path: Path, writer: str, reader: str) -> None:
    want = _state(3)
    _save(want, tmp_path / "ck", writer)
    got = _zeros_like(want)
    rd = _load(got, tmp_path / "ck", reader)
    _equal(got, want)
    if reader == "ours":
        stats = rd.stats
        # one batched request per file, but for records not laid out as the metadata predicts
        assert stats["files"] == 1 and stats["requests"] == 1 and stats["fallbacks"] == 0, stats
        # the big tensors went straight into their destinations
        assert stats["direct_bytes"] >= want["model"]["big"].nbytes


def test_layout_records_are_torch_save_archives_with_data_placed_like_its_memory(tmp_path: Path) -> None:
    want = _state(4)
    _save(want, tmp_path / "ck", "ours")
    files = [n for n in os.listdir(tmp_path / "ck") if n.endswith(".distcp")]
    assert len(files) == 1 and files[0].startswith("__0_")
    with open(tmp_path / "ck" / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    assert type(md).__module__ == "torch.distributed.checkpoint.metadata"
    raw = (tmp_path / "ck" / files[0]).read_bytes()
    tensors = 0
    for index, info in md.storage_data.items():
        assert type(info).__module__ == "torch.distributed.checkpoint.filesystem"
        assert info.relative_path == files[0]
        rec = raw[info.offset : info.offset + info.length]
        if index.fqn.startswith(("model.", "optim.")):
            lay = _record.parse(rec, rec, len(rec))
            assert lay is not None, index.fqn
            src = want
            for part in index.fqn.split("."):
                src = src[int(part)] if part.isdigit() else src[part]
            if src.nbytes >= 2 * 4096:  # spans whole pages: the file's offsets agree with the memory's
                addr = src.data_ptr() if src.is_contiguous() and not src.is_conj() else 0  # else a copy
                assert (info.offset + lay.data_offset) % 4096 == addr % 4096, index.fqn
            t = torch.load(io.BytesIO(rec), weights_only=True)
            _equal(t, src, index.fqn)
            tensors += 1
    assert tensors == 15


def _at(pool: torch.Tensor, residue: int, nbytes: int, dtype: torch.dtype, used: list[int]) -> torch.Tensor:
    """A contiguous view of ``pool`` (uint8) at an address that is ``residue``
    modulo 4096, past the views already made (``used``: the next free byte)."""
    base = pool.data_ptr()
    off = used[0] + (residue - base - used[0]) % 4096
    used[0] = off + nbytes
    return pool[off : off + nbytes].view(dtype)


# (address modulo 4096, bytes, dtype): tensors at no page boundary, of odd sizes
_ODD = [
    (0, 3 * 4096, torch.float32),
    (64, 3 * 4096 + 100, torch.float32),  # where torch's allocator puts big tensors
    (1, 2 * 4096 + 1, torch.uint8),
    (4095, 4097, torch.uint8),
    (2, 4096 * 2 + 6, torch.bfloat16),
    (100, 5 * 4096 - 4, torch.float16),
    (4088, 4096 + 8, torch.float64),
    (8, 3 * 4096, torch.complex64),
    (3, 4096 - 3, torch.bool),  # no whole page
    (12, 40, torch.int32),
]


def _same_bytes(got: dict[str, Any], want: dict[str, Any], where: str = "") -> None:
    """Equal keys, dtypes, shapes and bytes (random bytes make NaNs: no ==)."""
    assert set(got) == set(want), where
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (where, k)
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), (where, k)


def test_tensors_at_any_address_round_trip_zero_copy(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(11)
    pool = torch.randint(
        0, 256, (sum(n for _, n, _ in _ODD) + 4096 * (len(_ODD) + 1),), dtype=torch.uint8, generator=g
    )
    used = [0]
    want = {f"t{i}": _at(pool, r, n, dt, used) for i, (r, n, dt) in enumerate(_ODD)}
    want["bool"] = want.pop(f"t{_ODD.index(_ODD[8])}") != 0  # real bools (0/1), torch-allocated
    f32 = want["t1"]
    want["strided"] = f32[: (f32.numel() // 6) * 6].view(-1, 6)[:, ::2]  # not contiguous: copied
    want["rows"] = f32[: (f32.numel() // 6) * 6].view(-1, 6)[3:]  # contiguous, with a storage offset
    _save(want, tmp_path / "ck", "ours")
    (name,) = [n for n in os.listdir(tmp_path / "ck") if n.endswith(".distcp")]
    raw = (tmp_path / "ck" / name).read_bytes()
    with open(tmp_path / "ck" / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    for index, info in md.storage_data.items():
        src = want[index.fqn]
        rec = raw[info.offset : info.offset + info.length]
        lay = _record.parse(rec, rec, len(rec))
        assert lay is not None, index.fqn
        if src.nbytes >= 2 * 4096:
            addr = src.data_ptr() if src.is_contiguous() else 0  # a copy into page-aligned memory
            assert (info.offset + lay.data_offset) % 4096 == addr % 4096, index.fqn
        _same_bytes({"t": torch.load(io.BytesIO(rec), weights_only=True)}, {"t": src}, index.fqn)
    for reader in ("ours", "torch"):
        got = _zeros_like(want)
        _load(got, tmp_path / "ck", reader)
        _same_bytes(got, want, reader)
    # into destinations at other odd addresses than the sources had
    dst_pool = torch.zeros(pool.numel() + 4096, dtype=torch.uint8)
    used = [1]
    got = {
        k: _at(dst_pool, (r + 7 * i) % 4096 // dt.itemsize * dt.itemsize, n, dt, used)
        for i, (k, (r, n, dt)) in enumerate(zip([f"t{i}" for i in range(len(_ODD))], _ODD))
    }
    got = {k: v for k, v in got.items() if k in want}
    got["bool"], got["strided"], got["rows"] = (
        torch.zeros_like(want[k]) for k in ("bool", "strided", "rows")
    )
    _load(got, tmp_path / "ck", "ours")
    _same_bytes(got, want, "odd destinations")


def test_overwrite_commits_then_removes_the_old_files(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _save(_state(1), ck, "ours")
    first = {n for n in os.listdir(ck) if n.endswith(".distcp")}
    _save(_state(2), ck, "torch")  # torch's writer over ours: its files have other names
    _save(_state(5), ck, "ours")
    left = sorted(os.listdir(ck))
    assert len(left) == 2 and ".metadata" in left, left
    assert not first & set(left)
    for reader in ("ours", "torch"):
        got = _zeros_like(_state(5))
        _load(got, ck, reader)
        _equal(got, _state(5))
    (ck / "notes.txt").write_text("mine")  # only DCP data files are ever removed
    _save(_state(6), ck, "ours")
    assert (ck / "notes.txt").read_text() == "mine"
    with pytest.raises(dcp.api.CheckpointException) as ei:  # DCP wraps each rank's error
        _save(_state(7), ck, "ours", overwrite=False)
    assert isinstance(ei.value.failures[0][0], FileExistsError)  # (exception, traceback)
    got = _zeros_like(_state(6))
    _load(got, ck, "ours")
    _equal(got, _state(6))


def test_casts_and_strided_destinations_go_through_scratch(tmp_path: Path) -> None:
    src = {"a": torch.randn(300, 200), "b": torch.randn(200, 200), "c": torch.arange(50000.0)}
    _save(src, tmp_path / "ck", "ours")
    got = {
        "a": torch.zeros(300, 200, dtype=torch.float64),
        "b": torch.zeros(200, 200).t(),
        "c": torch.zeros(50000),
    }
    rd = _load(got, tmp_path / "ck", "ours")
    assert torch.equal(got["a"], src["a"].double())
    assert torch.equal(got["b"], src["b"])
    assert torch.equal(got["c"], src["c"])
    assert rd.stats["scratch_bytes"] == src["a"].nbytes + src["b"].nbytes
    assert rd.stats["direct_bytes"] == src["c"].nbytes


def test_records_not_as_predicted_are_read_as_parsed(tmp_path: Path) -> None:
    # torch's writer saves a transposed tensor with its strides: not the
    # contiguous archive the metadata predicts, so a second request reads it
    src = {"t": torch.randn(300, 400).t(), "u": torch.randn(50000)}
    _save(src, tmp_path / "ck", "torch")
    got = {"t": torch.zeros(400, 300), "u": torch.zeros(50000)}
    rd = _load(got, tmp_path / "ck", "ours")
    assert torch.equal(got["t"], src["t"]) and torch.equal(got["u"], src["u"])
    assert rd.stats["requests"] == 2 and rd.stats["fallbacks"] == 0, rd.stats
    assert rd.stats["scratch_bytes"] == src["t"].nbytes and rd.stats["direct_bytes"] == src["u"].nbytes


def test_unexpected_records_fall_back_to_torch_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _state(8)
    _save(want, tmp_path / "ck", "torch")
    monkeypatch.setattr(_reader, "parse", lambda *a: None)
    got = _zeros_like(want)
    rd = _load(got, tmp_path / "ck", "ours")
    _equal(got, want)
    assert rd.stats["fallbacks"] >= 1


def test_a_truncated_data_file_raises(tmp_path: Path) -> None:
    want = {"w": torch.randn(1000, 100)}
    _save(want, tmp_path / "ck", "ours")
    (name,) = [n for n in os.listdir(tmp_path / "ck") if n.endswith(".distcp")]
    os.truncate(tmp_path / "ck" / name, 200_000)
    with pytest.raises(dcp.api.CheckpointException) as ei:
        _load({"w": torch.zeros(1000, 100)}, tmp_path / "ck", "ours")
    err = ei.value.failures[0][0]  # (exception, traceback)
    assert isinstance(err, aionvme.ShortReadError) and name in str(err.filename), repr(err)


async def test_blocking_calls_from_inside_a_running_loop(tmp_path: Path) -> None:
    want = {"w": torch.randn(100, 100), "n": 3}
    _save(want, tmp_path / "ck", "ours")  # DCP is blocking: runs on a helper thread's loop
    got = {"w": torch.zeros(100, 100), "n": None}
    _load(got, tmp_path / "ck", "ours")
    assert torch.equal(got["w"], want["w"]) and got["n"] == 3


def test_stager_copies_into_page_aligned_memory(tmp_path: Path) -> None:
    src = {"a": torch.randn(1000, 10), "n": {"b": torch.arange(7), "l": [1, torch.ones(3)]}, "s": "x"}
    w = aionvme.dcp.Writer(tmp_path / "ck", cache_staged_state_dict=True)
    staged = w.stage(src)
    assert aionvme.is_aligned(staged["a"]) and aionvme.is_aligned(staged["n"]["b"])
    assert torch.equal(staged["a"], src["a"]) and staged["a"].data_ptr() != src["a"].data_ptr()
    assert torch.equal(staged["n"]["l"][1], torch.ones(3)) and staged["s"] == "x"
    src["a"].add_(1)
    again = w.stage(src)
    assert again["a"].data_ptr() == staged["a"].data_ptr()  # the cached buffer, refilled
    assert torch.equal(again["a"], src["a"])
    assert w.last_stage_seconds > 0
    w.close()


class _ThreadProbe:
    """A non-tensor state-dict value: stage() deep-copies it, recording torch's
    intra-op thread count at that moment."""

    seen: list[int] = []

    def __deepcopy__(self, memo: Any) -> _ThreadProbe:
        _ThreadProbe.seen.append(torch.get_num_threads())
        return _ThreadProbe()


def test_stager_fresh_copies_and_copy_threads_per_local_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = {"a": torch.randn(300, 1000), "b": torch.arange(5), "e": torch.zeros(0, 3), "p": _ThreadProbe()}
    w = aionvme.dcp.Writer(tmp_path / "ck")  # no cache: fresh small-page buffers every time
    staged = w.stage(src)
    again = w.stage(src)
    for s in (staged, again):
        assert aionvme.is_aligned(s["a"]) and s["a"].data_ptr() != src["a"].data_ptr()
        assert torch.equal(s["a"], src["a"]) and torch.equal(s["b"], src["b"]) and s["e"].shape == (0, 3)
    assert staged["a"].data_ptr() != again["a"].data_ptr()
    src["a"].zero_()
    assert not torch.equal(staged["a"], src["a"])
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 ranks on 4 CPUs: one thread each
    _ThreadProbe.seen.clear()
    w.stage(src)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    w.stage(src)
    assert _ThreadProbe.seen == [1, before] and torch.get_num_threads() == before


def test_async_save_returns_after_the_copy(tmp_path: Path) -> None:
    sd = {"w": torch.randn(2000, 100), "step": 1}
    want = {"w": sd["w"].clone(), "step": 1}
    w = aionvme.dcp.Writer(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fut = dcp.async_save(sd, storage_writer=w)
        sd["w"].zero_()  # training goes on at once
        sd["step"] = 2
        fut.result()
    got = {"w": torch.zeros(2000, 100), "step": None}
    _load(got, tmp_path / "ck", "torch")
    assert torch.equal(got["w"], want["w"]) and got["step"] == 1


def test_import_aionvme_imports_no_torch() -> None:
    code = "import sys, aionvme; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_dicts_save_stage_and_load(tmp_path: Path) -> None:
    sd = {"w": torch.randn(1000, 300, device="cuda"), "b": torch.randn(77, device="cuda").half(), "step": 3}
    want = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    _save(sd, tmp_path / "ck", "ours")
    w = aionvme.dcp.Writer(tmp_path / "ck2")
    staged = w.stage(sd)
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned() and aionvme.is_aligned(staged["w"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fut = dcp.async_save(sd, storage_writer=w)
        sd["w"].zero_()
        fut.result()
    for d in ("ck", "ck2"):
        for reader in ("ours", "torch"):
            got = {
                "w": torch.zeros(1000, 300, device="cuda"),
                "b": torch.zeros(77, device="cuda").half(),
                "step": 0,
            }
            _load(got, tmp_path / d, reader)
            assert torch.equal(got["w"].cpu(), want["w"]) and torch.equal(got["b"].cpu(), want["b"])
            assert got["step"] == 3
