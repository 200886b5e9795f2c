"""Checkpoints: nested state dicts saved as safetensors files.

A checkpoint is an ordinary safetensors file, so ``safetensors.torch.load_file``
reads its tensors. The nesting and the non-tensor values live in the header's
``__metadata__`` under ``"aionvme.checkpoint"``, as JSON::

    {"version": 1, "root": NODE}
    NODE := {"d": [[key, NODE], ...]}    dict (keys: str, int, float, bool, None)
          | {"l": [NODE, ...]}           list
          | {"u": [NODE, ...]}           tuple
          | {"t": "tensor name"}         torch tensor
          | {"a": "tensor name"}         numpy array
          | null | true | 1 | 1.5 | "s" a plain value (JSON; NaN and inf allowed)

Tensor names join the path with dots: ``{"model": {"w": t}, "optim": {"state":
{0: {"exp_avg": t}}}}`` gives ``model.w`` and ``optim.state.0.exp_avg``. A
name already taken (``{"a.b": t, "a": {"b": u}}``) gets a ``~2`` suffix.
Dict keys go in lists, not JSON object keys, so an int key stays an int.

The same tensor object (or an identical view: same memory, dtype, shape and
strides) reached twice, like tied embedding and output weights, is stored
once and loads as one tensor in both places. Tensors that overlap only in
part are stored separately. Mappings come back as ``dict`` (an OrderedDict's
``_metadata`` attribute is not kept), sequences as ``list``/``tuple``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import Callable, Generator, Mapping
from typing import Any

import numpy as np

from .._runtime import background as _background
from ..atomic import atomic_write
from ..file import PathLike
from ..memory import empty
from ._header import METADATA_KEY, SafetensorsError, TensorInfo
from ._prefault import Prefault
from ._safetensors import convert, plan, read_file, save_safetensors
from ._tensors import Source, check_device, is_torch_tensor, require_torch

__all__ = [
    "BackgroundSave",
    "load",
    "release_snapshot_buffers",
    "save",
    "save_in_background",
    "sync_load",
    "sync_save",
    "sync_save_in_background",
]

STRUCTURE_KEY = "aionvme.checkpoint"
VERSION = 1
_SCALARS = (str, int, float, bool, type(None))


def _identity(value: Any) -> tuple[Any, ...]:
    """Two values with equal identities are the same tensor (a tie)."""
    if isinstance(value, np.ndarray):
        iface = value.__array_interface__
        return ("numpy", iface["data"][0], value.dtype.str, value.shape, value.strides)
    return (
        "torch",
        str(value.device),
        value.data_ptr(),
        str(value.dtype),
        tuple(value.shape),
        tuple(value.stride()),
        # x.conj() and x share memory and layout but not values
        value.is_conj(),
        value.is_neg(),
    )


class _Flattener:
    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}
        self.seen: dict[tuple[Any, ...], str] = {}
        self.active: set[int] = set()  # containers on the current path: cycles

    def name_for(self, path: list[Any]) -> str:
        base = ".".join(str(p) for p in path) or "tensor"
        name, n = base, 1
        while name in self.tensors or name == METADATA_KEY:
            n += 1
            name = f"{base}~{n}"
        return name

    def walk(self, x: Any, path: list[Any]) -> Any:
        is_np = isinstance(x, np.ndarray)
        if is_np or is_torch_tensor(x):
            key = _identity(x) if (x.size if is_np else x.numel()) else ("empty", id(x))
            name = self.seen.get(key)
            if name is None:
                name = self.name_for(path)
                self.tensors[name] = x
                self.seen[key] = name
            return {"a" if is_np else "t": name}
        if isinstance(x, _SCALARS):
            return x
        if isinstance(x, (Mapping, list, tuple)):
            if id(x) in self.active:
                raise ValueError(f"circular reference at {_where(path)}")
            self.active.add(id(x))
            try:
                if isinstance(x, Mapping):
                    items = []
                    for k, v in x.items():
                        if not isinstance(k, _SCALARS):
                            raise TypeError(
                                f"dict key {k!r} at {_where(path)} is a {type(k).__name__}; "
                                "keys must be str, int, float, bool or None"
                            )
                        items.append([k, self.walk(v, [*path, k])])
                    return {"d": items}
                tag = "u" if isinstance(x, tuple) else "l"
                return {tag: [self.walk(v, [*path, i]) for i, v in enumerate(x)]}
            finally:
                self.active.discard(id(x))
        hint = " (a numpy scalar: save x.item(), or np.asarray(x) to keep its dtype)"
        raise TypeError(
            f"cannot save a {type(x).__module__}.{type(x).__qualname__} at {_where(path)}: a checkpoint "
            "holds torch tensors, numpy arrays, str, int, float, bool, None, and dicts, lists and "
            "tuples of them" + (hint if isinstance(x, np.generic) else "")
        )


def _where(path: list[Any]) -> str:
    return "the root" if not path else repr(".".join(str(p) for p in path))


def flatten(obj: Any, metadata: Mapping[str, str] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors by name, header metadata with the structure) for ``obj``."""
    fl = _Flattener()
    root = fl.walk(obj, [])
    meta = dict(metadata or {})
    if STRUCTURE_KEY in meta:
        raise ValueError(f"metadata key {STRUCTURE_KEY!r} is reserved for the checkpoint structure")
    meta[STRUCTURE_KEY] = json.dumps({"version": VERSION, "root": root}, separators=(",", ":"))
    return fl.tensors, meta


