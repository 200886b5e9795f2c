"""Checkpoints across a simulated power loss: an XFS shutdown that drops
everything not yet in the journal, then unmount and mount (log recovery).
What nvme.save returned from survives; a save cut short leaves the previous
checkpoint whole."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import aionvme as nvme

torch = pytest.importorskip("torch")


def _sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True)


class Xfs:
    def __init__(self, image, mnt):
        self.image, self.mnt = image, mnt

    def mount(self):
        r = _sh("mount", "-o", "loop", str(self.image), str(self.mnt))
        if r.returncode:
            pytest.skip(f"cannot loop-mount xfs: {r.stderr.strip()}")

    def crash(self):
        """Shut down without flushing the log (like pulling the plug), remount."""
        r = _sh("xfs_io", "-x", "-c", "shutdown", str(self.mnt))
        assert r.returncode == 0, r.stderr
        assert _sh("umount", str(self.mnt)).returncode == 0
        self.mount()


@pytest.fixture
def xfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a loop device")
    if not (shutil.which("mkfs.xfs") and shutil.which("xfs_io")):
        pytest.skip("needs xfsprogs (mkfs.xfs, xfs_io)")
    image, mnt = tmp_path / "xfs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(320 << 20)  # sparse; mkfs.xfs wants 300 MiB
    r = _sh("mkfs.xfs", "-q", "-f", str(image))
    if r.returncode:
        pytest.skip(f"mkfs.xfs failed: {r.stderr.strip()}")
    fs = Xfs(image, mnt)
    fs.mount()
    try:
        yield fs
    finally:
        _sh("umount", "-l", str(mnt))


def checkpoint(seed):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(7, generator=g)}, "step": seed}


def same(a, b):
    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


async def test_a_returned_save_survives_a_crash(xfs):
    path = xfs.mnt / "ckpt.safetensors"
    await nvme.save(checkpoint(1), path)
    await nvme.save(checkpoint(2), path)
    xfs.crash()
    assert same(await nvme.load(path), checkpoint(2))
    assert [p.name for p in xfs.mnt.iterdir()] == ["ckpt.safetensors"]


async def test_a_background_save_survives_once_its_task_is_done(xfs):
    path = xfs.mnt / "ckpt.safetensors"
    await nvme.save_in_background(checkpoint(3), path)
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
