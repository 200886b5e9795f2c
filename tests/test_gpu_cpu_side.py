"""The GPU support as far as a machine without a GPU can check it.

- The package builds and imports with no CUDA anywhere; nothing CUDA is loaded.
- The cuFile loader: a missing library or one without cuFile's entry points
  is reported with the reason; the real libcufile (the nvidia-cufile wheel,
  when installed) loads, reports its version, and its driver's failure to
  open without a GPU arrives as a CuFileError named after its code.
- The engine's GDS path, driven through a stand-in libcufile
  (tests/cufile_shim.c) that follows cuFile's contract with host memory and
  POSIX I/O: loading, driver reference count, fd 0 restored, handle
  registration and deregistration before close, chunks in parallel on
  workers, the three return conventions, short reads, cancellation, the
  per-file fallback.
- The bounce pipeline's parts that need no device: planning and the slot pool.
- DeviceError wherever a call needs CUDA, ``aionvme bench --gpu``'s message,
  and ``aionvme info``'s cuFile and GPU fields.

What needs a GPU (the transfers into CUDA memory, the copies, pinning) is in
tests/test_gpu.py and bench/gpu_check.sh.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import aionvme as nvme
import aionvme._engine as _engine
from aionvme import defaults, gpu
from aionvme._runtime import bounce, cuda, cufile, pinned
from aionvme._runtime.reactor import get_reactor
from aionvme.exceptions import CUFILE_ERRORS, CuFileError, DeviceError, ShortReadError, cufile_error

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

torch = pytest.importorskip("torch")
# What only holds where there is no CUDA (elsewhere test_gpu.py checks the real thing).
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: see tests/test_gpu.py")


def _py(
    code: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ, PYTHONPATH=str(SRC), **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=e,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- build and import --------------------------------------------------------------------------------


def test_import_and_host_io_load_no_cuda_library(tmp_path):
    r = _py(
        f"""
        import aionvme as nvme, numpy as np
        a = nvme.empty(8192); a[:] = 7
        with nvme.open({str(tmp_path / "f")!r}, "w+") as f:
            f.sync_pwrite(a, 0); b = nvme.empty(8192); f.sync_pread(b, 0)
        assert (a == b).all()
        maps = open("/proc/self/maps").read()
        print("cufile" in maps, "libcuda" in maps, "libcudart" in maps)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "False"]


def test_extension_links_no_cuda():
    so = Path(_engine.__file__)
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    r = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True)
    needed = [ln for ln in r.stdout.splitlines() if "NEEDED" in ln]
    assert needed and not any(("cuda" in ln or "cufile" in ln) for ln in needed), needed


# -- cuFile's error codes ---------------------------------------------------------------------------------


def test_cufile_codes_map_to_named_errors():
    assert len(CUFILE_ERRORS) >= 45
    for code, (name, text) in CUFILE_ERRORS.items():
        for reported in (code, -code):  # cuFileRead returns -code; CUfileError_t.err holds +code
            e = cufile_error(reported, "/f", offset=4096, nbytes=8192, op="cuFileRead")
            assert isinstance(e, CuFileError) and isinstance(e, OSError) and isinstance(e, nvme.AionvmeError)
            assert (e.code, e.code_name, e.errno, e.filename) == (code, name, errno.EIO, "/f")
            assert text in str(e) and f"cuFile error {code} ({name})" in str(e) and "offset 4096" in str(e)
    assert CUFILE_ERRORS[5001][0] == "CU_FILE_DRIVER_NOT_INITIALIZED"
    assert CUFILE_ERRORS[5033][0] == "CU_FILE_NVFS_SETUP_ERROR"
    assert 5021 not in CUFILE_ERRORS and 5032 not in CUFILE_ERRORS  # gaps in cufile.h
    unknown = cufile_error(-5999)
    assert isinstance(unknown, CuFileError) and unknown.code_name == "CU_FILE_UNKNOWN_ERROR"


def test_errno_from_cufile_is_the_os_error():
    e = cufile_error(errno.ENOENT, "/x", op="cuFileRead", offset=0, nbytes=1)
    assert type(e) is FileNotFoundError and e.filename == "/x"
    assert type(cufile_error(-errno.EIO, "/x")) is OSError and cufile_error(-errno.EIO).errno == errno.EIO
    assert cufile_error(0).errno == errno.EIO  # -1 with errno 0: still an I/O error, never success


