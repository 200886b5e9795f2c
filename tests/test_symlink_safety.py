"""Whole-file writes and symbolic links: what a save follows, what it refuses.

Every write path (atomic_write, save, save_safetensors, the DCP writer, the
dataset writer, the store's journal) goes through aionvme.atomic, which opens
the target's directory once and follows a symbolic link as the last component
only under the kernel's fs.protected_symlinks rule, whatever the sysctl says
(it is 0 on the CI machine: the kernel itself would follow every link here).
The planted links are made by a real second user (uid 65534, ``nobody``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import aionvme as nvme
from aionvme.exceptions import UnsafeSymlinkError

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user (uid 65534)")


def _as_nobody(directory: Path, *argv: str) -> None:
    """Run argv as uid/gid 65534 in directory (entered before the uid changes:
    pytest's tmp_path parents are 0700, the directory itself is what matters)."""
    subprocess.run(list(argv), cwd=directory, user=NOBODY, group=NOBODY, extra_groups=[], check=True)


def _plant(directory: Path, name: str, target: Path) -> Path:
    _as_nobody(directory, "ln", "-s", str(target), name)
    link = directory / name
    assert link.is_symlink() and link.lstat().st_uid == NOBODY
    return link


def _victim(tmp_path: Path) -> Path:
    """A root-owned file outside the sticky directory: what the attacker aims at."""
    victim = tmp_path / "victim" / "root-only.bin"
    victim.parent.mkdir()
    victim.write_bytes(b"root's data")
    os.chmod(victim, 0o600)
    return victim


def _sticky(tmp_path: Path, owner: int = 0) -> Path:
    d = tmp_path / "sticky"
    d.mkdir()
    os.chown(d, owner, owner)
    os.chmod(d, 0o1777)  # like /tmp
    return d


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _refused(exc_info: pytest.ExceptionInfo[BaseException], link: Path) -> None:
    e = exc_info.value
    assert isinstance(e, UnsafeSymlinkError) and isinstance(e, PermissionError)
    assert isinstance(e, nvme.AionvmeError)
    assert e.errno == errno.EACCES and e.filename == str(link) and e.link_uid == NOBODY
    assert "protected_symlinks" in str(e)


# -- a link planted by another user in a sticky world-writable directory -----------------------


@needs_root
async def test_a_planted_link_in_a_sticky_directory_is_refused_by_every_save(tmp_path):
    import torch

    victim = _victim(tmp_path)
    sticky = _sticky(tmp_path)
    link = _plant(sticky, "latest.safetensors", victim)
    state = {"w": torch.ones(4)}
    attempts = [
        lambda: nvme.save_safetensors(state, link),
        lambda: nvme.save(state, link),
        lambda: asyncio.to_thread(nvme.sync_save_safetensors, state, link),
        lambda: asyncio.to_thread(nvme.sync_save, state, link),
    ]
    for attempt in attempts:
        with pytest.raises(UnsafeSymlinkError) as ei:
            await attempt()
        _refused(ei, link)
    with pytest.raises(UnsafeSymlinkError) as ei:
        async with nvme.atomic_write(link) as f:
            await f.pwrite(b"attacker's choice", 0)
    _refused(ei, link)
    with pytest.raises(UnsafeSymlinkError) as ei, nvme.atomic_write(link) as f:
        f.sync_pwrite(b"attacker's choice", 0)
    _refused(ei, link)
    # nothing replaced, nothing left behind, the link itself untouched
    assert victim.read_bytes() == b"root's data" and victim.stat().st_uid == 0
    assert _names(victim.parent) == ["root-only.bin"]
    assert _names(sticky) == ["latest.safetensors"] and os.readlink(link) == str(victim)


@needs_root
def test_a_planted_link_is_refused_by_the_dataset_and_dcp_writers(tmp_path):
    victim = _victim(tmp_path)
    sticky = _sticky(tmp_path)
    # the dataset writer's first shard
    _plant(sticky, "shard-00000.bin", victim)
    samples = [{"x": np.arange(8, dtype=np.int64)} for _ in range(4)]
    with pytest.raises(UnsafeSymlinkError):
        nvme.data.sync_write_dataset(sticky, samples)
    assert victim.read_bytes() == b"root's data"
    # DCP's metadata file, committed through atomic_write
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import aionvme.dcp

    ckpt = sticky / "ckpt"
    ckpt.mkdir()
    os.chmod(ckpt, 0o1777)
    _plant(ckpt, ".metadata", victim)
    with pytest.raises(BaseException) as ei:  # torch wraps a rank's error in its CheckpointException
        dcp.save({"w": torch.ones(4)}, storage_writer=aionvme.dcp.Writer(ckpt))
    assert isinstance(ei.value, UnsafeSymlinkError) or "UnsafeSymlinkError" in str(ei.value)
    assert victim.read_bytes() == b"root's data"


@needs_root
async def test_a_planted_link_is_refused_by_the_store_journal(tmp_path):
    # a dangling link where the store writes its first index snapshot
    sticky = _sticky(tmp_path)
    aim = tmp_path / "victim-dir"
    aim.mkdir()
    _plant(sticky, "aionvme-store.index", aim / "authorized_keys")
    with pytest.raises(UnsafeSymlinkError):
        async with nvme.TieredStore(sticky, host="1M", persist=True) as store:
            await store.put("k", np.arange(4))
    assert _names(aim) == []


@needs_root
async def test_a_planted_link_that_dangles_is_refused_and_creates_nothing(tmp_path):
    sticky = _sticky(tmp_path)
    aim = tmp_path / "victim-dir"
    aim.mkdir()
    link = _plant(sticky, "new.bin", aim / "created-by-root.bin")
    with pytest.raises(UnsafeSymlinkError):
        await nvme.save({"w": np.ones(2)}, link)
    assert _names(aim) == []


@needs_root
async def test_a_link_planted_behind_a_trusted_link_is_refused(tmp_path):
    # root's own link in /tmp-like dir -> nobody's link in another sticky dir -> victim:
    # every hop is checked, not only the first
    victim = _victim(tmp_path)
    sticky = _sticky(tmp_path)
    second = tmp_path / "second"
    second.mkdir()
    os.chmod(second, 0o1777)
    planted = _plant(second, "hop", victim)
    mine = sticky / "mine.bin"
    os.symlink(planted, mine)
    with pytest.raises(UnsafeSymlinkError) as ei:
        await nvme.save({"w": np.ones(2)}, mine)
    _refused(ei, planted)
    assert victim.read_bytes() == b"root's data"


# -- links the kernel's rule follows are written through --------------------------------------


@needs_root
@pytest.mark.parametrize(
    "case",
    ["own link in a sticky directory", "other's link, directory not sticky", "directory owner's link"],
)
async def test_links_the_rule_allows_are_written_through(tmp_path, case):
    target = tmp_path / "target.bin"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    if case == "own link in a sticky directory":
        d = _sticky(tmp_path)
        link = d / "latest.bin"
        os.symlink(target, link)
    elif case == "other's link, directory not sticky":
        d = tmp_path / "shared"
        d.mkdir()
        os.chmod(d, 0o777)  # world-writable, no sticky bit: the kernel follows any link here
        link = _plant(d, "latest.bin", target)
    else:
        d = _sticky(tmp_path, owner=NOBODY)  # nobody's own sticky directory
        link = _plant(d, "latest.bin", target)
    await nvme.save({"w": np.arange(3)}, link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (await nvme.load(target))["w"].tolist() == [0, 1, 2]
    assert target.stat().st_mode & 0o777 == 0o640
    with nvme.atomic_write(link) as f:
        f.sync_pwrite(b"raw", 0)
    assert target.read_bytes() == b"raw" and link.is_symlink()


# -- the directory is opened once --------------------------------------------------------------


def _swap_for_link(d: Path, elsewhere: Path) -> Path:
    moved = d.with_name(d.name + ".moved")
    os.rename(d, moved)
    os.symlink(elsewhere, d)
    return moved


def test_a_directory_swapped_for_a_link_during_a_sync_write_does_not_redirect_it(tmp_path):
    d, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    d.mkdir()
    elsewhere.mkdir()
    (d / "model.bin").write_bytes(b"old")
    with nvme.atomic_write(d / "model.bin") as f:
        f.sync_pwrite(b"new", 0)
        moved = _swap_for_link(d, elsewhere)
    assert (moved / "model.bin").read_bytes() == b"new"
    assert _names(moved) == ["model.bin"] and _names(elsewhere) == []


async def test_a_directory_swapped_for_a_link_during_an_async_save_does_not_redirect_it(tmp_path):
    d, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    d.mkdir()
    elsewhere.mkdir()
    w = nvme.atomic_write(d / "model.bin")
    async with w as f:
        await f.pwrite(b"new", 0)
        moved = _swap_for_link(d, elsewhere)
    assert (moved / "model.bin").read_bytes() == b"new"
    assert _names(moved) == ["model.bin"] and _names(elsewhere) == []


def test_a_link_retargeted_during_a_write_does_not_redirect_it(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    link = tmp_path / "latest.bin"
    os.symlink("a.bin", link)
    with nvme.atomic_write(link) as f:
        f.sync_pwrite(b"new", 0)
        os.unlink(link)
        os.symlink("b.bin", link)
    assert a.read_bytes() == b"new" and b.read_bytes() == b"b"


# -- shapes of links -----------------------------------------------------------------------


def test_chains_relative_and_absolute(tmp_path):
    real = tmp_path / "runs" / "3"
    real.mkdir(parents=True)
    os.symlink("runs/3/ckpt.bin", tmp_path / "rel")  # relative to the link's directory
    os.symlink(tmp_path / "rel", tmp_path / "abs")  # absolute, to another link
    w = nvme.atomic_write(tmp_path / "abs")
    with w as f:
        f.sync_pwrite(b"chain", 0)
    assert (real / "ckpt.bin").read_bytes() == b"chain"
    assert w.path == str(real / "ckpt.bin")
    assert _names(tmp_path) == ["abs", "rel", "runs"] and _names(real) == ["ckpt.bin"]


def test_a_link_loop_and_a_directory_name_are_refused_cleanly(tmp_path):
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    with pytest.raises(OSError) as ei, nvme.atomic_write(tmp_path / "a") as f:
        f.sync_pwrite(b"x", 0)
    assert ei.value.errno == errno.ELOOP
    for bad in (str(tmp_path) + "/", str(tmp_path / "."), str(tmp_path / "..")):
        with pytest.raises(IsADirectoryError), nvme.atomic_write(bad) as f:
            f.sync_pwrite(b"x", 0)
    os.symlink("sub/", tmp_path / "to-dir")
    with pytest.raises(IsADirectoryError), nvme.atomic_write(tmp_path / "to-dir") as f:
        f.sync_pwrite(b"x", 0)
    assert _names(tmp_path) == ["a", "b", "to-dir"]


def test_no_directory_descriptor_is_left_open(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        with nvme.atomic_write(tmp_path / f"f{i}.bin") as f:
            f.sync_pwrite(b"x", 0)
        with pytest.raises(RuntimeError), nvme.atomic_write(tmp_path / "g.bin") as f:
            raise RuntimeError("the block failed")
        with pytest.raises(FileNotFoundError), nvme.atomic_write(tmp_path / "missing" / "h.bin"):
            pass
    assert len(os.listdir("/proc/self/fd")) == before


def test_exclusive_create_where_o_direct_is_refused(ramfs_dir):
    # ramfs refuses O_DIRECT with EINVAL after the exclusive create made the
    # file: 'x' must open the file it made, not fail with EEXIST (the DCP
    # writer's data files and atomic_write's temporary file are made so)
    path = ramfs_dir / "new.bin"
    with nvme.open(path, "x+", direct=True) as f:
        assert not f.direct
        f.sync_pwrite(b"made once", 0)
    assert path.read_bytes() == b"made once"
    with pytest.raises(FileExistsError):
        nvme.open(path, "x", direct=True)
    link = ramfs_dir / "latest.bin"
    os.symlink("new.bin", link)
    with nvme.atomic_write(link, direct=True) as f:
        f.sync_pwrite(b"through the link", 0)
    assert path.read_bytes() == b"through the link" and link.is_symlink()
