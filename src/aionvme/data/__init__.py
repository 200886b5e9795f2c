"""aionvme.data: a data loader that feeds training from NVMe.

::

    import aionvme as nvme

    await nvme.data.write_dataset("/nvme/train", samples, shard_size="1G")
    ds = nvme.data.Dataset("/nvme/train")       # also MDS shards, a directory of .npy / .safetensors
    loader = nvme.data.Loader(ds, batch_size=256, shuffle=True, seed=0, prefetch="512M")
    async for batch in loader: ...                # or a plain `for`: it reads on aionvme's background loop
    state = loader.state_dict()                   # exact resume in the middle of an epoch
    merged = nvme.data.merge_states(all_ranks_states)   # ... also at another world size

torch is imported only when tensors are made (``tensors='torch'``, the default)
or :class:`TorchIterable` is used.
"""

from __future__ import annotations

from typing import Any

from ._batch import pad_batch
from ._dataset import Dataset
from ._elastic import merge_states
from ._errors import (
    CorruptDatasetError,
    DatasetChangedError,
    DatasetError,
    LoaderStateError,
    UnsupportedDatasetError,
)
from ._loader import Loader
from ._memory import BudgetError, BudgetWarning
from ._order import epoch_order, rank_part
from ._writer import sync_write_dataset, write_dataset

__all__ = [
    "BudgetError",
    "BudgetWarning",
    "CorruptDatasetError",
    "Dataset",
    "DatasetChangedError",
    "DatasetError",
    "Loader",
    "LoaderStateError",
    "TorchIterable",
    "UnsupportedDatasetError",
    "epoch_order",
    "merge_states",
    "pad_batch",
    "rank_part",
    "sync_write_dataset",
    "write_dataset",
]


def __getattr__(name: str) -> Any:
    if name == "TorchIterable":  # imports torch: only when asked for
        from ._torch import TorchIterable

        return TorchIterable
    raise AttributeError(f"module 'aionvme.data' has no attribute {name!r}")