def _rebuild(node: Any, tensor: Any, filename: str) -> Any:
    if not isinstance(node, dict):
        if isinstance(node, list):
            raise SafetensorsError("checkpoint structure: a bare list where a node belongs", filename)
        return node
    if len(node) != 1:
        raise SafetensorsError(f"checkpoint structure: bad node {node!r:.80}", filename)
    ((tag, body),) = node.items()
    if tag in ("t", "a"):
        return tensor(body, tag)
    if tag == "d" and isinstance(body, list):
        out = {}
        for item in body:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], _SCALARS)):
                raise SafetensorsError(f"checkpoint structure: bad dict item {item!r:.80}", filename)
            out[item[0]] = _rebuild(item[1], tensor, filename)
        return out
    if tag in ("l", "u") and isinstance(body, list):
        seq = [_rebuild(v, tensor, filename) for v in body]
        return seq if tag == "l" else tuple(seq)
    raise SafetensorsError(f"checkpoint structure: unknown node {tag!r}", filename)


async def save(
    obj: Any, path: PathLike, *, metadata: Mapping[str, str] | None = None, durable: bool = True
) -> None:
    """Save a (nested) state dict as one checkpoint file, atomically and durably.

    Parameters
    ----------
    obj : dict, list or tuple (nested), or a tensor
        Leaves: torch tensors, numpy arrays, str, int, float, bool, None. A
        model's and an optimizer's ``state_dict()`` both qualify.
    path : str or os.PathLike
    metadata : dict of str to str, optional
        Stored in the file's ``__metadata__`` next to the structure.
    durable : bool
        fsync the file and its directory (default). False still replaces the
        file atomically, but a crash may lose it.

    Notes
    -----
    The file is written to a temporary name in the same directory, fsynced,
    renamed over ``path``, and the directory fsynced: when ``save`` returns,
    the checkpoint survives a crash; if it raises or is cancelled, the
    previous file is intact. It is a safetensors file: see the module
    documentation for how the nesting is stored. Do not modify the tensors
    until ``save`` returns, or use :func:`save_in_background`. A symlinked
    ``path`` is written through (see :func:`aionvme.atomic_write`);
    :func:`sync_save` is the blocking twin.
    """
    tensors, meta = flatten(obj, metadata)
    await save_safetensors(tensors, path, meta, durable=durable)


async def load(path: PathLike, *, device: Any = "cpu") -> Any:
    """Load a checkpoint written by :func:`save` or :func:`save_in_background`.

    Returns the saved structure with torch tensors on ``device`` and numpy
    arrays as numpy arrays (on the host). Tied tensors come back tied. A
    plain safetensors file (no structure in its metadata) loads as a dict of
    torch tensors, like :func:`load_safetensors`.
    """
    dev = check_device(device, "torch")  # None for the host, without importing torch
    got = await read_file(path)
    raw = got.header.metadata.get(STRUCTURE_KEY)
    if raw is None:
        require_torch("load() gives torch tensors; for numpy arrays use load_safetensors(path, like='numpy')")
        return {t.name: convert(got.tensor(t, "torch"), None, dev, "torch") for t in got.infos}
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"checkpoint structure is not valid JSON: {e}", got.filename) from None
    if not isinstance(doc, dict) or "root" not in doc:
        raise SafetensorsError("checkpoint structure lacks its root", got.filename)
    version = doc.get("version")
    if version != VERSION:
        raise SafetensorsError(
            f"checkpoint format version {version!r}; this aionvme reads version {VERSION}", got.filename
        )
    infos: dict[str, TensorInfo] = got.header.tensors
    made: dict[str, Any] = {}

    def tensor(name: Any, tag: str) -> Any:
        if not isinstance(name, str) or name not in infos:
            raise SafetensorsError(f"checkpoint structure names a missing tensor {name!r}", got.filename)
        if name not in made:
            like = "torch" if tag == "t" else "numpy"
            if like == "torch":
                require_torch(f"the checkpoint holds torch tensors ({name!r}); install torch to load it")
            made[name] = convert(got.tensor(infos[name], like), None, dev if like == "torch" else None, like)
        return made[name]

    try:
        return _rebuild(doc["root"], tensor, got.filename)
    except RecursionError:
        raise SafetensorsError("checkpoint structure is nested too deeply", got.filename) from None


