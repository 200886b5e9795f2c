"""File formats: safetensors files and checkpoints of nested state dicts,
read and written with O_DIRECT in large transfers, saved atomically and
durably."""

from __future__ import annotations

from ._checkpoint import (
    BackgroundSave,
    load,
    release_snapshot_buffers,
    save,
    save_in_background,
    sync_load,
    sync_save,
    sync_save_in_background,
)
from ._header import SafetensorsError, SafetensorsHeader, TensorInfo, TensorNotFoundError
from ._safetensors import (
    load_safetensors,
    load_safetensors_sharded,
    read_header,
    save_safetensors,
    sync_load_safetensors,
    sync_save_safetensors,
)
from ._tensors import TorchNotInstalledError

__all__ = [
    "BackgroundSave",
    "SafetensorsError",
    "SafetensorsHeader",
    "TensorInfo",
    "TensorNotFoundError",
    "TorchNotInstalledError",
    "load",
    "load_safetensors",
    "load_safetensors_sharded",
    "read_header",
    "release_snapshot_buffers",
    "save",
    "save_in_background",
    "save_safetensors",
    "sync_load",
    "sync_load_safetensors",
    "sync_save",
    "sync_save_in_background",
    "sync_save_safetensors",
]
