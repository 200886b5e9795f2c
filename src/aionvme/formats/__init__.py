"""File formats: safetensors files and checkpoints of nested state dicts,
read and written with O_DIRECT in large transfers, saved atomically and
durably."""

from __future__ import annotations

from ._checkpoint import load, release_snapshot_buffers, save, save_in_background
from ._header import SafetensorsError, SafetensorsHeader, TensorInfo, TensorNotFoundError
from ._safetensors import load_safetensors, load_safetensors_sharded, read_header, save_safetensors

__all__ = [
    "SafetensorsError",
    "SafetensorsHeader",
    "TensorInfo",
    "TensorNotFoundError",
    "load",
    "load_safetensors",
    "load_safetensors_sharded",
    "read_header",
    "release_snapshot_buffers",
    "save",
    "save_in_background",
    "save_safetensors",
]