# -- background saves ------------------------------------------------------------------


class _Staging:
    """A snapshot buffer: ``base`` owns the memory (a numpy array from
    :func:`aionvme.empty`, or a pinned torch tensor); ``array`` and ``tensor``
    view its first ``total`` bytes."""

    __slots__ = ("array", "base", "pinned", "tensor")

    def __init__(self, base: Any, pinned: bool, total: int, torch_view: bool) -> None:
        self.base = base
        self.pinned = pinned
        whole = base.numpy() if pinned else base
        self.array: np.ndarray = whole[:total]
        self.tensor: Any = None
        if pinned:
            self.tensor = base[:total]
        elif torch_view:
            import torch

            self.tensor = torch.from_numpy(self.array)

    @property
    def capacity(self) -> int:
        return int(self.base.nbytes)


# The buffer of the last finished background save, by kind (pinned or not),
# kept for the next one: a fresh buffer must be faulted in page by page, which
# in bench/suites/bench_formats.py cost 1 s for 544 MiB when the memory had gone back to the host,
# against 0.09 s to copy into a buffer used before (the snapshot is what
# blocks training). release_snapshot_buffers() frees them.
_spare: dict[bool, Any] = {}


def release_snapshot_buffers() -> None:
    """Free the snapshot buffers kept for reuse by :func:`save_in_background`."""
    _spare.clear()


def _staging(total: int, sources: list[Source]) -> _Staging:
    """A buffer for the whole file: page-aligned host memory, or pinned
    memory (fast device-to-host copies) when a source is a CUDA tensor.
    Reuses the spare one when it is big enough."""
    pinned = any(s.kind == "torch" and s.value.device.type == "cuda" for s in sources)
    uses_torch = any(s.kind == "torch" for s in sources)
    base = _spare.pop(pinned, None)
    if base is None or base.nbytes < total:
        base = None  # too small: drop it before allocating the new one
        # Pinned: page-aligned and CUDA-pinned, so the device-to-host copies
        # are DMA and the O_DIRECT write takes the buffer as it is (torch's own
        # pinned memory has no documented alignment: it could be bounced).
        base = empty(max(total, 1), like="torch", pinned=True) if pinned else empty(max(total, 1))
    return _Staging(base, pinned, total, uses_torch)


