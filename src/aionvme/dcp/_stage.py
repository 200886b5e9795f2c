"""Staging for ``dcp.async_save``: a copy of the state dict in page-aligned
host memory (pinned for CUDA tensors), taken before ``async_save`` returns, so
training may go on while the copy is written with O_DIRECT, zero-copy."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ..memory import empty

__all__ = ["Stager"]


def _fresh(src: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = empty(tuple(src.shape), src.dtype, like="torch", pinned=src.device.type == "cuda")
    return out


class Stager(AsyncStager):
    """An ``AsyncStager`` whose copies live in page-aligned memory.

    ``stage(state_dict)`` returns a copy of the state dict: plain tensors and
    the local shards of DTensors (on a CPU mesh) are copied into memory from
    :func:`aionvme.empty` (pinned when the source is a CUDA tensor, so the
    device-to-host copies are DMA); ShardedTensors and DTensors on device
    meshes are staged by torch's own state-dict copy; other values are deep
    copies. With ``cache_staged_state_dict=True`` the buffers are kept and
    the next state dict of the same shapes is copied into them (a fresh
    buffer costs a page fault per 4 KiB on first touch).

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
            dst = _fresh(src)
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
