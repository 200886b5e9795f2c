"""DeepNVMe's ``aio_handle`` on aionvme: a drop-in for DeepSpeed's ``async_io`` op.

::

    import aionvme.compat.deepspeed
    aionvme.compat.deepspeed.install()      # AsyncIOBuilder().load() returns this module

    from deepspeed.ops.op_builder import AsyncIOBuilder
    h = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=8,
                                           single_submit=False, overlap_events=True,
                                           intra_op_parallelism=2)
    h.async_pwrite(tensor, "/nvme/t.bin")   # returns 0 at once
    h.wait()                                # 1: the number of operations completed

Nothing is compiled: no libaio-dev, no JIT build. The methods, arguments and
return values are DeepNVMe's (deepspeed/ops/csrc/aio/py_lib/py_ds_aio.cpp),
with these differences:

- every completion is checked: a file shorter than the buffer, or an I/O error,
  raises from :meth:`aio_handle.wait` (or the sync call), typed like the rest
  of aionvme (``ShortReadError``, ``OSError`` subclasses), after all of the
  handle's operations have finished; nothing is printed or asserted;
- any size works: no ``nbytes % intra_op_parallelism == 0`` rule, unaligned
  sizes, offsets and tails are transferred exactly;
- ``async_*`` calls return at once and the transfer proceeds in the background
  (aionvme's background event-loop thread, shared by the process); :meth:`aio_handle.wait`
  blocks with the GIL released;
- CUDA tensors take aionvme's GPU path (cuFile, or kernel AIO through pinned
  bounce buffers: :mod:`aionvme.gpu`), as every aionvme call does;
  non-contiguous tensors go through a contiguous copy on their own device,
  and reads into them are completed by :meth:`aio_handle.wait`;
- :meth:`aio_handle.free_cpu_locked_tensor` forgets the tensor; its memory
  is released when the last reference to it goes, never under a live tensor;
- locked tensors are process-wide, as DeepNVMe's pinned-tensor manager is:
  every handle's :meth:`aio_handle.is_pinned` recognises a tensor (or a slice
  of one) from any handle's :meth:`aio_handle.new_cpu_locked_tensor`. When
  DeepSpeed's own ``pin_memory`` op is loaded (``PinMemoryBuilder().load()``),
  its buffers are recognised too, and new locked tensors are allocated through
  its manager so that its ``pin_handle().is_pinned`` recognises ours;
- ``async_pwrite(buffer, fd=..., file_offset=...)``: DeepNVMe's overload for an
  open file descriptor, by keyword as well as by position.

DeepNVMe splits each request into ``intra_op_parallelism`` parts, each with
``queue_depth`` chunks of ``block_size`` in flight; the handle runs each
request with ``queue_depth * intra_op_parallelism`` chunks in flight.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import warnings
import weakref
from typing import Any

from .._engine import AlignedBuffer
from .._runtime.background import background
from .._runtime.opening import handle_for
from ..defaults import positive_int
from ..exceptions import AionvmeError
from ..handle import FileLike, Handle

__all__ = [
    "ValidationError",
    "aio_handle",
    "aio_read",
    "aio_write",
    "deepspeed_memcpy",
    "install",
    "installed",
    "uninstall",
]

_O_DIRECT_ALIGNMENT = 512  # what DeepNVMe's get_alignment() multiplies (deepspeed_py_io_handle.cpp)


class ValidationError(AionvmeError, ValueError):
    """``validate=True``: the file's bytes differ from the buffer's after the transfer."""


# -- buffers ---------------------------------------------------------------------------------


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _host_bytes(obj: Any) -> memoryview:
    """The bytes of a host buffer (contiguous tensor, array, bytes-like)."""
    if _is_tensor(obj):
        import torch

        flat = obj.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()  # validating a CUDA tensor: its bytes, copied back
        return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    return memoryview(obj).cast("B")


class _Op:
    """One operation of a handle: its future and what wait() does after it."""

    __slots__ = ("buffer", "filename", "future", "offset", "read", "staging", "validate")

    def __init__(
        self,
        read: bool,
        buffer: Any,
        staging: Any,
        filename: str | int,
        offset: int,
        validate: bool,
        future: concurrent.futures.Future[int],
    ) -> None:
        self.read = read
        self.buffer = buffer
        self.staging = staging
        self.filename = filename
        self.offset = offset
        self.validate = validate
        self.future = future

    def finish(self) -> None:
        _complete(self.read, self.buffer, self.staging, self.filename, self.offset, self.validate)


def _target(file: Any) -> str | int:
    """What _validate reopens: a path, or an fd the caller holds."""
    if isinstance(file, int):
        return file
    if isinstance(file, (str, bytes, os.PathLike)):
        return os.fsdecode(file)
    return str(file.path)  # an aionvme.File


def _complete(read: bool, buffer: Any, staging: Any, file: str | int, offset: int, validate: bool) -> None:
    """After a successful transfer: copy a staged read back, validate."""
    if read and staging is not None:
        buffer.copy_(staging)
    if validate:
        _validate(staging if staging is not None else buffer, file, offset)


def _validate(host: Any, file: str | int, offset: int) -> None:
    """Compare a host buffer with the file's bytes, read through the page cache
    (an fd is reopened through /proc: it may be O_DIRECT or write-only)."""
    mine = _host_bytes(host)
    name = f"<fd {file}>" if isinstance(file, int) else file
    fd = os.open(f"/proc/self/fd/{file}" if isinstance(file, int) else file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        theirs = os.pread(fd, len(mine), offset)
    finally:
        os.close(fd)
    if mine != theirs:
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        raise ValidationError(
            f"{name}: {len(mine)} bytes at offset {offset} do not match the file "
            f"(first difference at byte {offset + first}; the file has {len(theirs)} bytes there)"
        )


def _staged(buffer: Any, read: bool) -> Any:
    """A contiguous copy of a non-contiguous tensor, on the tensor's own
    device (None if not needed). A CUDA tensor is never copied to the host
    here: it takes aionvme's GPU path (cuFile or the pinned bounce pipeline),
    as every aionvme call does."""
    if not _is_tensor(buffer) or buffer.is_contiguous():
        return None
    import torch

    staging = torch.empty(buffer.shape, dtype=buffer.dtype, device=buffer.device)
    if not read:
        staging.copy_(buffer)
    return staging


# -- page-locked tensors, process-wide -----------------------------------------------------------

# Where DeepSpeed 0.19 keeps its loaded pin_memory op (deepspeed/ops/op_builder/pin_memory_load.py),
# and the module name a prebuilt op is imported as (PinMemoryBuilder.absolute_name()).
_DS_PIN_SYS_ATTR = "_deepspeed_pin_memory_op_module"
_DS_PIN_MODULE = "deepspeed.ops.pin_memory.pin_memory_op"


def _deepspeed_pin_module() -> Any:
    """DeepSpeed's pin_memory op if this process has loaded it, else None
    (never loaded or built from here: building it takes minutes)."""
    mod = getattr(sys, _DS_PIN_SYS_ATTR, None)
    if mod is None:
        mod = sys.modules.get(_DS_PIN_MODULE)
    return mod if hasattr(mod, "pin_handle") else None


class _BorrowedPages:
    """Memory from DeepSpeed's pin manager, exposed to numpy; when the last
    tensor viewing it is gone, handed back to the manager (munlock + free)."""

    def __init__(self, pin_handle: Any, address: int, nbytes: int) -> None:
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        weakref.finalize(self, pin_handle.free_cpu_locked_tensor_by_ptr, address)


class _PinnedTensors:
    """The process's locked tensors (DeepNVMe keeps one manager per process):
    base address -> bytes, for every handle's is_pinned."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.regions: dict[int, int] = {}
        self._ds_handle: Any = None
        self._ds_module: Any = None

    def deepspeed_handle(self) -> Any:
        mod = _deepspeed_pin_module()
        if mod is None:
            return None
        with self.lock:
            if self._ds_module is not mod:
                self._ds_handle, self._ds_module = mod.pin_handle(), mod
            return self._ds_handle

    def new(self, num_elem: int, dtype: Any) -> Any:
        import numpy as np
        import torch

        nbytes = num_elem * torch.empty(0, dtype=dtype).element_size()
        ds = self.deepspeed_handle() if nbytes else None
        if ds is not None:
            # through DeepSpeed's manager, so its is_pinned knows the memory
            theirs = ds.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
            owner: Any = _BorrowedPages(ds, theirs.data_ptr(), nbytes)
            del theirs  # a view without an owner: ours keeps the memory alive instead
        else:
            try:
                owner = AlignedBuffer(nbytes, lock=True)
            except OSError as e:
                warnings.warn(
                    f"cannot page-lock {nbytes} bytes ({e.strerror}; see `ulimit -l`): "
                    "using page-aligned memory that is not locked",
                    ResourceWarning,
                    stacklevel=3,
                )
                owner = AlignedBuffer(nbytes)
            owner = memoryview(owner)
        raw = np.asarray(owner) if ds is not None else np.frombuffer(owner, dtype=np.uint8)  # keeps it alive
        tensor = torch.from_numpy(raw).view(dtype)
        with self.lock:
            self.regions[tensor.data_ptr()] = nbytes
        return tensor

    def free(self, tensor: Any) -> bool:
        with self.lock:
            return self.regions.pop(tensor.data_ptr(), None) is not None

    def is_pinned(self, buffer: Any) -> bool:
        if not _is_tensor(buffer) or buffer.device.type != "cpu":
            return False
        if buffer.is_pinned():
            return True
        # the whole extent inside one locked region, as DeepNVMe's is_managed checks
        ptr = buffer.data_ptr()
        end = ptr + buffer.numel() * buffer.element_size()
        with self.lock:
            if any(base <= ptr and end <= base + max(n, 1) for base, n in self.regions.items()):
                return True
        ds = self.deepspeed_handle()
        return bool(ds is not None and ds.is_pinned(buffer))


