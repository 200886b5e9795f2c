"""Staging for ``dcp.async_save``: a copy of the state dict in page-aligned
host memory (pinned for CUDA tensors), taken before ``async_save`` returns, so
training may go on while the copy is written with O_DIRECT, zero-copy."""

from __future__ import annotations

import contextlib
import copy
import mmap
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ..memory import empty

__all__ = ["Stager", "small_pages"]


def small_pages(src: torch.Tensor) -> torch.Tensor:
    """Page-aligned CPU memory (zero-filled) shaped like ``src``, for a copy
    that is touched once: an anonymous mapping of 4 KiB pages. A fresh
    transparent huge page can cost more than its 512 small faults, where the
    kernel must find (and, in a VM, the host must back) a free 2 MiB block:
    2-5x the system time on the VM this was measured on, and worse with
    several ranks faulting at once."""
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        return torch.empty(tuple(src.shape), dtype=src.dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # a hint
        m.madvise(mmap.MADV_NOHUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping until the last view goes
    return raw.view(src.dtype).reshape(tuple(src.shape))


def _fresh(src: torch.Tensor, kept: bool) -> torch.Tensor:
    if src.device.type == "cuda" or kept:  # pinned, or filled again in every save: huge pages pay off
        out: torch.Tensor = empty(tuple(src.shape), src.dtype, like="torch", pinned=src.device.type == "cuda")
        return out
    return small_pages(src)


def _copy_threads() -> int:
    """Threads for the staging copies: torch's intra-op count, capped at this
    process's share of the CPUs it may run on when ``LOCAL_WORLD_SIZE`` (set
    by torchrun) ranks share the machine."""
    threads = torch.get_num_threads()
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return threads
    if local <= 1:
        return threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(threads, cpus // local))


@contextlib.contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Stager(AsyncStager):
    """An ``AsyncStager`` whose copies live in page-aligned memory.

    ``stage(state_dict)`` returns a copy of the state dict: plain tensors and
    the local shards of DTensors (on a CPU mesh) are copied into memory from
    :func:`aionvme.empty` (pinned when the source is a CUDA tensor, so the
    device-to-host copies are DMA); ShardedTensors and DTensors on device
    meshes are staged by torch's own state-dict copy; other values are deep
    copies. With ``cache_staged_state_dict=True`` the buffers are kept and
    the next state dict of the same shapes is copied into them (a fresh
    buffer costs a page fault per page on first touch, which is most of the
    time a staging copy takes).

    The copies use torch's intra-op threads; when ``LOCAL_WORLD_SIZE`` says
    several ranks share this machine, each uses at most its share of the
    CPUs (``len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE``, at least 1)
    for the duration of :meth:`stage`, since all of them stage at once.

    ``last_stage_seconds`` is how long the last :meth:`stage` took: the time
    ``dcp.async_save`` blocks its caller, less the thread start.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, cache_staged_state_dict: bool = False) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self._cache: dict[tuple[Any, ...], torch.Tensor] = {}
        self.last_stage_seconds = 0.0
        self._cuda: set[torch.device] = set()

    def _tensor(self, src: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        src = src.detach()
        dst = self._cache.get(path) if self.cache_staged_state_dict else None
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            dst = _fresh(src, self.cache_staged_state_dict)
            if self.cache_staged_state_dict:
                self._cache[path] = dst
        if src.device.type == "cuda":
            self._cuda.add(src.device)
            dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
        return dst

    def _stage(self, obj: Any, path: tuple[Any, ...]) -> Any:
        from torch.distributed._shard.sharded_tensor.api import ShardedTensor
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            if obj.device_mesh.device_type == "cpu":
                local = self._tensor(obj.to_local(), path)
                return DTensor.from_local(
                    local,
                    obj.device_mesh,
                    obj.placements,
                    run_check=False,
                    shape=obj.size(),
                    stride=obj.stride(),
                )
            return self._torch_stage(obj)
        if isinstance(obj, ShardedTensor):
            return self._torch_stage(obj)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, dict):
            staged = {k: self._stage(v, (*path, k)) for k, v in obj.items()}
            return staged if type(obj) is dict else type(obj)(staged)
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(self._stage(v, (*path, i)) for i, v in enumerate(obj))
        try:
            return copy.deepcopy(obj)
        except Exception:  # not copyable: DCP pickles it later, as torch's stagers leave it
            return obj

    @staticmethod
    def _torch_stage(obj: Any) -> Any:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        holder = {"v": obj}
        staged = _create_cpu_state_dict(holder)
        _copy_state_dict(holder, staged)
        return staged["v"]

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override,unused-ignore]
        """A copy of ``state_dict`` that later changes to it do not reach."""
        t0 = time.perf_counter()
        self._cuda.clear()
        with _intra_op_threads(_copy_threads()):
            out = self._stage(state_dict, ())
        for dev in self._cuda:
            torch.cuda.synchronize(dev)
        self.last_stage_seconds = time.perf_counter() - t0
        staged: dict[str, Any] = out
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns when the copy is complete."""

    def close(self) -> None:
        """Drop the cached staging buffers."""
        self._cache.clear()
