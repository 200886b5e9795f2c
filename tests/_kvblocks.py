"""What the KV-cache tests of the store share (issue 35): blocks of bytes
by key, and what the slab files take on disk."""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

KiB = 1 << 10
MiB = 1 << 20


def block(key: object, n: int = 64 * KiB) -> np.ndarray:
    """The bytes of a KV block: distinct per key and size."""
    seed = zlib.crc32(repr(key).encode())
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)


def disk_bytes(store: Any) -> int:
    """What a store's slab files take on disk (st_blocks), not their apparent
    size; ``store`` a TieredStore or a SyncTieredStore."""
    aio = getattr(store, "aio", store)
    return sum(os.stat(s.path).st_blocks * 512 for s in aio._nvme.slabs)


def nvme_for(data: int) -> int:
    """The smallest ``nvme=`` of a one-directory cache whose tier holds
    ``data`` bytes (it keeps a part for the filesystem's blocks of the slab)."""
    from aionvme.store._kv import cache_capacity

    n = data
    while (cache_capacity("evict", n, n, 1) or 0) < data:
        n += 4096
    return n
