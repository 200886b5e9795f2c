"""Saves under real faults, on small loop-mounted filesystems (root only):
a disk that fills up midway, and a simulated power loss (an XFS shutdown that
drops everything not yet in the journal, then unmount and mount). What
nvme.save returned from survives; a save cut short leaves the previous file
whole."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import aionvme as nvme

torch = pytest.importorskip("torch")


def _sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True)


class LoopFs:
    """A filesystem in a sparse image file, loop-mounted at ``mnt``."""

    def __init__(self, tmp_path, mkfs: list[str], size: int):
        if os.geteuid() != 0:
            pytest.skip("needs root to mount a loop device")
        if not shutil.which(mkfs[0]):
            pytest.skip(f"needs {mkfs[0]}")
        self.image, self.mnt = tmp_path / "fs.img", tmp_path / "mnt"
        self.mnt.mkdir()
        with open(self.image, "wb") as f:
            f.truncate(size)
        r = _sh(*mkfs, str(self.image))
        if r.returncode:
            pytest.skip(f"{mkfs[0]} failed: {r.stderr.strip()}")
        self.mount()

    def mount(self):
        r = _sh("mount", "-o", "loop", str(self.image), str(self.mnt))
        if r.returncode:
            pytest.skip(f"cannot loop-mount: {r.stderr.strip()}")

    def crash(self):
        """Shut down without flushing the log (like pulling the plug), remount."""
        r = _sh("xfs_io", "-x", "-c", "shutdown", str(self.mnt))
        assert r.returncode == 0, r.stderr
        assert _sh("umount", str(self.mnt)).returncode == 0
        self.mount()

    def files(self):
        return sorted(p.name for p in self.mnt.iterdir() if p.name != "lost+found")


@pytest.fixture
def small_ext4(tmp_path):
    fs = LoopFs(tmp_path, ["mkfs.ext4", "-q", "-F"], 48 << 20)
    yield fs
    _sh("umount", "-l", str(fs.mnt))


@pytest.fixture
def xfs(tmp_path):
    if not shutil.which("xfs_io"):
        pytest.skip("needs xfs_io (xfsprogs)")
    fs = LoopFs(tmp_path, ["mkfs.xfs", "-q", "-f"], 320 << 20)  # mkfs.xfs wants 300 MiB
    yield fs
    _sh("umount", "-l", str(fs.mnt))


def checkpoint(seed, n=1 << 20):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g)}, "step": seed}


def same(a, b):
    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


async def test_disk_full_midway_keeps_the_old_file(small_ext4):
    path = small_ext4.mnt / "m.safetensors"
    await nvme.save(checkpoint(1, 2 << 20), path)  # 8 MiB
    old = path.read_bytes()
    with pytest.raises(OSError) as err:
        await nvme.save(checkpoint(2, 10 << 20), path)  # 40 MiB: more than is left
    assert err.value.errno == 28  # ENOSPC
    assert path.read_bytes() == old
    assert small_ext4.files() == ["m.safetensors"]
    assert same(await nvme.load(path), checkpoint(1, 2 << 20))


async def test_a_returned_save_survives_a_crash(xfs):
    path = xfs.mnt / "ckpt.safetensors"
    await nvme.save(checkpoint(1), path)
    await nvme.save(checkpoint(2), path)
    xfs.crash()
    assert same(await nvme.load(path), checkpoint(2))
    assert xfs.files() == ["ckpt.safetensors"]


async def test_a_background_save_survives_once_its_task_is_done(xfs):
    path = xfs.mnt / "ckpt.safetensors"
    await (await nvme.save_in_background(checkpoint(3), path))
    xfs.crash()
    assert same(await nvme.load(path), checkpoint(3))


async def test_a_crash_during_save_keeps_the_previous_checkpoint(xfs, monkeypatch):
    path = xfs.mnt / "ckpt.safetensors"
    await nvme.save(checkpoint(1), path)
    from aionvme.formats import _safetensors

    real = _safetensors.write_segments

    async def write_then_crash(f, header, placed):
        await real(f, header, placed)  # the new content is written, not yet fsynced or renamed
        _sh("xfs_io", "-x", "-c", "shutdown", str(xfs.mnt))

    monkeypatch.setattr(_safetensors, "write_segments", write_then_crash)
    with pytest.raises(OSError):
        await nvme.save(checkpoint(2), path)
    monkeypatch.undo()
    assert _sh("umount", str(xfs.mnt)).returncode == 0
    xfs.mount()
    assert same(await nvme.load(path), checkpoint(1))
