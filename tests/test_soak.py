"""Soak: 10,000+ reads and writes of random sizes (0 to 300 KiB), offsets and
buffer alignments, issued in concurrent waves through every entry point,
checked against an in-memory model of the file: every read on arrival, the
whole file by per-4-KiB-block checksums every few waves and at the end.
Writes in one wave never share a byte (their order would be undefined) but
do share blocks, so read-modify-writes of one block race each other; some
extend the file. Runs on asyncio and on uvloop."""

from __future__ import annotations

import asyncio
import random
import zlib

import numpy as np

import aionvme as nvme

BLOCK = 4096
SIZE = 24 << 20  # initial file size
GROW = 2 << 20  # writes may extend the file up to SIZE + GROW
OPS = 10_000
WAVE = 250


def _buffer(rnd: random.Random, n: int) -> np.ndarray:
    kind = rnd.randrange(4)
    if kind == 0:
        return nvme.empty(n)  # page-aligned: zero-copy
    if kind == 1:
        return np.zeros(n, np.uint8)  # whatever malloc gives
    shift = rnd.choice([1, 7, 512, 2048, 4095])
    return nvme.empty(n + shift)[shift : shift + n]  # deliberately misaligned


def _issue(f: nvme.File, path: str, write: bool, via: int, buf: np.ndarray, off: int):  # type: ignore[no-untyped-def]
    """One transfer through one of the entry points: File, path, or a batch of two."""
    if via == 0:
        return f.pwrite(buf, off) if write else f.pread(buf, off)
    if via == 1:
        return nvme.pwrite(buf, path, off) if write else nvme.pread(buf, path, off)
    half = buf.nbytes // 2
    items = [(buf[:half], off), (buf[half:], off + half)]
    return f.pwrite_many(items) if write else f.pread_many(items)


def _checksums(a: np.ndarray) -> list[int]:
    return [zlib.crc32(a[i : i + BLOCK]) for i in range(0, a.nbytes, BLOCK)]


def _bad_blocks(path: str, model: np.ndarray, size: int) -> list[int]:
    disk = np.fromfile(path, np.uint8)
    assert disk.nbytes == size, f"file is {disk.nbytes} bytes, the model {size}"
    return [i for i, (a, b) in enumerate(zip(_checksums(disk), _checksums(model[:size]))) if a != b]


async def test_soak_against_a_model(tmp_dir):
    rnd = random.Random(20240611)
    path = str(tmp_dir / "soak.bin")
    model = np.zeros(SIZE + GROW, np.uint8)
    model[:SIZE] = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    model[:SIZE].tofile(path)
    size = SIZE
    counts = {"read": 0, "write": 0, "short": 0}
    f = nvme.open(path, "r+", block_size=rnd.choice(["64K", "256K", "1M"]))
    try:
        done = 0
        wave_no = 0
        while done < OPS:
            taken: list[tuple[int, int]] = []  # byte ranges written in this wave
            reads: list[tuple[int, int]] = []
            futs = []
            checks = []  # (kind, buffer or items, offset, size at issue)
            for _ in range(WAVE):
                n = rnd.choice([0, 1, 17, 511, 4096, 4097, 65536, rnd.randrange(0, 300_000)])
                write = rnd.random() < 0.5
                limit = size + GROW // 2 if write else size + 8192
                off = rnd.randrange(0, max(1, min(limit, SIZE + GROW) - n))
                if off % 3 == 0:
                    off -= off % BLOCK  # a good share of aligned offsets
                lo, hi = off, off + n
                if write and (any(a < hi and lo < b for a, b in taken + reads)):
                    continue
                if not write and any(a < hi and lo < b for a, b in taken):
                    continue
                buf = _buffer(rnd, n)
                if write:
                    buf[:] = np.frombuffer(rnd.randbytes(n), np.uint8)
                    taken.append((lo, hi))
                    model[lo:hi] = buf
                    checks.append(("write", buf, off, None))
                else:
                    reads.append((lo, hi))
                    checks.append(("read", buf, off, size))
                futs.append(_issue(f, path, write, rnd.randrange(3), buf, off))
            results = await asyncio.gather(*futs, return_exceptions=True)
            for (kind, buf, off, size_then), res in zip(checks, results):
                n = buf.nbytes
                if kind == "write":
                    assert res == n, res
                    if n:  # an empty write extends nothing, as pwrite(2)
                        size = max(size, off + n)
                    counts["write"] += 1
                    continue
                counts["read"] += 1
                want = max(0, min(n, size_then - off))
                if isinstance(res, nvme.ShortReadError):
                    counts["short"] += 1
                    assert want < n, f"short read inside the file: {res}"
                    got = res.received if res.segment is None else None
                    if got is not None:
                        assert got == want, (res, want)
                    # batches report the first short item; the model says the rest
                    want_bytes = model[off : off + want]
                    assert np.array_equal(buf[:want], want_bytes), f"read at {off}: bytes differ"
                    continue
                assert not isinstance(res, BaseException), res
                assert res == n and want == n, (res, n, want)
                assert np.array_equal(buf, model[off : off + n]), f"read of {n} at {off}: bytes differ"
            done += len(futs)
            wave_no += 1
            if wave_no % 10 == 0:
                assert _bad_blocks(path, model, size) == []
    finally:
        f.close()
    bad = _bad_blocks(path, model, size)
    assert bad == [], f"{len(bad)} blocks differ from the model, first at {bad[0] * BLOCK}"
    assert counts["read"] + counts["write"] >= OPS
    s = nvme.stats()
    assert s["live_requests"] == 0 and s["inflight"] == 0
    print(counts, "file", size)
