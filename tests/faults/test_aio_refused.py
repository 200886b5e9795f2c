"""Kernel AIO refused: io_setup fails with ENOSYS or EPERM (a seccomp filter,
as in locked-down containers and gVisor) or EAGAIN (fs.aio-max-nr used up).
The worker pool then serves everything, same API, same bytes; the engine
says why (Engine.aio_error), and engine='aio' refuses to start instead.

Each case runs in a child process: the seccomp filter cannot be removed once
installed, and a crash there fails the test instead of killing pytest."""

from __future__ import annotations

import errno
import json
import platform

import pytest

from .faultkit import child_env, run_python

# io_setup's number and the audit arch for the filter, per architecture.
_ARCH = {"x86_64": (206, 0xC000003E), "aarch64": (0, 0xC00000B7)}

SECCOMP = """
import ctypes, struct
def refuse_io_setup(err, nr, arch):
    # A classic-BPF seccomp filter: io_setup -> -err; everything else allowed.
    LD_ABS, JEQ, RET = 0x20, 0x15, 0x06
    prog = [(LD_ABS, 0, 0, 4), (JEQ, 0, 3, arch), (LD_ABS, 0, 0, 0), (JEQ, 0, 1, nr),
            (RET, 0, 0, 0x00050000 | err), (RET, 0, 0, 0x7FFF0000)]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw)
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    fp = ctypes.create_string_buffer(fprog)
    if libc.prctl(22, 2, ctypes.addressof(fp), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
"""

# Round trips on asyncio, uvloop and the sync API with whatever engines the
# child has; prints one JSON line with what it saw.
ROUND_TRIPS = """
import asyncio, json, os, sys, numpy as np, uvloop
import aionvme as nvme
from aionvme._runtime import blocking as _sync
from aionvme._runtime import reactor as _reactor

path = sys.argv[1]
data = np.random.default_rng(1).integers(0, 256, (3 << 20) + 77, dtype=np.uint8)

async def trip(tag):
    eng = _reactor.get_reactor().engine
    await nvme.pwrite(data, path, 5)
    out = np.zeros_like(data)
    await nvme.pread(out, path, 5)
    small = [np.zeros(1000, np.uint8) for _ in range(200)]
    async with nvme.open(path) as f:
        await asyncio.gather(*(f.pread(b, 5 + i * 997) for i, b in enumerate(small)))
        assert f.direct, f.info
    ok = np.array_equal(out, data) and all(
        np.array_equal(b, data[i * 997 : i * 997 + 1000]) for i, b in enumerate(small))
    s = nvme.stats()
    return dict(loop=tag, ok=bool(ok), use_aio=eng.use_aio, thread_jobs=s["thread_jobs"],
                submitted=s["submitted"], aio_errno=getattr(eng.aio_error, "errno", None))

results = [asyncio.run(trip("asyncio")), uvloop.run(trip("uvloop"))]
with nvme.open(path, "r+") as f:
    eng = _sync.thread_engine()
    f.sync_pwrite(data[:4097], 1)
    back = np.zeros(4097, np.uint8)
    f.sync_pread(back, 1)
    results.append(dict(loop="sync", ok=bool(np.array_equal(back, data[:4097])),
                        use_aio=eng.use_aio, aio_errno=getattr(eng.aio_error, "errno", None),
                        thread_jobs=eng.stats()["thread_jobs"], submitted=eng.stats()["submitted"]))
# engine='aio' means kernel AIO or nothing: it must raise, with the errno
try:
    with nvme.defaults.set(engine="aio"):
        _reactor.new_engine()
    strict = None
except OSError as e:
    strict = e.errno
print(json.dumps(dict(results=results, strict=strict)))
"""


def _check(r, want_errno: int) -> None:
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for res in out["results"]:
        assert res["ok"], res
        assert res["use_aio"] is False, res
        assert res["aio_errno"] == want_errno, res
        assert res["thread_jobs"] > 0 and res["submitted"] == 0, res  # no iocb ever submitted
    assert out["strict"] == want_errno


def _arch() -> tuple[int, int]:
    m = platform.machine()
    if m not in _ARCH:
        pytest.skip(f"no io_setup syscall number for {m} in this test")
    return _ARCH[m]


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EPERM])
def test_seccomp_refuses_io_setup(tmp_path, err):
    nr, arch = _arch()
    code = SECCOMP + f"\nrefuse_io_setup({err}, {nr}, {arch})\n" + ROUND_TRIPS
    _check(run_python(code, str(tmp_path / "f.bin")), err)


def test_seccomp_filter_really_refuses(tmp_path):
    # The filter itself, checked without aionvme: io_setup gives the errno.
    nr, arch = _arch()
    code = (
        SECCOMP
        + f"""
refuse_io_setup(1, {nr}, {arch})
from aionvme._engine import aio_probe
e = aio_probe()
print(e.errno if e is not None else "works")
"""
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(errno.EPERM)


def test_aio_max_nr_exhausted(tmp_path, aio_max_nr):
    # fs.aio-max-nr is machine-wide: the child sets it to 0 only around each
    # io_setup it makes (microseconds) and puts it back at once; the fixture
    # restores it again whatever happens.
    wrapper = """
from pathlib import Path
from aionvme._runtime import reactor as _reactor
knob = Path("/proc/sys/fs/aio-max-nr")
saved = knob.read_text()
_real = _reactor.Engine
def _made_while_exhausted(*args, **kwargs):
    knob.write_text("0")
    try:
        return _real(*args, **kwargs)
    finally:
        knob.write_text(saved)
_reactor.Engine = _made_while_exhausted
"""
    _check(run_python(wrapper + ROUND_TRIPS, str(tmp_path / "g.bin")), errno.EAGAIN)


def test_thread_engine_by_request(tmp_path):
    r = run_python(ROUND_TRIPS, str(tmp_path / "h.bin"), env=child_env(AIONVME_ENGINE="thread"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for res in out["results"]:
        assert res["ok"] and res["use_aio"] is False and res["aio_errno"] is None, res
        assert res["submitted"] == 0 and res["thread_jobs"] > 0, res