def caller_streams() -> dict[int, Any]:
    """The calling thread's current CUDA stream of each device (empty when CUDA
    is not in use): a snapshot taken on another thread orders its copies after
    the work queued on them, as a copy on the caller's thread would be."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {i: torch.cuda.current_stream(i) for i in range(torch.cuda.device_count())}


def snapshot(
    obj: Any, metadata: Mapping[str, str] | None, streams: Mapping[int, Any] | None = None
) -> _Staging:
    """The complete file ``save`` would write, copied into one buffer.

    ``streams``: from :func:`caller_streams` when this runs on another thread
    than the caller's; the copies from each CUDA device wait for its stream.
    """
    tensors, meta = flatten(obj, metadata)
    header, placed = plan(tensors, meta)
    total = len(header) + sum(s.nbytes for s, _ in placed)
    stage = _staging(total, [s for s, _ in placed])
    image, image_t = stage.array, stage.tensor
    try:
        if stage.pinned and streams:
            import torch

            for dev in {s.value.device for s, _ in placed if s.kind == "torch" and s.value.is_cuda}:
                theirs = streams.get(dev.index if dev.index is not None else torch.cuda.current_device())
                if theirs is not None:
                    torch.cuda.current_stream(dev).wait_stream(theirs)
        with Prefault(image.ctypes.data, 0 if stage.pinned else total):
            image[: len(header)] = np.frombuffer(header, dtype=np.uint8)
            for src, off in placed:
                dst_t = image_t[off : off + src.nbytes] if image_t is not None else None
                src.copy_into(image[off : off + src.nbytes], dst_t)
        if stage.pinned:
            import torch

            # the device-to-host copies were asynchronous: wait on every device involved
            for dev in {s.value.device for s, _ in placed if s.kind == "torch" and s.value.is_cuda}:
                torch.cuda.synchronize(dev)
    except BaseException:
        _spare.setdefault(stage.pinned, stage.base)
        raise
    return stage


def _keep_spare(stage: _Staging) -> None:
    """Keep a snapshot buffer no longer in use for the next save (the larger one)."""
    kept = _spare.get(stage.pinned)
    if kept is None or kept.nbytes < stage.capacity:
        _spare[stage.pinned] = stage.base


async def _write_image(stage: _Staging, path: PathLike, durable: bool) -> None:
    try:
        async with atomic_write(path, durable=durable) as f:
            await f.pwrite(stage.array, 0)
    finally:
        # pwrite's future ends only when the kernel is done with the buffer
        # (also when cancelled): it is free for the next snapshot.
        _keep_spare(stage)


class BackgroundSave:
    """A checkpoint being written in the background, by
    :func:`save_in_background` or :func:`sync_save_in_background`.

    Its snapshot is complete: the tensors may be modified. Wait for the write
    with ``await save`` (in async code) or ``save.result()`` (anywhere else);
    either raises what the write raised. ``done()`` says whether it has
    ended, ``cancel()`` abandons it (the previous file stays).

    Attributes
    ----------
    path : str
        The checkpoint being written.
    """

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop, task: asyncio.Task[None]) -> None:
        # constructed on the loop's thread
        self.path = path
        self._loop = loop
        self._task = task
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[Callable[[], None]] = []
        task.add_done_callback(self._finished)

    def _finished(self, _: object) -> None:
        with self._lock:
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for w in waiters:
            w()

    def done(self) -> bool:
        """Whether the write has ended (committed, failed or cancelled)."""
        return self._done.is_set()

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the write has ended (or ``timeout`` seconds); return :meth:`done`.
        Raises nothing about the save itself: see :meth:`result`."""
        if not self._done.is_set() and self._on_loop_thread():
            raise RuntimeError("waiting for a BackgroundSave on its own event loop's thread: await it")
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed (durable when ``durable=True``).

        Raises
        ------
        TimeoutError
            ``timeout`` seconds passed first; the write goes on.
        OSError, ...
            What the write raised (the previous file is intact).
        asyncio.CancelledError
            The save was cancelled.
        """
        if not self.wait(timeout):
            raise TimeoutError(f"the background save of {self.path!r} has not ended after {timeout} s")
        self._task.result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What the write raised (None if it committed); blocks like :meth:`result`."""
        try:
            self.result(timeout)
        except TimeoutError:
            if not self.done():
                raise
            return self._task.exception()
        except BaseException as e:
            return e
        return None

    def cancel(self) -> bool:
        """Abandon the write (the previous checkpoint stays). False if it had ended."""
        if self.done():
            return False
        if self._on_loop_thread():
            self._task.cancel()
        else:
            self._loop.call_soon_threadsafe(self._task.cancel)
        return True

    def __await__(self) -> Generator[Any, None, None]:
        if self._on_loop_thread():
            # the write's own Task: cancelling the awaiting task cancels the save
            return (yield from self._task.__await__())
        return (yield from self._await_elsewhere().__await__())

    async def _await_elsewhere(self) -> None:
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def settle() -> None:
            if not ended.done():
                ended.set_result(None)

        def wake() -> None:
            loop.call_soon_threadsafe(settle)

        with self._lock:
            if not self._done.is_set():
                self._waiters.append(wake)
            else:
                ended.set_result(None)
        await ended
        self._task.result()

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"<aionvme.BackgroundSave {self.path!r} {state}>"


async def _snapshot_off_loop(obj: Any, metadata: Mapping[str, str] | None) -> _Staging:
    """snapshot() on a worker thread. If the awaiting task is cancelled, the
    copy is seen to its end first (it reads the caller's tensors) and its
    buffer kept for the next save."""
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, snapshot, obj, metadata, caller_streams())
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        try:
            stage = await fut
        except BaseException:
            raise asyncio.CancelledError() from None
        _keep_spare(stage)
        raise