def test_cufile_error_pickles_and_carries_the_cuda_code():
    e = cufile_error(5011, "/f", op="cuFileBufRegister", cu_err=700)
    assert e.cu_err == 700 and "CUDA driver error 700" in str(e)
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.code, back.code_name, back.cu_err, back.filename) == (
        CuFileError,
        5011,
        "CU_FILE_CUDA_DRIVER_ERROR",
        700,
        "/f",
    )


# -- the loader ------------------------------------------------------------------------------------------


@pytest.fixture
def no_cufile():
    """No cuFile library loaded before or after the test."""
    gpu.shutdown()
    assert _engine.gds_unload()
    yield
    gpu.shutdown()
    assert _engine.gds_unload(), _engine.gds_status()


def test_loader_reports_why_nothing_loaded(no_cufile, tmp_path):
    path, why = _engine.gds_load([str(tmp_path / "libcufile.so.0"), "libcufile-nonexistent.so.0"])
    assert path is None and "libcufile.so.0" in why and "No such file" in why
    libc = "libc.so.6"
    path, why = _engine.gds_load([libc])
    assert path is None and "no cuFileDriverOpen" in why and "not a cuFile library" in why
    assert not _engine.gds_status()["loaded"]
    with pytest.raises(DeviceError, match="not loaded"):
        _engine.gds_driver_open()


def test_cufile_unavailable_gives_the_reason_and_the_bounce_path(no_cufile, monkeypatch, tmp_path):
    monkeypatch.setenv("AIONVME_CUFILE_LIBRARY", str(tmp_path / "missing.so"))
    monkeypatch.setattr(cufile, "library_candidates", lambda: [str(tmp_path / "missing.so")])
    st = gpu.cufile_status()
    assert st["mode"] is None and "could not be loaded" in st["reason"] and "missing.so" in st["reason"]
    with nvme.open(tmp_path / "f", "w+") as f:
        assert gpu.gds_choice(f._handle()) == st["reason"]  # 'auto': the bounce path, with the reason
        with defaults.set(gpu_path="gds"), pytest.raises(DeviceError, match="cuFile is unavailable"):
            gpu.gds_choice(f._handle())
        with defaults.set(gpu_path="bounce"):
            assert gpu.gds_choice(f._handle()) == "gpu_path='bounce'"


def _real_libcufile() -> str | None:
    for cand in cufile.library_candidates():
        if os.sep in cand and os.path.exists(cand):
            return cand
    return None


def test_real_libcufile_loads_with_every_entry_point(tmp_path):
    lib = _real_libcufile()
    if lib is None:
        pytest.skip("no libcufile.so.0 here (pip install nvidia-cufile, or set AIONVME_CUFILE_LIBRARY)")
    # In a child, so this process's loader state stays clean.
    r = _py(
        f"""
        import aionvme._engine as _engine
        path, why = _engine.gds_load([{lib!r}])
        st = _engine.gds_status()
        print(path == {lib!r}, why, st["loaded"], st["version"])
        """,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    same, why, loaded, version = r.stdout.split()
    assert (same, why, loaded) == ("True", "None", "True")
    assert int(version) >= 1000  # cuFileGetVersion: 1000 * major + 10 * minor


@no_cuda
def test_no_gpu_driver_means_no_driver_open(tmp_path, monkeypatch, no_cufile):
    lib = _real_libcufile()
    if lib is None:
        pytest.skip("no libcufile.so.0 here (pip install nvidia-cufile)")
    if cufile.nvidia_driver_present():
        pytest.skip("an NVIDIA driver is present")
    monkeypatch.delenv("AIONVME_CUFILE_LIBRARY", raising=False)
    monkeypatch.setattr(cufile, "library_candidates", lambda: [lib])
    st = gpu.cufile_status()  # cuFileDriverOpen is not even tried (it can hang without a GPU)
    assert st["mode"] is None and "no NVIDIA GPU driver" in st["reason"] and st["library"] == lib
    assert _engine.gds_status()["driver_refs"] == 0


# -- the engine's GDS path through a stand-in libcufile ----------------------------------------------------


class Shim:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))  # the library the engine loads too: one copy, shared counters
        self.lib.shim_reset()

    def counts(self) -> dict[str, int]:
        arr = (ctypes.c_long * 8)()
        self.lib.shim_counts(arr)
        names = ("opens", "closes", "handles", "buffers", "reads", "writes", "inflight", "max_inflight")
        return dict(zip(names, arr))


