"""aionvme.store: a tiered tensor store (GPU memory, host memory, NVMe).

::

    store = aionvme.TieredStore("/nvme/cache", host="8G")
    await store.put("layer.3.w", tensor)
    t = await store.get("layer.3.w")

See :class:`TieredStore` for placement, ownership, persistence and
concurrency; :class:`SyncTieredStore` for blocking code. As a serving
engine's KV-cache tier: ``on_full="evict"`` (a bounded cache), ``pin`` /
``unpin``, ``get_many(missing="skip")``, ``count_prefix`` and
``submit_put_many`` / ``submit_get_many`` / ``completion_fd`` for the
engine's own threads (see ``_kv.py``).
"""

from __future__ import annotations

from ._alloc import ExtentAllocator
from ._errors import (
    AttachError,
    CorruptValueError,
    JournalError,
    OutBufferError,
    StoreClosedError,
    StoreCorruptError,
    StoreError,
    StoreFullError,
    StoreKeyError,
    StoreKeyTypeError,
    StoreLockedError,
    StorePinError,
    StoreTimeoutError,
)
from ._policy import (
    Admission,
    AdmitAll,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    SecondTouch,
)
from ._store import TieredStore
from ._sync import SyncTieredStore

__all__ = [
    "Admission",
    "AdmitAll",
    "AttachError",
    "CorruptValueError",
    "EvictionPolicy",
    "ExtentAllocator",
    "JournalError",
    "LFUPolicy",
    "LRUPolicy",
    "OutBufferError",
    "S3FIFOPolicy",
    "SecondTouch",
    "StoreClosedError",
    "StoreCorruptError",
    "StoreError",
    "StoreFullError",
    "StoreKeyError",
    "StoreKeyTypeError",
    "StoreLockedError",
    "StorePinError",
    "StoreTimeoutError",
    "SyncTieredStore",
    "TieredStore",
]
