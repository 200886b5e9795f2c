"""io_uring refused: io_uring_setup fails with EPERM (a seccomp filter, as in
Docker's default profile, or kernel.io_uring_disabled) or ENOSYS. The engine
says why (Engine.uring_error); engine='auto' goes on with kernel AIO for
O_DIRECT and the worker pool for buffered files, same bytes; engine='uring'
refuses to start instead.

Each case runs in a child process: a seccomp filter cannot be removed."""

from __future__ import annotations

import errno
import json
import platform

import pytest

from .faultkit import run_python
from .test_aio_refused import SECCOMP

# io_uring_setup has the same number on every architecture.
_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NR_IO_URING_SETUP = 425

CHILD = """
import asyncio, json, sys, numpy as np
import aionvme as nvme
from aionvme._runtime import reactor as _reactor

path = sys.argv[1]
data = np.random.default_rng(2).integers(0, 256, (1 << 20) + 33, dtype=np.uint8)

async def trip():
    eng = _reactor.get_reactor().engine
    await nvme.pwrite(data, path, 3)
    out = np.zeros_like(data)
    await nvme.pread(out, path, 3)                      # O_DIRECT: kernel AIO
    back = np.zeros_like(data)
    async with nvme.open(path, direct=False) as f:      # buffered: workers, not the ring
        await f.pread(back, 3)
    s = nvme.stats()
    return dict(ok=bool(np.array_equal(out, data) and np.array_equal(back, data)),
                use_uring=eng.use_uring, uring_errno=getattr(eng.uring_error, "errno", None),
                backend=eng.backend, ring_submitted=s["ring_submitted"], thread_jobs=s["thread_jobs"])

res = asyncio.run(trip())
try:
    with nvme.defaults.set(engine="uring"):
        _reactor.new_engine()
    strict = None
except OSError as e:
    strict = e.errno
print(json.dumps(dict(res=res, strict=strict)))
"""


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EPERM])
def test_seccomp_refuses_io_uring_setup(tmp_path, err):
    arch = _ARCH.get(platform.machine())
    if arch is None:
        pytest.skip(f"no audit arch for {platform.machine()} in this test")
    code = SECCOMP + f"\nrefuse_io_setup({err}, {_NR_IO_URING_SETUP}, {arch})\n" + CHILD
    r = run_python(code, str(tmp_path / "f.bin"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    res = out["res"]
    assert res["ok"], res
    assert res["use_uring"] is False and res["uring_errno"] == err, res
    assert res["backend"] == "aio", res  # O_DIRECT stays on kernel AIO
    assert res["ring_submitted"] == 0 and res["thread_jobs"] > 0, res  # buffered: the workers
    assert out["strict"] == err  # engine='uring' means io_uring or nothing