@pytest.fixture(scope="session")
def shim_library(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the cuFile stand-in")
    out = tmp_path_factory.mktemp("shim") / "libcufile_shim.so"
    src = Path(__file__).with_name("cufile_shim.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture
def shim(shim_library, monkeypatch, no_cufile):
    """cuFile is the stand-in; everything it registered is gone after the test."""
    monkeypatch.setenv("AIONVME_CUFILE_LIBRARY", str(shim_library))
    for var in ("SHIM_FAIL", "SHIM_OPEN_FAIL", "SHIM_CLOSE_STDIN", "SHIM_COMPAT", "SHIM_DELAY_US"):
        monkeypatch.delenv(var, raising=False)
    s = Shim(shim_library)
    yield s
    gpu.shutdown()
    c = s.counts()
    assert c["handles"] == 0 and c["buffers"] == 0 and c["inflight"] == 0, c


def test_stand_in_is_cufile_in_gds_mode(shim):
    st = gpu.cufile_status()
    assert st["mode"] == "gds" and st["library"] == str(shim.path) and st["version"] == "1.15"
    assert "nvidia-fs 2.17" in st["reason"] and st["properties"]["nvme_supported"]
    assert st["properties"]["allow_compat_mode"] and not st["properties"]["poll_mode"]
    assert shim.counts()["opens"] == 1
    gpu.cufile_status()
    assert shim.counts()["opens"] == 1  # opened once per process
    gpu.shutdown()
    assert shim.counts()["closes"] == 1 and _engine.gds_status()["driver_refs"] == 0


def test_driver_reference_count(shim):
    _engine.gds_load([str(shim.path)])
    _engine.gds_driver_open()
    _engine.gds_driver_open()
    assert _engine.gds_status()["driver_refs"] == 2 and shim.counts()["opens"] == 1
    assert _engine.gds_driver_close() is False and shim.counts()["closes"] == 0
    assert _engine.gds_driver_close() is True and shim.counts()["closes"] == 1
    assert _engine.gds_driver_close() is True  # nothing left to close
    assert _engine.gds_unload()


def test_registered_files_keep_the_driver_open(shim, tmp_path):
    f = _registered_file(tmp_path / "k.bin")
    assert _engine.gds_status()["driver_refs"] == 2  # the process's and the file's
    gpu.shutdown()  # drops the process's reference only
    assert shim.counts()["closes"] == 0 and _engine.gds_status()["handles"] == 1
    f.close()
    c = shim.counts()
    assert c["closes"] == 1 and c["handles"] == 0 and _engine.gds_status()["driver_refs"] == 0


def test_a_file_refused_mid_transfer_goes_the_bounce_way(shim, tmp_path):
    with _registered_file(tmp_path / "m.bin") as f:
        h = f._handle()
        _engine.gds_refuse_file(h, cufile_error(5008, h.path, op="cuFileRead"))
        assert "GPUDirect Storage not supported on current file" in gpu.gds_choice(h)
        assert _engine.gds_file_registered(h)  # requests in flight may still use it
    assert shim.counts()["handles"] == 0


def test_driver_open_failure_is_named_and_remembered(shim, monkeypatch, tmp_path):
    monkeypatch.setenv("SHIM_OPEN_FAIL", "5001")
    st = gpu.cufile_status()
    assert st["mode"] is None and "CU_FILE_DRIVER_NOT_INITIALIZED" in st["reason"]
    with nvme.open(tmp_path / "f", "w+") as f:
        assert "CU_FILE_DRIVER_NOT_INITIALIZED" in gpu.gds_choice(f._handle())
    assert _engine.gds_status()["driver_refs"] == 0


def test_compat_mode_prefers_the_bounce_pipeline(shim, monkeypatch, tmp_path):
    monkeypatch.setenv("SHIM_COMPAT", "1")
    assert gpu.cufile_status()["mode"] == "compat"
    with nvme.open(tmp_path / "f", "w+") as f:
        assert "compatibility mode" in gpu.gds_choice(f._handle())
        assert shim.counts()["handles"] == 0
        with defaults.set(gpu_path="gds"):
            assert gpu.gds_choice(f._handle()) is None  # forced: cuFile, whatever its mode
        assert shim.counts()["handles"] == 1
    assert shim.counts()["handles"] == 0  # deregistered when the file closed


def test_stdin_survives_a_driver_that_closes_it(shim_library, tmp_path):
    r = _py(
        """
        import os
        import aionvme._engine as _engine
        from aionvme import gpu
        before = os.fstat(0)
        st = gpu.cufile_status()
        after = os.fstat(0)
        print(st["mode"], (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino),
              _engine.gds_status()["stdin_restored"])
        """,
        env={"AIONVME_CUFILE_LIBRARY": str(shim_library), "SHIM_CLOSE_STDIN": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["gds", "True", "1"]


def _registered_file(path: Path, mode: str = "w+", **kw):
    f = nvme.open(path, mode, **kw)
    gpu.cufile_status()
    assert gpu.gds_choice(f._handle()) is None
    return f


def _items(buf: np.ndarray, layout: list[tuple[int, int, int]]):
    """(owner, base, boff, nbytes, offset) for slices of buf: (start, nbytes, file offset)."""
    base = buf.ctypes.data
    return [(buf, base, start, n, off) for start, n, off in layout]


async def test_gds_write_and_read_back_any_alignment(shim, tmp_path):
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    layout = [
        (0, 1 << 20, 0),
        (1 << 20, 777_777, 1_234_567),
        (3_000_000, 145_728, 5_000_001),
        (2_900_000, 3, 6_000_017),
    ]
    with _registered_file(tmp_path / "g.bin") as f:
        r = get_reactor()
        n = await r.submit(_engine.gds_submit(r.engine, f._handle(), _items(src, layout), True, 64 << 10))
        assert n == sum(x[1] for x in layout)
        raw = (tmp_path / "g.bin").read_bytes()
        for start, nb, off in layout:
            assert raw[off : off + nb] == src[start : start + nb].tobytes()
        dst = np.zeros(len(src) + 1, np.uint8)
        back = [(start + 1, nb, off) for start, nb, off in layout[:3]]  # unaligned memory too
        n = await r.submit(_engine.gds_submit(r.engine, f._handle(), _items(dst, back), False, 64 << 10))
        assert n == sum(x[1] for x in back)
        for start, nb, off in back:
            assert dst[start : start + nb].tobytes() == raw[off : off + nb]
    c = shim.counts()
    assert c["writes"] >= 16 + 12 and c["reads"] >= 16  # chunked by block
    assert c["handles"] == 0


async def test_gds_chunks_run_in_parallel_on_workers(shim, monkeypatch, tmp_path):
    monkeypatch.setenv("SHIM_DELAY_US", "5000")
    data = np.arange(1 << 20, dtype=np.uint8)
    with _registered_file(tmp_path / "p.bin") as f:
        r = get_reactor()
        await r.submit(
            _engine.gds_submit(r.engine, f._handle(), _items(data, [(0, 1 << 20, 0)]), True, 64 << 10)
        )
    assert shim.counts()["max_inflight"] >= 4  # 16 chunks, 8 workers


async def test_gds_short_read_and_the_three_return_conventions(shim, monkeypatch, tmp_path):
    (tmp_path / "s.bin").write_bytes(bytes(range(256)) * 400)  # 102400 bytes
    buf = np.zeros(200_000, np.uint8)
    with _registered_file(tmp_path / "s.bin", "r") as f:
        r = get_reactor()
        h = f._handle()

        def read(n=200_000, off=0):
            return r.submit(_engine.gds_submit(r.engine, h, _items(buf, [(0, n, off)]), False, 32 << 10))

        with pytest.raises(ShortReadError) as ei:
            await read()
        assert (ei.value.expected, ei.value.received, ei.value.offset) == (200_000, 102_400, 0)
        assert buf[:102_400].tobytes() == (tmp_path / "s.bin").read_bytes()

        monkeypatch.setenv("SHIM_FAIL", "70000:5011")  # a negative CUfileOpError
        with pytest.raises(CuFileError) as ce:
            await read(100_000)
        e = ce.value
        assert (e.code, e.code_name, e.filename, e.offset) == (
            5011,
            "CU_FILE_CUDA_DRIVER_ERROR",
            h.path,
            65536,
        )
        assert "cuFileRead of 100000 bytes" in str(e)

        monkeypatch.setenv("SHIM_FAIL", f"70000:{errno.EIO}")  # -1 with errno set
        with pytest.raises(OSError) as oe:
            await read(100_000)
        assert (
            type(oe.value) is OSError
            and oe.value.errno == errno.EIO
            and not isinstance(oe.value, CuFileError)
        )

        monkeypatch.setenv("SHIM_FAIL", f"0:{errno.EACCES}")
        with pytest.raises(PermissionError):
            await read(100)


async def test_gds_cancel_waits_for_chunks_in_flight(shim, monkeypatch, tmp_path):
    monkeypatch.setenv("SHIM_DELAY_US", "20000")
    (tmp_path / "c.bin").write_bytes(b"\1" * (4 << 20))
    buf = np.zeros(4 << 20, np.uint8)
    with _registered_file(tmp_path / "c.bin", "r") as f:
        r = get_reactor()
        fut = r.submit(
            _engine.gds_submit(r.engine, f._handle(), _items(buf, [(0, 4 << 20, 0)]), False, 64 << 10)
        )
        while shim.counts()["inflight"] == 0:
            await asyncio.sleep(0.001)
        fut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fut
        c = shim.counts()
        assert c["inflight"] == 0  # nothing writes into buf after the await ended
        assert c["reads"] < 64  # the rest was never issued


def test_gds_blocking_twin(shim, tmp_path):
    from aionvme._runtime import blocking as _sync

    data = np.random.default_rng(3).integers(0, 256, 300_001, dtype=np.uint8)
    with _registered_file(tmp_path / "b.bin") as f:
        eng = _sync.thread_engine()
        assert (
            _sync.run(_engine.gds_submit(eng, f._handle(), _items(data, [(0, 300_001, 99)]), True, 1 << 16))
            == 300_001
        )
        out = np.zeros_like(data)
        assert (
            _sync.run(_engine.gds_submit(eng, f._handle(), _items(out, [(0, 300_001, 99)]), False)) == 300_001
        )
        assert (out == data).all()


async def test_refused_file_is_remembered_and_goes_the_bounce_way(shim, tmp_path):
    p = tmp_path / "r.bin"
    p.write_bytes(b"x" * 8192)
    gpu.cufile_status()
    refused = gpu.stats()["files_refused"]
    with nvme.open(p, "r", direct=False) as f:  # cuFile needs O_DIRECT
        assert "not open with O_DIRECT" in gpu.gds_choice(f._handle())
        with defaults.set(gpu_path="gds"), pytest.raises(CuFileError) as ei:
            gpu.gds_choice(f._handle())
        assert ei.value.code_name == "CU_FILE_INVALID_FILE_OPEN_FLAG"
        assert f._handle().gds_refused is ei.value
    with nvme.open(p, "r") as f:  # O_DIRECT now, but the file is remembered
        assert "not open with O_DIRECT" in gpu.gds_choice(f._handle())
    s = gpu.stats()
    assert s["files_refused"] == refused + 1 and s["files_remembered"] == 1 and str(p) in s["last_refusal"]
    assert shim.counts()["handles"] == 0


async def test_close_deregisters_after_transfers_in_flight(shim, monkeypatch, tmp_path):
    monkeypatch.setenv("SHIM_DELAY_US", "20000")
    data = np.ones(1 << 20, np.uint8)
    f = _registered_file(tmp_path / "d.bin")
    r = get_reactor()
    fut = r.submit(_engine.gds_submit(r.engine, f._handle(), _items(data, [(0, 1 << 20, 0)]), True, 1 << 18))
    f.close()  # deferred: cuFile keeps the fd until the transfer is done
    assert shim.counts()["handles"] == 1
    assert await fut == 1 << 20
    assert shim.counts()["handles"] == 0 and _engine.gds_status()["handles"] == 0


def test_buffer_registration(shim):
    gpu.cufile_status()
    buf = np.zeros(1 << 16, np.uint8)
    _engine.gds_buf_register(buf.ctypes.data, buf.nbytes)
    with pytest.raises(CuFileError) as ei:
        _engine.gds_buf_register(buf.ctypes.data, buf.nbytes)
    assert ei.value.code_name == "CU_FILE_MEMORY_ALREADY_REGISTERED"
    assert shim.counts()["buffers"] == 1 and _engine.gds_status()["buffers"] == 1
    _engine.gds_buf_deregister(buf.ctypes.data)
    with pytest.raises(CuFileError, match="CU_FILE_INVALID_VALUE"):
        _engine.gds_buf_deregister(buf.ctypes.data)
    assert shim.counts()["buffers"] == 0


def test_registered_ranges_give_cufile_their_base(monkeypatch):
    monkeypatch.setattr(cufile, "_registered", {1 << 20: (4096, None), 8 << 20: (1 << 20, None)})
    monkeypatch.setattr(cufile, "_registered_bases", [1 << 20, 8 << 20])
    assert cufile._cufile_base((1 << 20) + 100, 100) == (1 << 20, 100)
    assert cufile._cufile_base((1 << 20) + 4000, 200) == ((1 << 20) + 4000, 0)  # runs past the registration
    assert cufile._cufile_base((8 << 20) + 512, 1 << 19) == (8 << 20, 512)
    assert cufile._cufile_base(4096, 10) == (4096, 0)


def test_info_reports_cufile_from_a_child_process(shim_library, tmp_path, monkeypatch):
    monkeypatch.setenv("AIONVME_CUFILE_LIBRARY", str(shim_library))
    d = nvme.info(str(tmp_path))
    cf = d["cufile"]
    assert cf["library"] == str(shim_library) and cf["available"] and cf["probed"] == "subprocess"
    assert cf["mode"] == "gds" and cf["version"] == "1.15" and "nvidia-fs 2.17" in cf["reason"]
    assert (
        not _engine.gds_status()["loaded"] or _engine.gds_status()["driver_refs"] == 0
    )  # not in this process
    monkeypatch.setenv("SHIM_OPEN_FAIL", "5009")
    cf = nvme.info(str(tmp_path))["cufile"]
    assert cf["mode"] is None and "CU_FILE_DEVICE_NOT_SUPPORTED" in cf["reason"]


# -- the bounce pipeline's parts ----------------------------------------------------------------------------


@pytest.mark.parametrize("align", [1, 512, 4096])
def test_plan_pieces_cover_each_byte_once_at_aligned_boundaries(align):
    rng = np.random.default_rng(align)
    slot = 64 << 10
    items = [(int(rng.integers(0, 300_000)), int(rng.integers(0, 1 << 24))) for _ in range(40)] + [
        (slot, 0),
        (slot, 1),
        (1, slot - 1),
        (0, 5),
    ]
    pieces = bounce.plan_pieces(items, slot, align)
    for i, (n, off) in enumerate(items):
        mine = [p for p in pieces if p.item == i]
        covered = np.zeros(n, dtype=np.int32)
        for k, p in enumerate(mine):
            assert p.fpos % align == 0 and p.n > 0 and p.skip + p.n <= slot
            assert p.fpos + p.skip == off + p.upos  # the slot's bytes sit at their file offsets
            assert p.skip == 0 or k == 0  # only the first piece starts unaligned
            if k < len(mine) - 1:
                assert (p.fpos + p.skip + p.n) % align == 0
            covered[p.upos : p.upos + p.n] += 1
        assert (covered == 1).all()


def _pool(nslots=3, slot=4096):
    return pinned.PinnedPool(slot, nslots, None)


def test_pool_slots_are_page_aligned_views_of_one_buffer():
    p = _pool(4, 8192)
    slots = [p.acquire_blocking() for _ in range(4)]
    addrs = sorted(s.array.ctypes.data for s in slots)
    assert all(a % 4096 == 0 for a in addrs) and np.diff(addrs).tolist() == [8192] * 3
    assert all(s.tensor.data_ptr() == s.array.ctypes.data for s in slots)
    assert p.describe()["free"] == 0 and not p.pinned
    for s in slots:
        p.release(s)
    assert p.describe()["free"] == 4


async def test_pool_waiters_are_served_in_order_and_cancellation_passes_slots_on():
    p = _pool(1)
    held = await p.acquire()
    order = []

    async def want(tag):
        s = await p.acquire()
        order.append(tag)
        await asyncio.sleep(0)
        p.release(s)

    t1 = asyncio.ensure_future(want(1))
    t2 = asyncio.ensure_future(want(2))
    t3 = asyncio.ensure_future(want(3))
    await asyncio.sleep(0)
    t2.cancel()
    p.release(held)
    await asyncio.gather(t1, t3)
    assert order == [1, 3] and t2.cancelled()
    assert p.describe()["free"] == 1


async def test_pool_hands_slots_across_threads():
    p = _pool(1)
    s = await p.acquire()
    got = []
    th = threading.Thread(target=lambda: got.append(p.acquire_blocking()))
    th.start()
    while not p._waiters:
        await asyncio.sleep(0.001)
    waiter = asyncio.ensure_future(p.acquire())
    p.release(s)  # to the blocked thread first (it queued first)
    th.join(5)
    assert got == [s] and not waiter.done()
    threading.Thread(target=p.release, args=(got[0],)).start()  # from another thread: to this loop
    assert await asyncio.wait_for(waiter, 5) is s
    p.release(s)


async def test_through_finishes_the_wait_before_raising_cancellation():
    loop = asyncio.get_running_loop()
    inner = loop.create_future()
    done = []

    async def user():
        try:
            await cuda.through(inner)
        finally:
            done.append(inner.done())

    t = asyncio.ensure_future(user())
    await asyncio.sleep(0)
    t.cancel()
    await asyncio.sleep(0.01)
    assert not t.done()  # still waiting for the copy
    inner.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await t
    assert done == [True]


# -- no CUDA: clear errors ---------------------------------------------------------------------------------


@no_cuda
def test_pinned_empty_needs_cuda():
    with pytest.raises(DeviceError, match=r"torch.cuda.is_available\(\) is False"):
        nvme.empty(4096, like="torch", pinned=True)
    with pytest.raises(ValueError, match="like='torch'"):
        nvme.empty(4096, pinned=True)
    with pytest.raises(DeviceError):
        gpu.pin(nvme.AlignedBuffer(4096))


@no_cuda
def test_register_needs_cuda():
    with pytest.raises(DeviceError, match="needs CUDA"):
        nvme.register(torch.zeros(4))
    assert nvme.deregister(torch.zeros(4)) is False


@no_cuda
async def test_device_cuda_anywhere_raises_device_error(tmp_path):
    from aionvme.formats import load, load_safetensors, save, save_safetensors

    await save_safetensors({"w": torch.ones(3)}, tmp_path / "m.safetensors")
    await save({"w": torch.ones(3)}, tmp_path / "c.ckpt")
    for dev in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(DeviceError, match="CUDA"):
            await load_safetensors(tmp_path / "m.safetensors", device=dev)
        with pytest.raises(DeviceError, match="CUDA"):
            await load(tmp_path / "c.ckpt", device=dev)


def test_gpu_settings_are_validated():
    with pytest.raises(ValueError, match="gpu_path"):
        defaults.set(gpu_path="dma")
    with pytest.raises(ValueError, match="gpu_block_size"):
        defaults.set(gpu_block_size=1000)
    with pytest.raises(ValueError, match="two gpu_block_size"):
        defaults.set(pinned_pool="4M", gpu_block_size="4M")
    with defaults.set(gpu_path="BOUNCE", gpu_block_size="8M", pinned_pool="32M"):
        assert (defaults.get("gpu_path"), defaults.get("gpu_block_size"), defaults.get("pinned_pool")) == (
            "bounce",
            8 << 20,
            32 << 20,
        )


@no_cuda
def test_bench_gpu_says_why_it_cannot_run(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "aionvme", "bench", "--gpu", "--dir", str(tmp_path), "--size", "8M"],
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "--gpu needs a CUDA device" in r.stderr and "torch.cuda.is_available() is False" in r.stderr


@no_cuda
def test_info_has_the_gpu_fields(tmp_path):
    d = nvme.info(str(tmp_path))
    cf, g, t = d["cufile"], d["gpu"], d["gpu_transfers"]
    assert {"library", "available", "version", "mode", "reason", "candidates", "probed"} <= set(cf)
    assert g["cuda"] is False and g["devices"] == [] and g["details"] == []
    assert {"gds_requests", "bounce_requests", "files_refused", "pool", "memlock_budget", "gpu_path"} <= set(
        t
    )
    r = subprocess.run(
        [sys.executable, "-m", "aionvme", "info", str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for words in ("cuFile mode", "CUDA tensors", "pinned pool"):
        assert words in r.stdout