_pinned = _PinnedTensors()


# -- the handle ------------------------------------------------------------------------------


class aio_handle:  # DeepSpeed's name, lower case
    """DeepNVMe's ``aio_handle`` (``deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle``).

    Parameters
    ----------
    block_size : int
        Bytes per chunk (rounded up to a multiple of 4096 for the engine).
    queue_depth : int
        Chunks in flight per part of a request.
    single_submit : bool
        One ``io_submit`` per chunk instead of one per batch.
    overlap_events : bool
        Sliding window (True) or batch-and-wait (False, DeepNVMe's default).
    intra_op_parallelism : int
        Parts each request is split into (DeepNVMe: one thread each).
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ) -> None:
        # The knobs are checked as aionvme checks its own (InvalidSettingError);
        # DeepNVMe's block size needs no 4 KiB multiple: it is rounded up below.
        self._block_size = positive_int("block_size", block_size)
        self._queue_depth = positive_int("queue_depth", queue_depth)
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._parallelism = positive_int("intra_op_parallelism", intra_op_parallelism)
        depth = self._queue_depth * self._parallelism
        self._handle = Handle(
            block_size=-(-self._block_size // 4096) * 4096,
            queue_depth=depth,
            single_submit=self._single_submit,
            overlap_events=self._overlap_events,
            intra_op_parallelism=depth,
            direct=True,
        )
        self._lock = threading.Lock()
        self._pending: list[_Op] = []

    # -- knobs ---------------------------------------------------------------------------

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._parallelism

    def get_thread_count(self) -> int:
        """DeepSpeed < 0.15's name for :meth:`get_intra_op_parallelism`."""
        return self._parallelism

    def get_alignment(self) -> int:
        """DeepNVMe's value (``intra_op_parallelism * 512``), which DeepSpeed pads
        buffers to; aionvme itself needs no alignment."""
        return self._parallelism * _O_DIRECT_ALIGNMENT

    @property
    def handle(self) -> Handle:
        """The aionvme :class:`~aionvme.Handle` doing the work."""
        return self._handle

    # -- operations ------------------------------------------------------------------------

    def _start(self, read: bool, buffer: Any, file: FileLike, validate: bool, offset: int) -> None:
        staging = _staged(buffer, read)
        target = buffer if staging is None else staging
        # open errors raise here, now (DeepNVMe's calls fail at once too)
        fh, temporary = handle_for(file, write=not read, direct=self._handle.direct)
        opened: Any = fh  # the calls take the engine's open handle as they take a File
        handle = self._handle

        async def run() -> int:
            try:
                return await (handle.pread if read else handle.pwrite)(target, opened, offset)
            finally:
                if temporary:
                    fh.close()  # deferred until the request has finished

        try:
            future = background().submit(run())
        except BaseException:
            if temporary:
                fh.close()
            raise
        with self._lock:
            self._pending.append(_Op(read, buffer, staging, _target(file), offset, validate, future))

    def wait(self) -> int:
        """Wait (GIL released) for all of this handle's outstanding operations.

        Returns
        -------
        int
            How many operations completed (0 if none was outstanding).

        Raises
        ------
        ShortReadError, OSError, ValidationError
            The first failure, once every operation has finished; a note says
            how many others failed.
        """
        with self._lock:
            ops, self._pending = self._pending, []
        if not ops:
            return 0
        try:
            concurrent.futures.wait([op.future for op in ops])
        except BaseException:
            with self._lock:  # interrupted: the operations are still outstanding
                self._pending[:0] = ops
            raise
        errors: list[BaseException] = []
        for op in ops:
            exc = op.future.exception()
            if exc is None:
                try:
                    op.finish()
                except Exception as e:
                    errors.append(e)
            else:
                errors.append(exc)
        if errors:
            first = errors[0]
            if len(errors) > 1 and hasattr(first, "add_note"):
                first.add_note(f"{len(errors) - 1} more of the {len(ops)} operations failed: {errors[1:]!r}")
            raise first
        return len(ops)

    def pread(
        self,
        buffer: Any,
        filename: FileLike,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        **kwargs: Any,
    ) -> int:
        """Read buffer's size from filename at file_offset.

        ``async`` (DeepSpeed's keyword; ``async_op`` here, or pass it
        positionally): return 0 at once and complete in :meth:`wait`;
        otherwise wait for all outstanding operations and return their count.
        """
        async_op = _async_kw(async_op, kwargs)
        self._start(True, buffer, filename, bool(validate), int(file_offset))
        return 0 if async_op else self.wait()

    def pwrite(
        self,
        buffer: Any,
        filename: FileLike,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        **kwargs: Any,
    ) -> int:
        """Write buffer to filename (created if needed, never truncated) at file_offset."""
        async_op = _async_kw(async_op, kwargs)
        self._start(False, buffer, filename, bool(validate), int(file_offset))
        return 0 if async_op else self.wait()

    def sync_pread(self, buffer: Any, filename: FileLike, file_offset: int = 0) -> int:
        """Read and wait: returns the count of completed operations (1 when
        nothing else was outstanding)."""
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: Any, filename: FileLike, file_offset: int = 0) -> int:
        """Write and wait: returns the count of completed operations."""
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: Any, filename: FileLike, file_offset: int = 0) -> int:
        """Start a read; returns 0 at once. :meth:`wait` completes it."""
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(
        self, buffer: Any, filename: FileLike | None = None, file_offset: int = 0, *, fd: int | None = None
    ) -> int:
        """Start a write; returns 0 at once.

        DeepNVMe has two overloads, ``async_pwrite(buffer, filename,
        file_offset)`` and ``async_pwrite(buffer, fd, file_offset)`` for an
        open file descriptor (DeepSpeed's FastFileWriter): both work, by
        position or keyword (``fd=aio_fd``). The caller keeps the fd open until
        :meth:`wait` returns and closes it; a write-only O_DIRECT fd is fine.
        """
        if fd is not None:
            if filename is not None:
                raise TypeError("async_pwrite() takes filename or fd, not both")
            if isinstance(fd, bool) or not isinstance(fd, int):
                raise TypeError(f"fd must be an int file descriptor, got {type(fd).__name__}")
            filename = fd
        elif filename is None:
            raise TypeError("async_pwrite() needs filename or fd")
        return self.pwrite(buffer, filename, False, True, file_offset)

    def read(self, buffer: Any, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Blocking read that leaves outstanding async operations alone; returns 0
        as DeepNVMe does."""
        staging = _staged(buffer, True)
        self._handle.sync_pread(buffer if staging is None else staging, filename, file_offset)
        _complete(True, buffer, staging, _target(filename), file_offset, validate)
        return 0

    def write(self, buffer: Any, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Blocking write that leaves outstanding async operations alone; returns 0."""
        staging = _staged(buffer, False)
        self._handle.sync_pwrite(buffer if staging is None else staging, filename, file_offset)
        _complete(False, buffer, staging, _target(filename), file_offset, validate)
        return 0

    # -- page-locked tensors -------------------------------------------------------------------

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any = None, **kwargs: Any) -> Any:
        """A 1-D CPU tensor of num_elem elements of example_tensor's dtype, in
        page-aligned, page-locked (mlock) memory, known to every handle of the
        process (see :meth:`is_pinned`).

        When DeepSpeed's ``pin_memory`` op is loaded, the memory comes from its
        pinned-tensor manager, so its ``pin_handle().is_pinned`` says True too.
        Otherwise, where ``RLIMIT_MEMLOCK`` forbids locking, the memory is
        page-aligned but not locked (a ResourceWarning says so): O_DIRECT does
        not need it. ``example_tenosr=`` (DeepNVMe's keyword, sic) is accepted.
        """
        if "example_tenosr" in kwargs:
            example_tensor = kwargs.pop("example_tenosr")
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        if example_tensor is None:
            raise TypeError("new_cpu_locked_tensor() needs example_tensor")
        return _pinned.new(int(num_elem), example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Forget a tensor from :meth:`new_cpu_locked_tensor` (of any handle);
        True if it was one.

        The memory is unlocked and unmapped when the last reference to the
        tensor goes (not at once, as in DeepNVMe, which leaves live tensors
        dangling)."""
        return _pinned.free(tensor)

    def is_pinned(self, buffer: Any) -> bool:
        """Whether buffer is directly usable for I/O: pinned by torch, inside a
        tensor from any handle's :meth:`new_cpu_locked_tensor` (slices
        included), or managed by DeepSpeed's ``pin_memory`` op when it is loaded."""
        return _pinned.is_pinned(buffer)

    # -- lifecycle -----------------------------------------------------------------------------

    def __del__(self) -> None:
        h = getattr(self, "_handle", None)
        if h is not None:
            h.close()