async def save_in_background(
    obj: Any, path: PathLike, *, metadata: Mapping[str, str] | None = None, durable: bool = True
) -> BackgroundSave:
    """Snapshot ``obj``, then write it in the background::

        pending = await nvme.save_in_background(model.state_dict(), "ckpt.safetensors")
        optimizer.step()    # the snapshot is taken: tensors may change
        await pending       # the checkpoint is durable (or raises)

    The await returns once every tensor has been copied into one page-aligned
    host buffer laid out as the final file (pinned memory when tensors are on
    CUDA); the copy runs on a worker thread, so the event loop keeps serving
    other tasks meanwhile. The returned :class:`BackgroundSave` writes that
    buffer with O_DIRECT, zero-copy, through the same atomic, durable commit
    as :func:`save`: when it is done, the checkpoint survives a crash; until
    then the previous one is intact.

    Returns
    -------
    BackgroundSave
        ``await`` it (or ``.result()`` from another thread) to learn whether
        the save succeeded; ``.cancel()`` abandons it and keeps the previous file.

    Notes
    -----
    Do not modify the tensors before the await returns: they are being
    copied. Errors in ``obj`` (a value a checkpoint cannot hold) raise from
    the await, before anything is written. Cancelling the await lets the copy
    finish (it reads your tensors), writes nothing and raises CancelledError.
    Plain code without an event loop uses :func:`sync_save_in_background`.

    The snapshot buffer holds a copy of the whole checkpoint. When the write
    ends it is kept (one per kind: plain or pinned, the largest) and reused by
    the next background save that fits, because faulting in fresh memory is
    what makes a snapshot slow: periodic checkpoints of the same model copy
    into memory that is already mapped. ``aionvme.formats.release_snapshot_buffers()``
    frees it.
    """
    loop = asyncio.get_running_loop()
    stage = await _snapshot_off_loop(obj, metadata)
    target = os.fsdecode(path)
    task = loop.create_task(
        _write_image(stage, target, durable), name=f"aionvme.save_in_background({target!r})"
    )
    return BackgroundSave(target, loop, task)


def sync_save_in_background(
    obj: Any, path: PathLike, *, metadata: Mapping[str, str] | None = None, durable: bool = True
) -> BackgroundSave:
    """:func:`save_in_background` for plain training code (no event loop)::

        pending = nvme.sync_save_in_background(model.state_dict(), "ckpt.safetensors")
        optimizer.step()    # training goes on while the checkpoint is written
        pending.result()    # durable now (or raises)

    Blocks this thread while the snapshot is taken, then returns; the write
    runs on aionvme's background event loop thread. ``.done()``, ``.wait()``,
    ``.result()`` and ``.cancel()`` of the returned :class:`BackgroundSave`
    follow it. At interpreter exit, writes still running are finished first.

    Notes
    -----
    Raises RuntimeError on a thread whose event loop is running (the snapshot
    would stall it): there, ``await save_in_background(...)``.
    """
    _background.no_running_loop("sync_save_in_background", "save_in_background")
    stage = snapshot(obj, metadata)
    target = os.fsdecode(path)
    bg = _background.background()

    started: list[BackgroundSave] = []

    def start() -> BackgroundSave:
        task = bg.loop.create_task(
            _write_image(stage, target, durable), name=f"aionvme.sync_save_in_background({target!r})"
        )
        started.append(BackgroundSave(target, bg.loop, task))
        return started[0]

    try:
        return bg.call(start)
    except BaseException:
        if started:
            # Interrupted (Ctrl-C) once the write had begun: the caller never
            # gets its handle, so abandon it (the previous file stays); the
            # write gives the snapshot buffer back when it has ended.
            started[0].cancel()
        else:
            _keep_spare(stage)  # never began: the buffer is free now
        raise


# -- blocking twins --------------------------------------------------------------------


def sync_save(
    obj: Any, path: PathLike, *, metadata: Mapping[str, str] | None = None, durable: bool = True
) -> None:
    """Blocking :func:`save`, for code without an event loop.

    Same parameters and guarantees: atomic, and durable when it returns. Runs
    on aionvme's background event loop (one daemon thread per process) while
    this thread waits: it works in plain scripts and from any thread, also
    while an event loop runs in another one.

    Notes
    -----
    Raises RuntimeError on a thread whose event loop is running (it would
    stall that loop): there, ``await save(...)``. Ctrl-C during the wait
    cancels the save (the previous file stays) and raises KeyboardInterrupt
    once its writes have ended.
    """
    _background.run("sync_save", "save", save(obj, path, metadata=metadata, durable=durable))


def sync_load(path: PathLike, *, device: Any = "cpu") -> Any:
    """Blocking :func:`load`, for code without an event loop.

    Same parameters, result and errors; runs on aionvme's background event
    loop while this thread waits (see :func:`sync_save`).

    Notes
    -----
    Raises RuntimeError on a thread whose event loop is running: there,
    ``await load(...)``. Ctrl-C during the wait cancels the load and raises
    KeyboardInterrupt once its reads have ended.
    """
    return _background.run("sync_load", "load", load(path, device=device))
