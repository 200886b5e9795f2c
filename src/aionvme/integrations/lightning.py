"""Lightning checkpoints through aionvme: ``Trainer(plugins=[CheckpointIO()])``.

:class:`CheckpointIO` is a Lightning ``CheckpointIO`` plugin. A checkpoint is
written the way ``torch.save`` writes one, taken apart: the checkpoint dict is
pickled (protocol 2, as ``torch.save`` does) with every tensor storage kept
out of the pickle by a persistent id, and the storages are saved as raw bytes
with :func:`aionvme.save`: one safetensors file, written with O_DIRECT in large
transfers to a temporary name, fsynced, renamed over the target and the
directory fsynced. Loading reads the file with O_DIRECT into one page-aligned
allocation; the storages are views of it (no second copy), and the pickle is
read back by torch's own unpicklers, so ``weights_only`` (the default, as for
``torch.load``) allows exactly what it allows in ``torch.load``, parameters
come back as ``nn.Parameter``, views share their storage, and ``OrderedDict``
keeps its ``_metadata``: the checkpoint loads as ``torch.load`` would load it.

Files that ``TorchCheckpointIO`` wrote (``torch.save``'s zip, or its legacy
format) are loaded by Lightning's own loader, so a run can switch plugins and
resume from its old checkpoints.

:class:`AsyncCheckpointIO` saves in the background: ``save_checkpoint``
returns once the tensors are copied into one page-aligned snapshot buffer
(:func:`aionvme.sync_save_in_background`), and the file is written while
training goes on. Lightning's own ``AsyncCheckpointIO`` can also wrap
:class:`CheckpointIO` (it clones every tensor, then runs our save on a thread).

``lightning`` (``import lightning.pytorch``) and ``pytorch_lightning`` both
work: the class derives from the ``CheckpointIO`` of the package installed
(``lightning.fabric``'s when both are) and is registered as a virtual subclass
of the other one's, so either ``Trainer`` accepts it.
"""

from __future__ import annotations

import errno
import importlib
import io
import os
import pickle
import shutil
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..atomic import fsync_dir
from ..exceptions import UnsupportedOperation, os_error
from ..formats import BackgroundSave, SafetensorsError, sync_load, sync_save, sync_save_in_background

try:
    _io: Any = importlib.import_module("lightning.fabric.plugins.io.checkpoint_io")
except ImportError:  # pytorch_lightning alone
    _io = importlib.import_module("lightning_fabric.plugins.io.checkpoint_io")
_Base: Any = _io.CheckpointIO
# The same package's TorchCheckpointIO: it loads what torch.save wrote.
_TorchIO: Any = importlib.import_module(_io.__name__.rsplit(".", 1)[0] + ".torch_io").TorchCheckpointIO

__all__ = ["FORMAT", "AsyncCheckpointIO", "CheckpointIO", "LightningCheckpointError", "pack", "unpack"]

# The checkpoint's root holds this under "format": what load_checkpoint looks
# for before it unpickles anything.
FORMAT = "aionvme.lightning/1"
# torch.save's pickle protocol (torch.serialization.DEFAULT_PROTOCOL); torch's
# weights-only unpickler reads only the opcodes of protocol 2.
_PROTOCOL = 2
# The first bytes of a torch.save zip file, and of its legacy (pickle) format.
_ZIP_MAGIC = b"PK\x03\x04"
_TRUE = ("1", "y", "yes", "true")


class LightningCheckpointError(SafetensorsError):
    """A checkpoint file in this format whose parts do not fit together
    (a storage missing or of the wrong size). A ``ValueError``."""


def _register_with_other_base(cls: type) -> None:
    """Make ``pytorch_lightning``'s Trainer accept ``cls`` too when both
    packages are installed: their ``CheckpointIO`` classes are distinct ABCs."""
    try:
        other: Any = importlib.import_module("lightning_fabric.plugins.io.checkpoint_io").CheckpointIO
    except ImportError:
        return
    if other is not _Base:
        other.register(cls)


class _StoragePickler(pickle.Pickler):
    """torch.save's pickler without the data: each distinct storage becomes
    ``("storage", storage type, key, location, numel)`` (torch's own persistent
    id) and is collected in ``storages``, in key order."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self.keys: dict[int, str] = {}
        self.storages: list[Any] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            obj = _any(obj)
            storage = obj._untyped_storage
            storage_type = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        elif isinstance(obj, torch.UntypedStorage):
            storage, storage_type, numel = obj, torch.UntypedStorage, obj.nbytes()
        else:
            return None
        key = self.keys.setdefault(storage._cdata, str(len(self.keys)))
        if int(key) == len(self.storages):
            self.storages.append(storage)
        return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)


def _any(x: Any) -> Any:
    """``x``, typed Any: torch's storage internals have no annotations."""
    return x


