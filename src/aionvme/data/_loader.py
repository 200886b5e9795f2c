"""Loader: shuffled, sharded, resumable batches read from NVMe into reused,
page-aligned batch memory, for ``async for`` and plain ``for``."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np

from .. import defaults
from .._runtime.background import background, cancel_at_exit, current, is_background
from ..defaults import parse_size
from ..exceptions import DeviceError
from ..memory import empty
from ._batch import BatchPlan
from ._dataset import Dataset, check_tensors
from ._errors import DatasetError
from ._layout import ALIGN, FileCache, Layout, round_up
from ._order import epoch_order, rank_part, rank_size, resolve_rank

__all__ = ["BudgetError", "Loader"]

STATE_VERSION = 1


class BudgetError(DatasetError):
    """The prefetch budget cannot hold what the loader needs (a sample, or
    ``keep + 1`` batches)."""


def _topk_sum(sizes: np.ndarray[Any, Any], k: int) -> int:
    if len(sizes) <= k:
        return int(sizes.sum())
    return int(np.partition(sizes, len(sizes) - k)[len(sizes) - k :].sum())


def max_batch_nbytes(layout: Layout, b: int) -> int:
    """Batch memory the largest possible batch of b samples needs (BatchPlan's layout)."""
    total = 0
    for f in layout.fields.values():
        if f.shape is not None:
            total += round_up(b * (int(f.nbytes[0]) if layout.n else 0))
        else:
            total += _topk_sum((f.nbytes + (ALIGN - 1)) // ALIGN * ALIGN, b)
    if layout.decoded is not None:
        total += _topk_sum((layout.decoded.nbytes + (ALIGN - 1)) // ALIGN * ALIGN, b)
    return total


class _Slab:
    """One batch buffer: page-aligned host memory (maybe CUDA-pinned) or CUDA memory."""

    __slots__ = ("buf", "owner")

    def __init__(self, nbytes: int, device: str, pin: bool) -> None:
        if device != "cpu":
            import torch

            self.owner = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.buf: Any = self.owner
        elif pin:
            self.owner = empty(nbytes, like="torch", pinned=True)  # keeps the pinning alive
            self.buf = self.owner.numpy()
        else:
            self.buf = self.owner = empty(nbytes)
            # Touch every page now, on the worker thread that makes the slab
            # (numpy releases the GIL for the loop): else the first io_submit
            # into it faults and zeroes the pages while the batch's reads wait,
            # on the engine's submitter thread for batches over 512 KiB and on
            # the loop thread for smaller ones. Measured by bench/suites/bench_loader.py on a VM whose fresh
            # memory the host backs on first touch (perf: clear_page_erms under
            # io_submit): 256 MiB cost 0.3-0.5 s of CPU, the first epoch of a
            # new Loader 111-119 µs CPU/sample instead of ~20.
            self.buf[::ALIGN] = 0


class _Workers:
    """The loader's worker threads (made on first use): slabs are made and
    checksums verified there, off the event loop."""

    def __init__(self) -> None:
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="aionvme-data")
        return self.pool

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


class _Pool:
    """At most ``limit`` slabs, made on first need (on a worker thread: see
    :class:`_Slab`) and reused for the loader's life."""

    def __init__(
        self,
        nbytes: int,
        limit: int,
        device: str,
        pin: bool,
        executor: Callable[[], concurrent.futures.Executor] | None = None,
    ) -> None:
        self.nbytes, self.limit, self.device, self.pin = nbytes, limit, device, pin
        self.executor = executor
        self.made = 0
        self.free: list[_Slab] = []
        self.waiters: collections.deque[asyncio.Future[_Slab]] = collections.deque()

    async def get(self) -> _Slab:
        if self.free:
            return self.free.pop()
        if self.made < self.limit:
            self.made += 1
            if self.executor is None:
                return _Slab(self.nbytes, self.device, self.pin)
            made = asyncio.get_running_loop().run_in_executor(
                self.executor(), _Slab, self.nbytes, self.device, self.pin
            )
            try:
                return await asyncio.shield(made)
            except asyncio.CancelledError:
                if made.cancelled() or not made.done() or made.exception() is not None:
                    made.add_done_callback(self._adopt)
                else:
                    self.put(made.result())
                raise
            except BaseException:
                self.made -= 1
                raise
        fut: asyncio.Future[_Slab] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slab, then cancelled: keep it
                self.free.append(fut.result())
            raise

    def _adopt(self, made: asyncio.Future[_Slab]) -> None:
        # a slab whose maker was cancelled while the worker made it: keep it for the next get
        if made.cancelled() or made.exception() is not None:
            self.made -= 1
        else:
            self.put(made.result())

    def put(self, slab: _Slab) -> None:
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                w.set_result(slab)
                return
        self.free.append(slab)

    def drop_waiters(self) -> None:
        while self.waiters:
            w = self.waiters.popleft()
            if w.done() and not w.cancelled():
                self.free.append(w.result())
            else:
                w.cancel()


class _Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.samples = 0
        self.batches = 0
        self.bytes = 0
        self.consumer_wait = 0.0
        self.io_wait = 0.0
        self.memory_wait = 0.0
        self.started: float | None = None


class _Run:
    """One pass over this rank's samples of the current epoch, from the current position."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.epoch = loader._epoch
        self.start = loader._position
        self.gen = loader._generation
        self.ready: (
            asyncio.Queue[tuple[asyncio.Task[BatchPlan], _Slab, int] | BaseException | None] | None
        ) = None
        self.producer: asyncio.Task[None] | None = None
        self.inflight: list[tuple[asyncio.Task[BatchPlan], _Slab]] = []
        self.held: collections.deque[_Slab] = collections.deque()
        self.waiting: tuple[asyncio.Task[BatchPlan], _Slab, int] | None = None  # taken from ready, being read
        self.undelivered: tuple[BatchPlan, _Slab, int] | None = None  # read, not yet committed
        self.reading = 0  # batches whose reads are in flight
        self.read_done = asyncio.Event()  # set when a batch's reads end
        self.producer_waiting = False
        self.idle_since: float | None = None  # no read in flight, the producer waiting for memory
        self.closed = False
        self.t0 = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None

    async def _begin(self) -> None:
        ld = self.loader
        old = ld._active
        self.loop = asyncio.get_running_loop()
        if old is not None and old is not self:
            if old.loop is not self.loop:
                raise RuntimeError(
                    "an iteration of this loader is still open on another event loop: "
                    "close it first (await loader.aclose() there, or let the for loop end)"
                )
            await old.aclose()
        ld._active = self
        self.t0 = time.perf_counter()
        if ld._stats.started is None:
            ld._stats.started = self.t0
        # off the loop: a permutation of 10M ids, a stat of every file (changed since the open?)
        part = await asyncio.to_thread(ld._prepare, self.epoch)
        self.ready = asyncio.Queue()
        self.producer = asyncio.get_running_loop().create_task(self._produce(part))
        # it may wait for the consumer forever: exit must not wait for it
        cancel_at_exit(self.producer)

    async def _produce(self, part: np.ndarray[Any, Any]) -> None:
        ld = self.loader
        ready = self.ready
        if ready is None:  # pragma: no cover - set by _begin
            return
        try:
            pos, b = self.start, ld.batch_size
            while pos < len(part):
                idx = part[pos : pos + b]
                if len(idx) < b and ld.drop_last:
                    break
                while self.reading >= ld._read_ahead:
                    # enough batches are being read to keep the engine's bytes in
                    # flight full: more would only queue, in batch memory that a
                    # consumer faster than the disk never needs (slabs are made
                    # on first need, so the pool stays small when I/O-bound)
                    self.read_done.clear()
                    await self.read_done.wait()
                t = time.perf_counter()
                self.producer_waiting = True
                if self.reading == 0:
                    self.idle_since = t
                try:
                    slab = await ld._pool.get()
                finally:
                    self.producer_waiting = False
                    now = time.perf_counter()
                    ld._stats.memory_wait += now - t
                    if self.idle_since is not None:
                        ld._stats.io_wait += now - self.idle_since
                        self.idle_since = None
                try:
                    plan = BatchPlan(ld.layout, idx)
                except BaseException:
                    ld._pool.put(slab)
                    raise
                self.reading += 1
                task = asyncio.get_running_loop().create_task(self._read(plan, slab))
                self.inflight.append((task, slab))
                pos += len(idx)
                ready.put_nowait((task, slab, pos))
                await asyncio.sleep(0)  # let the batch's reads go out before planning the next
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the consumer gets it instead of waiting forever
            ready.put_nowait(e)
            return
        ready.put_nowait(None)

    async def _read(self, plan: BatchPlan, slab: _Slab) -> BatchPlan:
        ld = self.loader
        try:
            await plan.read(ld.layout, ld._files, slab.buf)
        finally:
            self.reading -= 1
            self.read_done.set()
            if self.reading == 0 and self.producer_waiting and self.idle_since is None:
                self.idle_since = time.perf_counter()  # nothing to read until the consumer frees memory
        if ld.verify:
            await asyncio.get_running_loop().run_in_executor(ld._executor(), plan.verify, ld.layout, slab.buf)
        return plan

    async def next(self) -> tuple[BatchPlan, _Slab] | None:
        """The next batch's plan and memory (read and checked), or None at the end of the epoch.

        Asking for a new batch frees the batches handed out before the last
        ``keep`` (``copy=True``: all of them, they were copied). A batch counts
        as handed out at :meth:`commit`; until then (the consumer was cancelled
        while it waited, or while the batch was being assembled) the same
        batch is given again."""
        ld = self.loader
        if self.undelivered is not None:
            return self.undelivered[:2]
        if self.closed:
            return None
        if self.ready is None:
            await self._begin()
        ready = self.ready
        if ready is None:  # pragma: no cover
            return None
        keep = 0 if ld.copy else ld.keep
        while len(self.held) > keep:
            ld._pool.put(self.held.popleft())
        t = time.perf_counter()
        if self.waiting is None:
            item = await ready.get()  # cancelled here: the item stays in the queue
            if isinstance(item, BaseException):
                await self.aclose()
                raise item
            if item is None:
                if ld._generation == self.gen:
                    ld._epoch += 1
                    ld._position = 0
                    ld._generation += 1
                await self.aclose()
                return None
            self.waiting = item
        task, slab, pos = self.waiting
        try:
            # shield: a consumer cancelled here leaves the read running; the next call awaits it again
            plan = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            self.waiting = None
            await self.aclose()
            raise
        except BaseException:
            self.waiting = None
            await self.aclose()
            raise
        self.waiting = None
        self.inflight = [x for x in self.inflight if x[0] is not task]
        ld._stats.consumer_wait += time.perf_counter() - t
        self.undelivered = (plan, slab, pos)
        return plan, slab

    def commit(self) -> None:
        """The batch from :meth:`next` reached the consumer: it counts as handed out."""
        got = self.undelivered
        if got is None:  # pragma: no cover
            return
        plan, slab, pos = got
        self.undelivered = None
        ld = self.loader
        self.held.append(slab)
        if ld._generation == self.gen:
            ld._position = pos
        st = ld._stats
        st.batches += 1
        st.samples += len(plan.idx)
        st.bytes += plan.data_nbytes

    async def aclose(self) -> None:
        """Stop: no new reads; wait for those in flight (their memory stays
        untouched by the kernel after this returns); give the slabs back."""
        if self.closed:
            return
        self.closed = True
        ld = self.loader
        if self.producer is not None and not self.producer.done():
            self.producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.producer
        ld._pool.drop_waiters()
        for task, slab in self.inflight:
            with contextlib.suppress(BaseException):  # raised to the consumer already, or unwanted
                await asyncio.shield(task)
            ld._pool.put(slab)
        self.inflight.clear()
        while self.held:
            ld._pool.put(self.held.popleft())
        if self.undelivered is not None:
            ld._pool.put(self.undelivered[1])
            self.undelivered = None
        self.waiting = None
        if ld._active is self:
            ld._active = None


def _clone(batch: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, list):
            out[k] = [
                x.clone() if hasattr(x, "clone") else (x.copy() if hasattr(x, "copy") else x) for x in v
            ]
        else:
            out[k] = v.clone() if hasattr(v, "clone") else v.copy()
    return out


class Loader:
    """Batches of a :class:`Dataset`, shuffled per epoch, split between ranks,
    read ahead into reused batch memory; ``async for`` or plain ``for``.

    Parameters
    ----------
    dataset : Dataset or path
    batch_size : int
    shuffle : bool
        A new permutation of all samples every epoch, from (seed, epoch).
    seed : int
    drop_last : bool
        True: each rank's part is cut to ``len(ds) // world_size`` samples and a
        last incomplete batch is dropped. False: parts are padded to
        ``ceil(len(ds) / world_size)`` by repeating the epoch's first samples
        (as ``torch.utils.data.DistributedSampler`` does) and the last batch
        may be smaller.
    prefetch : int or str
        Bytes of batch memory (``"512M"``): the loader reads ahead as many
        batches as fit, and never holds more. Must hold ``keep + 1`` of the
        largest possible batch. Batch memory is made on first need (its
        pages touched on a worker thread, not on the event loop), and at most
        enough batches to fill the engine's ``inflight_bytes`` (plus one) are
        read at once, so a consumer faster than the disk never makes the
        whole budget.
    device : str
        ``"cpu"`` or a CUDA device: batch memory lives there, and reads go
        through aionvme's CUDA path (GPUDirect Storage or pinned bounce buffers).
    pin_memory : bool
        CPU batch memory that is also CUDA-pinned (for ``.to("cuda", non_blocking=True)``).
    rank, world_size : int, optional
        Default: ``torch.distributed``'s when it is initialised, else 0 and 1.
    transform : callable, optional
        Applied to each batch dict just before it is handed out, in the
        consumer's thread (the thread iterating).
    keep : int
        Batches handed out earlier that stay valid (default 1; see Notes).
    copy : bool
        Hand out copies (in fresh memory, yours to keep) instead of views.
    verify : bool
        Check every field's crc32 (aionvme format) before the batch is handed
        out, on a worker thread (costs one crc32 pass over the data).
    tensors : {'torch', 'numpy'}

    Notes
    -----
    **Batch validity.** A batch is a dict: a fixed-shape field is one
    contiguous ``[B, ...]`` tensor whose rows each sample was read into
    directly (zero copies); a field whose shape varies is a list of B
    tensors (views, each on its own 4 KiB-aligned place); MDS columns that
    need decoding (bytes, str, variable ndarrays) are decoded copies. The
    tensors are views of batch memory that is reused: the batch you got
    stays valid until you ask for the ``keep + 1``-th batch after it (with
    ``keep=1``, batch k is intact while you work on batch k + 1 and is
    overwritten after you ask for batch k + 2). Keep data longer with
    ``.clone()`` or ``copy=True``.

    **Order and resume.** The epoch's order depends only on (seed, epoch,
    shuffle, rank, world_size, drop_last). ``state_dict()`` records the epoch
    and how many of this rank's samples have been handed out (a batch counts
    once it is handed out); ``load_state_dict`` continues with exactly the
    samples not yet handed out, also in a new process. Iterating again after
    ``break`` continues where it stopped. When an epoch ends, the epoch
    advances by one; ``set_epoch(e)`` with another epoch starts that one from
    its beginning (the current epoch: no change, so resuming and then calling
    ``set_epoch`` as torch code does keeps the position).

    **Cancellation.** A consumer cancelled while it waits for a batch (a
    timeout around ``anext``) does not lose it: the reads go on, and the same
    batch is the next one handed out (also to a new ``async for``). Closing
    (``aclose``, ``close``, the end of a ``for`` loop, a new pass) waits for
    the reads in flight before batch memory is reused: the kernel never
    writes into memory the loader has handed out again.

    **Changed files.** Every file's size, mtime and inode recorded when the
    dataset was opened are checked again at the start of each pass and when
    a read fails or a checksum differs: a change raises
    :class:`DatasetChangedError` naming the file (and the sample). A file
    replaced (renamed over) while it is open keeps being read from the inode
    that was opened, which still matches the index, until the next pass.

    **I/O.** Each batch is one ``File.pread_many`` per file it touches,
    samples sorted by offset. Fields whose size is a multiple of 4096 land in
    page-aligned rows (O_DIRECT straight into the tensor); other sizes go
    through the engine's unaligned path (still correct).
    """

    def __init__(
        self,
        dataset: Dataset | str | os.PathLike[str],
        batch_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        prefetch: int | str = "512M",
        device: str = "cpu",
        pin_memory: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        *,
        keep: int = 1,
        copy: bool = False,
        verify: bool = False,
        tensors: str = "torch",
    ) -> None:
        self.dataset = dataset if isinstance(dataset, Dataset) else Dataset(dataset)
        self.layout = self.dataset.layout
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.device = str(device)
        self.pin_memory = bool(pin_memory)
        self.transform = transform
        self.keep = keep
        self.copy = copy
        self.verify = verify
        self.tensors = tensors
        self.rank, self.world_size = resolve_rank(rank, world_size)
        check_tensors(tensors, self.layout)
        if tensors == "torch":
            import torch  # here, not on the loop thread at the first batch (seconds)
        if self.device != "cpu":
            if tensors != "torch":
                raise ValueError("a CUDA device needs tensors='torch'")
            if self.layout.decoded is not None:
                raise ValueError(
                    "this dataset has fields decoded on the host (MDS bytes/str/variable ndarray "
                    "columns): use device='cpu' (with pin_memory=True) and move the batch"
                )
            if verify:
                raise ValueError("verify=True checks host memory: use device='cpu'")
        if self.pin_memory or self.device != "cpu":
            import torch

            if not torch.cuda.is_available():
                raise DeviceError(f"device={self.device!r}, pin_memory={self.pin_memory} need CUDA")
        self.prefetch = parse_size(prefetch)
        sizes = self.layout.sample_nbytes()
        if len(sizes):
            j = int(np.argmax(sizes))
            if int(sizes[j]) > self.prefetch:
                raise BudgetError(
                    f"sample takes {int(sizes[j])} bytes of batch memory, more than prefetch={self.prefetch}",
                    self.layout.files[int(next(iter(self.layout.fields.values())).file[j])]
                    if self.layout.fields
                    else None,
                    j,
                )
        self.slab_nbytes = max(ALIGN, max_batch_nbytes(self.layout, min(batch_size, max(self.layout.n, 1))))
        slabs = self.prefetch // self.slab_nbytes
        if slabs < keep + 1:
            raise BudgetError(
                f"prefetch={self.prefetch} holds {slabs} batches of up to {self.slab_nbytes} bytes; "
                f"keep={keep} needs {keep + 1}: raise prefetch or lower batch_size",
                self.layout.root,
            )
        # batches read at once: enough to fill the engine's bytes in flight, plus one queued
        inflight = defaults.settings.inflight_bytes
        self._read_ahead = max(2, -(-inflight // self.slab_nbytes) + 1) if inflight > 0 else slabs
        self._workers = _Workers()
        self._pool = _Pool(self.slab_nbytes, slabs, self.device, self.pin_memory, self._workers.get)
        # fixed-shape fields only: a batch is a few views (microseconds); else its
        # assembly (a view per sample, MDS decoding) runs on a worker thread
        self._slow_assembly = self.layout.decoded is not None or any(
            f.shape is None for f in self.layout.fields.values()
        )
        self._files = FileCache(self.layout)
        self._epoch = 0
        self._position = 0
        self._generation = 0  # bumped by set_epoch/load_state_dict: a running pass no longer moves the state
        self._active: _Run | None = None
        self._stats = _Stats()

    # -- order -------------------------------------------------------------------

    def _part(self, epoch: int) -> np.ndarray[Any, Any]:
        order = epoch_order(self.layout.n, self.seed, epoch, self.shuffle)
        return rank_part(order, self.rank, self.world_size, self.drop_last)

    def _prepare(self, epoch: int) -> np.ndarray[Any, Any]:
        for i in range(len(self.layout.files)):
            self.layout.check_unchanged(i)
        return self._part(epoch)

    def samples_per_epoch(self) -> int:
        """Samples this rank gets per epoch (before dropping an incomplete batch)."""
        return rank_size(self.layout.n, self.world_size, self.drop_last)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        m = self.samples_per_epoch()
        return m // self.batch_size if self.drop_last else -(-m // self.batch_size)

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the current epoch, from its beginning (no change if it already is)."""
        if int(epoch) != self._epoch:
            self._epoch = int(epoch)
            self._position = 0
            self._generation += 1

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: epoch and samples of this rank's part handed out."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
            "samples": self.layout.n,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`): the next batches hold
        exactly the samples not yet handed out. The dataset, seed, shuffle,
        drop_last, rank and world size must be those of the saved loader; the
        batch size may differ."""
        mine = self.state_dict()
        for k in ("seed", "shuffle", "drop_last", "rank", "world_size", "samples"):
            if state.get(k) != mine[k]:
                raise ValueError(f"state_dict has {k}={state.get(k)!r}, this loader {mine[k]!r}")
        pos = int(state["position"])
        if not 0 <= pos <= self.samples_per_epoch():
            raise ValueError(f"state_dict position {pos} out of range")
        self._epoch = int(state["epoch"])
        self._position = pos
        self._generation += 1

    # -- iteration -----------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return _AsyncIter(self, _Run(self))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # Plain ``for`` reads ahead on aionvme's background loop (one daemon
        # thread per process, shared with the other blocking twins), not on a
        # loop thread of its own. The user's step, ``transform`` and batch
        # assembly run in this (the consumer's) thread; the loop only plans
        # reads and resolves them, so a slow step holds this thread, never the
        # loop (tests/test_background.py checks that other blocking calls go
        # on meanwhile). Measured against the private uvloop thread it had
        # before (bench/JOURNAL.md, 2026-12-01: 16k 4 KiB samples from the page cache,
        # batch 256, four runs of 5 alternated rounds on the loaded 2-core
        # machine): wall medians 51.5-60.9 vs 47.2-69.4 us per sample, CPU
        # 21.8-24.2 vs 20.9-24.3 us; within the noise (asyncio may cost up to
        # ~1 us of CPU per 4 KiB sample against uvloop), so no measured reason
        # to own a thread.
        run = _Run(self)
        try:
            while True:
                got = background().run(run.next())
                if got is None:
                    return
                batch = self._deliver(*got)  # in this thread: the loop thread goes on reading
                run.commit()
                if self.transform is not None:
                    batch = self.transform(batch)
                yield batch
        finally:
            _close_run(run)

    def _deliver(self, plan: BatchPlan, slab: _Slab) -> dict[str, Any]:
        batch = plan.assemble(self.layout, slab.buf, self.tensors)
        return _clone(batch) if self.copy else batch

    def as_torch(self) -> Any:
        """This loader as a ``torch.utils.data.IterableDataset`` (see :class:`TorchIterable`)."""
        from ._torch import TorchIterable

        return TorchIterable(self)

    # -- seeing it -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Throughput and where the time went since the loader was made (or :meth:`reset_stats`).

        Returns
        -------
        dict
            ``samples``, ``batches``, ``bytes`` handed out; ``elapsed_s`` (since
            the first batch was asked for); ``samples_per_s``, ``bytes_per_s``;
            ``consumer_wait_s``: time the consumer waited for I/O (reads not
            done when it asked); ``io_wait_s``: time I/O waited for the
            consumer (no read in flight because all batch memory held batches
            read but not yet taken, or still held, by the consumer);
            ``memory_wait_s``: all the time reading ahead waited for batch
            memory (also while other reads were in flight: a larger
            ``prefetch`` reads further ahead);
            ``slabs``/``slab_nbytes``: batch buffers made so far and their size;
            ``read_ahead``: batches read at once at most.
        """
        st = self._stats
        elapsed = (time.perf_counter() - st.started) if st.started is not None else 0.0
        return {
            "samples": st.samples,
            "batches": st.batches,
            "bytes": st.bytes,
            "elapsed_s": elapsed,
            "samples_per_s": st.samples / elapsed if elapsed else 0.0,
            "bytes_per_s": st.bytes / elapsed if elapsed else 0.0,
            "consumer_wait_s": st.consumer_wait,
            "io_wait_s": st.io_wait,
            "memory_wait_s": st.memory_wait,
            "slabs": self._pool.made,
            "slab_nbytes": self.slab_nbytes,
            "read_ahead": self._read_ahead,
            "prefetch": self.prefetch,
        }

    def reset_stats(self) -> None:
        self._stats.reset()

    # -- closing -------------------------------------------------------------------

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._workers.get()

    def close(self) -> None:
        """Stop the plain ``for`` iteration in progress (waiting for reads in
        flight), close the files. Async iteration in progress: use :meth:`aclose`."""
        run = self._active
        if run is not None and run.loop is not None and is_background(run.loop):
            _close_run(run)
        self._workers.shutdown()
        self._files.close()

    async def aclose(self) -> None:
        """Stop the async iteration in progress (waiting for reads in flight), then :meth:`close`."""
        run = self._active
        if run is not None:
            await run.aclose()
        self.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Loader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _close_run(run: _Run) -> None:
    """Close a plain-``for`` pass on the background loop: wait for it, or (when
    the pass is finalised on the loop's own thread, by the garbage collector)
    schedule it there."""
    if run.closed:
        return
    if run.loop is None:  # never began: nothing runs
        run.closed = True
        return
    bg = current()
    if bg is None or run.loop is not bg.loop:
        # begun in the parent process (fork), or the loop was stopped at
        # interpreter exit (which cancelled the read-ahead): nothing to wait for
        return
    if threading.current_thread() is bg.thread:
        bg.loop.create_task(run.aclose())
    else:
        bg.run(run.aclose())


class _AsyncIter:
    """``async for`` over one pass: closing it (or the epoch's end) stops reading ahead."""

    def __init__(self, loader: Loader, run: _Run) -> None:
        self.loader = loader
        self.run = run

    def __aiter__(self) -> _AsyncIter:
        return self

    async def __anext__(self) -> dict[str, Any]:
        got = await self.run.next()
        if got is None:
            raise StopAsyncIteration
        ld = self.loader
        if ld.copy or ld._slow_assembly:  # decoding, copying, many views: off the loop
            batch = await asyncio.to_thread(ld._deliver, *got)
        else:
            batch = ld._deliver(*got)
        self.run.commit()
        tf = self.loader.transform
        return tf(batch) if tf is not None else batch

    async def aclose(self) -> None:
        await self.run.aclose()
