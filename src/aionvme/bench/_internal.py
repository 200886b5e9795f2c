"""The only module of :mod:`aionvme.bench` that uses names private to other
aionvme modules. After the runtime restructuring, repoint these two imports
(and nothing else in the package) to their new homes.
"""

from __future__ import annotations

from .._engine import fs_type  # the statfs f_type of an open fd
from ..file import FS_NAMES  # f_type -> filesystem name

__all__ = ["FS_NAMES", "fs_type"]