def _as_bytes(storage: Any) -> Any:
    """A uint8 tensor over all of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def pack(checkpoint: Any) -> dict[str, Any]:
    """The tree :func:`aionvme.save` writes for ``checkpoint``: its pickle with
    the storages left out, and the storages as uint8 tensors (views)."""
    buf = io.BytesIO()
    pickler = _StoragePickler(buf)
    pickler.dump(checkpoint)
    return {
        "format": FORMAT,
        "pickle": np.frombuffer(buf.getvalue(), dtype=np.uint8),
        "storages": [_as_bytes(s) for s in pickler.storages],
    }


def _resolve_weights_only(weights_only: bool | None) -> bool:
    """``torch.load``'s rule: None means True, unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
    says otherwise; TORCH_FORCE_WEIGHTS_ONLY_LOAD forces True."""
    force = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    force_no = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    if force and force_no:
        raise RuntimeError(
            "Only one of TORCH_FORCE_WEIGHTS_ONLY_LOAD or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD should be set"
        )
    if force:
        return True
    if weights_only is None:
        return not force_no
    return bool(weights_only)


def _keep_on_host(storage: Any, location: str) -> Any:
    """TorchCheckpointIO's default map_location: every storage stays in host memory."""
    return storage


def _restorer(map_location: Any) -> Callable[[Any, str], Any]:
    """(storage, saved location) -> storage where ``map_location`` wants it,
    with torch.load's meaning of each form of ``map_location``."""
    restore: Any = torch.serialization.default_restore_location
    if map_location is None:
        return lambda s, loc: restore(s, loc)
    if isinstance(map_location, dict):
        return lambda s, loc: restore(s, map_location.get(loc, loc))
    if isinstance(map_location, (str, bytes, torch.device)):
        where = map_location.decode() if isinstance(map_location, bytes) else str(map_location)
        return lambda s, loc: restore(s, where)
    if callable(map_location):

        def call(s: Any, loc: str) -> Any:
            got = map_location(s, loc)
            return restore(s, loc) if got is None else got

        return call
    raise TypeError(f"map_location: expected a str, torch.device, dict or callable, got {map_location!r}")