def _async_kw(async_op: bool, kwargs: dict[str, Any]) -> bool:
    """DeepSpeed's keyword is ``async``, a Python keyword: accept it via **kwargs."""
    if "async" in kwargs:
        async_op = kwargs.pop("async")
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    return bool(async_op)


# -- DeepNVMe's module-level functions -------------------------------------------------------


def aio_read(
    buffer: Any,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """DeepNVMe's ``aio_read``: one blocking read of the whole buffer from offset 0; returns 0."""
    return _one_shot(
        True, buffer, filename, (block_size, queue_depth, single_submit, overlap_events), validate
    )


def aio_write(
    buffer: Any,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """DeepNVMe's ``aio_write``: one blocking write of the whole buffer at offset 0; returns 0."""
    return _one_shot(
        False, buffer, filename, (block_size, queue_depth, single_submit, overlap_events), validate
    )


def _one_shot(
    read: bool, buffer: Any, filename: str, knobs: tuple[int, int, bool, bool], validate: bool
) -> int:
    h = aio_handle(*knobs, 1)
    try:
        return h.read(buffer, filename, validate) if read else h.write(buffer, filename, validate)
    finally:
        h.handle.close()


def deepspeed_memcpy(dest: Any, src: Any) -> int:
    """DeepNVMe's ``deepspeed_memcpy``: dest.copy_(src); returns 0."""
    dest.copy_(src)
    return 0


# -- making DeepSpeed use it -----------------------------------------------------------------

_saved: dict[type, dict[str, Any]] = {}
_MISSING = object()


def _builder_classes() -> list[type]:
    try:
        from deepspeed.ops import op_builder
    except ImportError as e:
        raise ImportError(f"deepspeed is not importable ({e}); install it to use install()") from e
    classes = [op_builder.AsyncIOBuilder]  # the accelerator's builder, what DeepSpeed's code uses
    try:
        from deepspeed.ops.op_builder.async_io import AsyncIOBuilder as cuda_builder
    except ImportError:
        pass
    else:
        classes.append(cuda_builder)
    return list(dict.fromkeys(c for c in classes if isinstance(c, type)))


def _load(self: Any, verbose: bool = False) -> Any:
    # DeepSpeed's AsyncIOBuilder.load loads its pin_memory op first (the shared
    # pinned-tensor manager). Do the same where the op is prebuilt, never a JIT build.
    _load_prebuilt_pin_memory()
    return sys.modules[__name__]


def _load_prebuilt_pin_memory() -> None:
    if _deepspeed_pin_module() is not None:
        return
    try:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder import PinMemoryBuilder

        if installed_ops.get(PinMemoryBuilder.NAME, False):
            PinMemoryBuilder().load()
    except Exception:  # an old DeepSpeed without it, or an op built for another torch
        pass


def _is_compatible(self: Any, verbose: bool = False) -> bool:
    return True  # kernel AIO where available, else aionvme's worker threads


def install() -> None:
    """Make DeepSpeed's ``AsyncIOBuilder().load()`` return this module (no build,
    no libaio) and ``is_compatible()`` say True. Undo with :func:`uninstall`.

    Only the ``async_io`` op is replaced; ``use_gds`` configs still load
    DeepSpeed's ``gds`` op."""
    for cls in _builder_classes():
        if cls in _saved:
            continue
        _saved[cls] = {name: cls.__dict__.get(name, _MISSING) for name in ("load", "is_compatible")}
        cls.load = _load  # type: ignore[attr-defined]
        cls.is_compatible = _is_compatible  # type: ignore[attr-defined]


def uninstall() -> None:
    """Give DeepSpeed its own ``async_io`` op back."""
    for cls, attrs in list(_saved.items()):
        for name, value in attrs.items():
            if value is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, value)
        del _saved[cls]


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_saved)
