"""The loader where torch code expects an IterableDataset or a DataLoader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch.utils.data

__all__ = ["TorchIterable"]


class _Resumable(Protocol):
    """What TorchIterable needs of a loader (a :class:`~aionvme.data.Loader`;
    named by its methods, so this module does not import the loader's)."""

    def __iter__(self) -> Iterator[dict[str, Any]]: ...
    def __len__(self) -> int: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def set_epoch(self, epoch: int) -> None: ...


class TorchIterable(torch.utils.data.IterableDataset):  # type: ignore[misc,type-arg,unused-ignore]
    """A ``torch.utils.data.IterableDataset`` yielding the loader's batches.

    Batching, shuffling and rank splitting are the loader's, so wrap it in a
    DataLoader without its own batching and without worker processes::

        dl = torch.utils.data.DataLoader(loader.as_torch(), batch_size=None, num_workers=0)

    ``state_dict``/``load_state_dict``/``set_epoch`` go to the loader.

    Notes
    -----
    Worker processes would each run a copy of the loader and read every
    sample once per worker; iterating in a worker raises instead.
    """

    def __init__(self, loader: _Resumable) -> None:
        super().__init__()
        self.loader = loader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise RuntimeError("aionvme.data.TorchIterable reads in the main process: use num_workers=0")
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