class _FullUnpickler(pickle.Unpickler):
    """torch.load's full (not weights-only) unpickler: the legacy storage
    classes it names (``torch.FloatStorage``) resolve to ``StorageType``, as
    in ``torch.load``, so they cost no deprecation warning."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and "Storage" in name:
            try:
                return _any(torch.serialization).StorageType(name)
            except KeyError:
                pass
        return super().find_class(module, name)


def unpack(tree: Any, path: str, map_location: Any, weights_only: bool | None) -> Any:
    """The checkpoint :func:`pack` took apart, unpickled by torch's own
    unpicklers (weights-only or full) with the loaded storages."""
    pickled, raw = tree.get("pickle"), tree.get("storages")
    if not isinstance(pickled, np.ndarray) or not isinstance(raw, list):
        raise LightningCheckpointError("checkpoint lacks its pickle or its storages", path)
    restore = _restorer(map_location)
    made: dict[str, Any] = {}

    def persistent_load(pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise LightningCheckpointError(f"unknown persistent id {pid!r:.80}", path)
        _, storage_type, key, location, numel = pid
        key = key.decode() if isinstance(key, bytes) else str(key)
        if key in made:
            return made[key]
        if not key.isdigit() or int(key) >= len(raw):
            raise LightningCheckpointError(f"the pickle names storage {key!r}, which is missing", path)
        dtype = (
            getattr(storage_type, "dtype", None) if storage_type is not torch.UntypedStorage else torch.uint8
        )
        held = raw[int(key)]
        if not isinstance(dtype, torch.dtype) or not (
            isinstance(held, torch.Tensor) and held.dtype == torch.uint8 and held.dim() == 1
        ):
            raise LightningCheckpointError(f"storage {key} is not a byte tensor of a storage type", path)
        untyped = held.untyped_storage()
        want = numel * dtype.itemsize
        if untyped.nbytes() != want:
            raise LightningCheckpointError(
                f"storage {key} holds {untyped.nbytes()} bytes; the pickle expects {want}", path
            )
        location = location.decode() if isinstance(location, bytes) else location
        made[key] = _any(torch.storage).TypedStorage(
            wrap_storage=restore(untyped, location), dtype=dtype, _internal=True
        )
        return made[key]

    data = io.BytesIO(pickled.tobytes())
    if _resolve_weights_only(weights_only):
        from torch import _weights_only_unpickler

        try:
            unpickler: Any = _weights_only_unpickler.Unpickler(data, encoding="utf-8")
            unpickler.persistent_load = persistent_load
            return unpickler.load()
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(
                f"Weights only load failed for {path!r}: {e}. The checkpoint holds objects other than "
                "tensors and plain containers; pass weights_only=False (Trainer.fit(..., "
                "weights_only=False)) if you trust its source, or allow them with "
                "torch.serialization.add_safe_globals."
            ) from None
    unpickler = _FullUnpickler(data, encoding="utf-8")
    unpickler.persistent_load = persistent_load
    return unpickler.load()


def _local(path: Any, what: str) -> str:
    p = os.fspath(path)
    p = os.fsdecode(p)
    if "://" in p and not p.startswith("file://"):
        raise UnsupportedOperation(
            f"{what}: aionvme reads and writes local files; for remote storage use "
            "Lightning's TorchCheckpointIO",
            p,
        )
    return p[len("file://") :] if p.startswith("file://") else p


def _is_torch_file(path: str) -> bool:
    """Whether ``path`` holds a torch.save file (zip or legacy pickle) rather
    than a safetensors one (8-byte header length, then ``{``)."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise os_error(e.errno or errno.EIO, path, op="open (checkpoint)") from None
    return head.startswith(_ZIP_MAGIC) or not (len(head) == 9 and head[8:9] == b"{")


class CheckpointIO(_Base):  # type: ignore[misc]
    """Lightning ``CheckpointIO`` that saves atomically and durably through aionvme.

    ``Trainer(plugins=[CheckpointIO()])``.

    Parameters
    ----------
    durable : bool
        fsync each checkpoint and its directory before ``save_checkpoint``
        returns (default). False still replaces the file atomically, but a
        crash may lose the newest checkpoint.

    Notes
    -----
    Until ``save_checkpoint`` returns, the file at the path is the previous
    checkpoint (or none); after, the complete new one. The file is a
    safetensors file (the storages as ``storages.N``, uint8, the pickle as
    ``pickle``); see the module documentation. ``load_checkpoint`` also reads
    what ``TorchCheckpointIO`` wrote, and plain aionvme checkpoints
    (:func:`aionvme.save`). Paths are local (``file://`` allowed); remote
    URLs raise :class:`aionvme.UnsupportedOperation`. ``storage_options`` is
    not used (a TypeError when given, as in TorchCheckpointIO).
    """

    def __init__(self, *, durable: bool = True) -> None:
        super().__init__()
        self.durable = durable

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        target = self._prepare_save(path, storage_options)
        sync_save(pack(checkpoint), target, durable=self.durable)

    def _prepare_save(self, path: Any, storage_options: Any) -> str:
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                f"{type(self).__name__}"
            )
        target = _local(path, "save_checkpoint")
        parent = os.path.dirname(target)
        if parent:
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                raise os_error(e.errno or errno.EIO, parent, op="mkdir (checkpoint directory)") from None
        return target

    def load_checkpoint(
        self, path: Any, map_location: Any = _keep_on_host, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint this plugin, ``TorchCheckpointIO`` or :func:`aionvme.save` wrote.

        ``map_location`` and ``weights_only`` mean what they mean to
        ``torch.load``; by default (as in TorchCheckpointIO) every tensor is
        loaded into host memory. A missing file raises FileNotFoundError.
        """
        source = _local(path, "load_checkpoint")
        if not os.path.exists(source):
            raise FileNotFoundError(errno.ENOENT, f"Checkpoint file not found: {source}", source)
        if _is_torch_file(source):
            return _TorchIO().load_checkpoint(source, map_location, weights_only)  # type: ignore[no-any-return]
        tree = sync_load(source)
        if isinstance(tree, dict) and tree.get("format") == FORMAT:
            return unpack(tree, source, map_location, weights_only)  # type: ignore[no-any-return]
        return tree  # type: ignore[no-any-return]

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint (a directory: recursively); nothing if it is
        absent. The removal is made durable (the directory is fsynced)."""
        target = _local(path, "remove_checkpoint")
        try:
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.unlink(target)
        except FileNotFoundError:
            return
        except OSError as e:
            raise os_error(e.errno or errno.EIO, target, op="remove (checkpoint)") from None
        if self.durable:
            fsync_dir(os.path.dirname(os.path.abspath(target)))


class AsyncCheckpointIO(CheckpointIO):
    """:class:`CheckpointIO` that writes in the background.

    ``save_checkpoint`` returns once every tensor has been copied into one
    page-aligned snapshot buffer (the training step may then change them);
    the file is written by aionvme's background thread with the same atomic,
    durable commit. At most one write is in flight: a save waits for the
    previous one first, and so do ``load_checkpoint``, ``remove_checkpoint``
    and ``teardown``. A failed write raises from the next of these calls (as
    Lightning's own AsyncCheckpointIO does); its file is left as it was.
    """

    def __init__(self, *, durable: bool = True) -> None:
        super().__init__(durable=durable)
        self._pending: BackgroundSave | None = None
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Block until the write in flight (if any) has ended; raise its error."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        target = self._prepare_save(path, storage_options)
        self.wait()
        pending = sync_save_in_background(pack(checkpoint), target, durable=self.durable)
        with self._lock:
            self._pending = pending

    def load_checkpoint(
        self, path: Any, map_location: Any = _keep_on_host, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.wait()
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        self.wait()
        super().teardown()


_register_with_other_base(CheckpointIO)
