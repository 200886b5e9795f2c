"""A full filesystem (a 32 MiB ext4 on a loop device): writes fail with
OSError(ENOSPC) naming the file and the offset, nothing already on disk is
damaged, whole-file writes keep the old file, and the runtime goes on."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import aionvme as nvme


def _fill(fs, keep_free: int = 0) -> None:
    """Take all free space but keep_free bytes, with a file we can delete."""
    st = os.statvfs(fs.mnt)
    free = st.f_bavail * st.f_frsize - keep_free
    with open(fs.mnt / "ballast", "wb") as f:
        if free > 0:
            os.posix_fallocate(f.fileno(), 0, free)


def _tmp_names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.usefixtures("kernel_engine")
async def test_extending_write_fails_with_enospc_and_leaves_the_file_as_it_was(ext4):
    path = str(ext4.mnt / "data.bin")
    old = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    await nvme.pwrite(old, path)
    _fill(ext4, keep_free=2 << 20)
    big = nvme.empty(16 << 20)
    big[:] = 0x5A
    with pytest.raises(OSError) as ei:
        await nvme.pwrite(big, path, 4096 + 7)
    e = ei.value
    assert e.errno == errno.ENOSPC
    assert e.filename == path
    # fallocate of the range [offset, end) runs before any data chunk, so
    # the failure is reported where the write starts.
    assert e.offset == 4096 + 7
    assert "offset" in str(e) and "No space left" in str(e)
    # The file is what it was: same size (no zero-filled extension left
    # behind by the partial fallocate), same bytes.
    assert os.path.getsize(path) == old.nbytes
    assert np.array_equal(np.fromfile(path, np.uint8), old)


@pytest.mark.usefixtures("kernel_engine")
async def test_buffered_writes_fail_with_enospc_at_the_failing_chunk(ext4):
    path = str(ext4.mnt / "buffered.bin")
    _fill(ext4, keep_free=1 << 20)
    data = np.full(8 << 20, 0x33, np.uint8)
    with nvme.open(path, "w", direct=False, block_size="256K") as f:
        assert not f.direct
        with pytest.raises(OSError) as ei:
            await f.pwrite(data, 100)
            await f.fsync()
    e = ei.value
    assert e.errno == errno.ENOSPC and e.filename == path
    assert 100 <= e.offset < 100 + data.nbytes


@pytest.mark.usefixtures("kernel_engine")
async def test_batched_write_reports_enospc(ext4):
    path = str(ext4.mnt / "batch.bin")
    _fill(ext4, keep_free=1 << 20)
    items = [(nvme.empty(1 << 20), i << 21) for i in range(8)]
    with pytest.raises(OSError) as ei:
        await nvme.pwrite_many(items, path)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == path


async def test_overwrites_in_place_still_work_on_a_full_filesystem(ext4):
    path = str(ext4.mnt / "inplace.bin")
    await nvme.pwrite(nvme.empty(4 << 20), path)
    _fill(ext4)
    with pytest.raises(OSError) as ei:
        await nvme.pwrite(nvme.empty(4 << 20), path, 4 << 20)  # needs new blocks
    assert ei.value.errno == errno.ENOSPC
    new = np.random.default_rng(2).integers(0, 256, (4 << 20) - 10, dtype=np.uint8)
    assert await nvme.pwrite(new, path, 5) == new.nbytes  # blocks exist: no allocation
    back = np.zeros_like(new)
    await nvme.pread(back, path, 5)
    assert np.array_equal(back, new)
    assert os.path.getsize(path) == 4 << 20


async def test_atomic_write_on_a_full_disk_keeps_the_old_file(ext4):
    target = ext4.mnt / "ckpt.bin"
    old = os.urandom(100_000)
    target.write_bytes(old)
    _fill(ext4, keep_free=1 << 20)
    with pytest.raises(OSError) as ei:
        async with nvme.atomic_write(target) as f:
            await f.pwrite(nvme.empty(8 << 20), 0)
    assert ei.value.errno == errno.ENOSPC
    assert str(ei.value.filename).startswith(str(ext4.mnt))
    assert target.read_bytes() == old
    assert _tmp_names(ext4.mnt) == []
    # the sync form too
    with pytest.raises(OSError) as ei, nvme.atomic_write(target) as f:
        f.sync_pwrite(nvme.empty(8 << 20), 0)
    assert ei.value.errno == errno.ENOSPC
    assert target.read_bytes() == old
    assert _tmp_names(ext4.mnt) == []


@pytest.mark.usefixtures("kernel_engine")
async def test_runtime_is_usable_after_enospc(ext4, make_file):
    path = str(ext4.mnt / "x.bin")
    _fill(ext4, keep_free=1 << 20)
    for _ in range(3):
        with pytest.raises(OSError):
            await nvme.pwrite(nvme.empty(4 << 20), path)
    # other files, on another filesystem, in the same loop: fine
    other, data = make_file(3 << 20)
    buf = nvme.empty(3 << 20)
    await nvme.pread(buf, other)
    assert np.array_equal(buf, data)
    # space freed: the same write now succeeds
    os.unlink(ext4.mnt / "ballast")
    payload = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    assert await nvme.pwrite(payload, path) == payload.nbytes
    await nvme.fsync(path)
    assert np.array_equal(np.fromfile(path, np.uint8), payload)
    s = nvme.stats()
    assert s["live_requests"] == 0 and s["inflight"] == 0


def test_optimizer_state_a_full_disk_did_not_save_is_never_read_back_stale(ext4):
    # The first step writes the state of every chunk; the 32 MiB filesystem
    # takes only part of it. The step raises the disk's ENOSPC, and every
    # later use of the state raises StateLostError instead of stepping on
    # state that was never saved (or, with the store, an older copy of it).
    torch = pytest.importorskip("torch")
    from aionvme.offload import Optimizer, StateLostError

    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(6)]  # AdamW state: 48 MiB
    opt = Optimizer(torch.optim.AdamW, params, ext4.mnt, lr=1e-3, budget="8M", backend="file")
    try:
        for p in params:
            p.grad = torch.ones_like(p)
        with pytest.raises(OSError) as ei:
            opt.step()
        assert ei.value.errno == errno.ENOSPC and ei.value.filename is not None
        before = [p.detach().clone() for p in params]
        with pytest.raises(StateLostError) as lost:
            opt.step()
        assert isinstance(lost.value.__cause__, OSError) and lost.value.__cause__.errno == errno.ENOSPC
        assert all(torch.equal(a, p) for a, p in zip(before, params))  # refused before any update
        with pytest.raises(StateLostError):
            opt.state_dict()
    finally:
        opt.close()
