"""Where each weight lives: a safetensors file or a sharded directory
(``model.safetensors.index.json``) mapped to (file, byte offset, size, dtype,
shape) per tensor, from the headers alone."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

from ..formats import SafetensorsError, read_header

__all__ = ["Entry", "WeightIndex", "read_index"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: its bytes are ``[offset, offset + nbytes)`` of ``path``."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str  # torch dtype name ("float32", "bfloat16", ...)
    shape: tuple[int, ...]


@dataclass
class WeightIndex:
    """The tensors of a checkpoint by name, and the files they live in."""

    entries: dict[str, Entry]
    files: list[str]
    sizes: dict[str, int]  # file -> bytes: O_DIRECT reads are widened to blocks, but not past the end

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


def _resolve(path: str) -> tuple[list[str], dict[str, str] | None]:
    """(files, weight_map or None) for a file, a directory or an index path."""
    if os.path.isdir(path):
        idx = os.path.join(path, INDEX_NAME)
        if os.path.exists(idx):
            return _resolve(idx)
        single = os.path.join(path, SINGLE_NAME)
        if os.path.exists(single):
            return [single], None
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not found:
            raise FileNotFoundError(2, f"no {INDEX_NAME} or *.safetensors file in the directory", path)
        return [os.path.join(path, f) for f in found], None
    if path.endswith(".json"):
        try:
            with open(path, "rb") as fh:
                obj = json.loads(fh.read())
        except ValueError as e:
            raise SafetensorsError(f"index is not valid JSON: {e}", path) from None
        wm = obj.get("weight_map") if isinstance(obj, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) and v for v in wm.values()):
            raise SafetensorsError('index needs a "weight_map" object of tensor name -> shard file', path)
        base = os.path.dirname(os.path.abspath(path))
        full = {k: os.path.normpath(os.path.join(base, v)) for k, v in wm.items()}
        return sorted(set(full.values())), full
    if not os.path.exists(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    return [path], None


async def read_index(path: str | os.PathLike[str]) -> WeightIndex:
    """Read the headers of every file of the checkpoint at ``path`` (concurrently)."""
    files, weight_map = await asyncio.to_thread(_resolve, os.fspath(path))
    headers = await asyncio.gather(*(read_header(f) for f in files))
    entries: dict[str, Entry] = {}
    for f, h in zip(files, headers, strict=True):
        for name, info in h.tensors.items():
            if weight_map is not None and weight_map.get(name) != f:
                continue  # the index names another shard for it (or none): not ours
            if info.dtype.torch is None:
                raise SafetensorsError(f"dtype {info.dtype.code} has no torch dtype", f, name)
            entries[name] = Entry(
                name, f, h.data_start + info.begin, info.nbytes, info.dtype.torch, tuple(info.shape)
            )
    if weight_map is not None:
        missing = [k for k in weight_map if k not in entries]
        if missing:
            raise SafetensorsError(f"the index names tensors its shards lack: {missing[:5]}", path)
    sizes = {f: h.data_start + h.data_len for f, h in zip(files, headers, strict=True)}
    return WeightIndex(entries, files, sizes)


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)
