"""Property test: random sequences of pread / pwrite / pread_many /
pwrite_many (and their blocking forms) with sizes from 0 up, offsets aligned
and not, buffers aligned and not, on O_DIRECT and buffered files, with the
kernel-AIO and the worker-pool engine, on asyncio and uvloop, against a
bytearray model of the file. Every read matches the model as it goes (a read
past the end is a ShortReadError saying exactly how much arrived); at the end
the file's size and bytes are the model's."""

from __future__ import annotations

import asyncio
import os
import tempfile

import numpy as np
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aionvme as nvme

PAGE = 4096
OPS = ["pread", "pwrite", "pread_many", "pwrite_many", "sync_pread", "sync_pwrite", "concurrent"]

offsets = st.one_of(
    st.integers(0, 64).map(lambda k: k * PAGE),  # aligned
    st.integers(0, 300_000),  # anywhere, past the end too
)
sizes = st.one_of(st.sampled_from([0, 1, 511, 512, 513, 4095, 4096, 4097, 8192]), st.integers(0, 150_000))
shifts = st.sampled_from([0, 1, 511, 512, 4095])  # buffer address past a page boundary
steps = st.lists(st.tuples(st.sampled_from(OPS), offsets, sizes, shifts), min_size=1, max_size=12)


def _buf(n: int, shift: int) -> np.ndarray:
    return nvme.empty(n + shift)[shift : shift + n]


class Model:
    def __init__(self, initial: bytes) -> None:
        self.data = bytearray(initial)

    def write(self, off: int, payload: bytes) -> None:
        if not payload:
            return  # pwrite(2) of nothing changes nothing, not even the size
        if off > len(self.data):
            self.data.extend(bytes(off - len(self.data)))
        self.data[off : off + len(payload)] = payload

    def expect(self, off: int, n: int) -> bytes:
        return bytes(self.data[off : off + n])


async def _transfer(f, op: str, buf: np.ndarray, off: int) -> int:
    """op as named in OPS; the batch forms split buf in two items, out of order."""
    h = buf.nbytes // 3
    if op in ("pread", "pwrite"):
        return await getattr(f, op)(buf, off)
    if op in ("pread_many", "pwrite_many"):
        return await getattr(f, op)([(buf[h:], off + h), (buf[:h], off)])
    # the blocking forms, from a thread: on the loop's thread they raise BlockingCallError
    return await asyncio.to_thread(getattr(f, op), buf, off)


def _check_read(model: Model, buf: np.ndarray, off: int, result: object) -> None:
    want = model.expect(off, buf.nbytes)
    if isinstance(result, nvme.ShortReadError):
        assert len(want) < buf.nbytes, f"short read inside the file: {result}"
        if result.segment is None:
            assert result.received == len(want), (result, len(want))
        assert buf.tobytes()[: len(want)] == want
        return
    assert result == buf.nbytes, result
    assert buf.tobytes() == want


async def _run(path: str, initial: bytes, seq, direct: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = Model(initial)
    with nvme.open(path, "r+", direct=direct, block_size="64K") as f:
        for op, off, n, shift in seq:
            buf = _buf(n, shift)
            if op == "concurrent":
                # four byte-disjoint transfers at once around `off`: writes
                # (which may extend the file) interleaved with reads
                ranges = [(off + i * (n + 37), n) for i in range(4)]
                bufs = [_buf(n, (shift + i) % PAGE) for i in range(4)]
                old_size = len(model.data)
                futs = []
                for i, ((o, m), b) in enumerate(zip(ranges, bufs)):
                    if i % 2 == 0:
                        b[:] = rng.integers(0, 256, m, dtype=np.uint8)
                        futs.append(f.pwrite(b, o))
                    else:
                        b[:] = 0xEE
                        futs.append(f.pread(b, o))
                res = await asyncio.gather(*futs, return_exceptions=True)
                for i, ((o, m), b) in enumerate(zip(ranges, bufs)):
                    if i % 2 == 0:
                        assert res[i] == m, res[i]
                        model.write(o, b.tobytes())
                for i, ((o, m), b) in enumerate(zip(ranges, bufs)):
                    if i % 2:
                        # below the old end the bytes are certain (no write
                        # touches them); past it a racing write may or may
                        # not have extended the file yet
                        k = max(0, min(m, old_size - o))
                        r = res[i]
                        if isinstance(r, nvme.ShortReadError):
                            assert r.received >= k, (r, k)
                        else:
                            assert r == m, r
                        assert b.tobytes()[:k] == model.expect(o, k)
                continue
            if op.endswith(("pread", "pread_many")):
                buf[:] = 0xEE
                try:
                    res: object = await _transfer(f, op, buf, off)
                except nvme.ShortReadError as e:
                    res = e
                _check_read(model, buf, off, res)
            else:
                buf[:] = rng.integers(0, 256, n, dtype=np.uint8)
                assert await _transfer(f, op, buf, off) == n
                model.write(off, buf.tobytes())
        assert f.size() == len(model.data)
    with open(path, "rb") as raw:
        assert raw.read() == bytes(model.data)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("property"))


# AIONVME_PROPERTY_EXAMPLES=2000 for a deeper run than CI's
EXAMPLES = int(os.environ.get("AIONVME_PROPERTY_EXAMPLES", "150"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq=steps,
    initial=st.integers(0, 200_000),
    direct=st.booleans(),
    engine=st.sampled_from(["auto", "thread"]),
    loop=st.sampled_from(["asyncio", "uvloop"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_io_matches_a_model(scratch, seq, initial, direct, engine, loop, seed):
    fd, path = tempfile.mkstemp(dir=scratch)
    try:
        data = np.random.default_rng(seed ^ 1).integers(0, 256, initial, dtype=np.uint8).tobytes()
        os.write(fd, data)
        os.close(fd)
        with nvme.defaults.set(engine=engine):
            coro = _run(path, data, seq, direct, seed)
            uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)
    finally:
        os.unlink(path)
