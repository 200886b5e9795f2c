"""What :mod:`aionvme.bench` needs of the runtime's file-opening policy: the
filesystem of an open fd, named by the one table the runtime decides with."""

from __future__ import annotations

from .._engine import fs_type  # the statfs f_type of an open fd
from .._runtime.opening import FS_NAMES, is_memory_fs  # f_type -> filesystem name

__all__ = ["FS_NAMES", "fs_type", "is_memory_fs"]
