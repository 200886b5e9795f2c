"""torch.distributed.checkpoint storage on aionvme.

::

    import torch.distributed.checkpoint as dcp, aionvme.dcp
    dcp.save(state_dict, storage_writer=aionvme.dcp.Writer("/nvme/ckpt/step100"))
    dcp.load(state_dict, storage_reader=aionvme.dcp.Reader("/nvme/ckpt/step100"))
    fut = dcp.async_save(state_dict, storage_writer=aionvme.dcp.Writer("/nvme/ckpt/step200"))

Checkpoints are in the format of torch's ``FileSystemWriter``: each loads with
either reader. In a process group the directory may be each node's own disk:
``Writer(path, replicas=2)`` keeps every rank's data on two nodes, and
``Reader(path)`` fetches what its node lacks from the others, at any world
size. This module imports torch and torch.distributed; ``import
aionvme`` does not import it.
"""

from __future__ import annotations

from ._dist import CheckpointBusyError, CheckpointMissingError, CheckpointPeerError
from ._reader import CheckpointFormatError, Reader
from ._stage import Stager
from ._writer import Writer

__all__ = [
    "CheckpointBusyError",
    "CheckpointFormatError",
    "CheckpointMissingError",
    "CheckpointPeerError",
    "Reader",
    "Stager",
    "Writer",
]
