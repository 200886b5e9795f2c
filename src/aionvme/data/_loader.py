"""Loader: shuffled, sharded, resumable batches read from NVMe into reused,
page-aligned batch memory, for ``async for`` and plain ``for``."""

from __future__ import annotations

import concurrent.futures
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np

from .. import defaults
from .._runtime.background import background, is_background
from ..defaults import parse_size
from ..exceptions import DeviceError
from ._batch import BatchPlan
from ._dataset import Dataset, check_tensors
from ._elastic import (
    STATE_VERSION,
    Phases,
    check_phases,
    check_whole,
    phases_of,
    phases_to_state,
    rest_count,
    rest_index,
)
from ._errors import LoaderStateError
from ._layout import ALIGN, FileCache
from ._memory import BudgetError, Lent, Pool, Slab, Workers, max_batch_nbytes
from ._order import epoch_order, rank_part, rank_size, resolve_rank
from ._run import AsyncIter, Run, Stats, clone, close_run

__all__ = ["BudgetError", "Loader"]


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
        batches as fit. Must hold two of the largest possible batch (``keep +
        1`` with ``keep=k``). Batches you still refer to when every buffer
        is taken make the loader exceed it (see Notes). Batch memory is made on first need (its
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
    keep : int, optional
        None (default): a batch's memory is reused only once nothing refers
        to the batch. ``k``: the counted ring instead, a batch's memory is
        reused once ``k + 1`` later batches were asked for, referenced or not
        (a hard memory bound; see Notes).
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
    tensors are views of batch memory, which is reused once nothing refers
    to the batch any more: when you ask for a batch, the memory of every
    earlier batch of which no tensor, view, slice or ``.numpy()`` of one is
    left is free for the read-ahead. A batch you keep (a list of batches, a
    row sliced off one) stays intact and holds its whole batch buffer. When
    every buffer of the budget holds such a batch and you ask for the next,
    the loader makes one more beyond ``prefetch`` (a :class:`BudgetWarning`,
    once per loader; ``stats()["slabs_beyond_budget"]``) rather than wait
    forever or overwrite what you kept; that memory is freed, not kept, when
    you let go of the batch. A loop that drops each batch when it takes the
    next reuses memory as before: batch k's buffer is reused once you ask for
    batch k + 2. ``keep=k`` restores the counted ring (strict budget: batch
    k is overwritten after you ask for batch k + k + 1, whatever still refers
    to it); ``copy=True`` hands out copies.

    **Order and resume.** The epoch's order depends only on (seed, epoch,
    shuffle, rank, world_size, drop_last). ``state_dict()`` records the epoch
    and how many of this rank's samples have been handed out (a batch counts
    once it is handed out); ``load_state_dict`` continues with exactly the
    samples not yet handed out, also in a new process. Iterating again after
    ``break`` continues where it stopped. When an epoch ends, the epoch
    advances by one; ``set_epoch(e)`` with another epoch starts that one from
    its beginning (the current epoch: no change, so resuming and then calling
    ``set_epoch`` as torch code does keeps the position).

    **Resuming at another world size.** Gather every rank's ``state_dict()``
    (``torch.distributed.all_gather_object``) and save
    :func:`merge_states` of them; the loaders of the new world (any size, any
    batch size) each ``load_state_dict`` the merged state and split the
    samples no rank handed out, in the epoch's shuffled order, between them;
    ranks may have stopped at different points. See :func:`merge_states` for
    what "exactly once" covers (padding and ``drop_last``).

    **Cancellation.** A consumer cancelled while it waits for a batch (a
    timeout around ``anext``) does not lose it: the reads go on, and the same
    batch is the next one handed out (also to a new ``async for``). Closing
    (``aclose``, ``close``, the end of a ``for`` loop, a new pass) waits for
    the reads in flight before batch memory is reused: the kernel never
    writes into memory the loader has handed out again. ``break`` out of
    ``async for`` needs no ``aclose``: the dropped iterator schedules its
    pass's close on its loop; a loader dropped unclosed closes its files.

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
        keep: int | None = None,
        copy: bool = False,
        verify: bool = False,
        tensors: str = "torch",
    ) -> None:
        self.dataset = dataset if isinstance(dataset, Dataset) else Dataset(dataset)
        self.layout = self.dataset.layout
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise ValueError(f"keep must be None or an int >= 0, got {keep!r}")
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
        need = (1 if keep is None else keep) + 1
        if slabs < need:
            raise BudgetError(
                f"prefetch={self.prefetch} holds {slabs} batches of up to {self.slab_nbytes} bytes; "
                f"it needs {need} (the batch you hold{'s' if need > 2 else ''} and the one being read): "
                "raise prefetch or lower batch_size",
                self.layout.root,
            )
        # batches read at once: enough to fill the engine's bytes in flight, plus one queued
        inflight = defaults.settings.inflight_bytes
        self._read_ahead = max(2, -(-inflight // self.slab_nbytes) + 1) if inflight > 0 else slabs
        # batches handed out that stay valid: None = as long as referenced
        self._keep: int | None = 0 if copy else keep
        self._warned = False  # BudgetWarning given
        self._workers = Workers()
        self._pool = Pool(self.slab_nbytes, slabs, self.device, self.pin_memory, self._workers.get)
        # fixed-shape fields only: a batch is a few views (microseconds); else its
        # assembly (a view per sample, MDS decoding) runs on a worker thread
        self._slow_assembly = self.layout.decoded is not None or any(
            f.shape is None for f in self.layout.fields.values()
        )
        self._files = FileCache(self.layout)
        self._epoch = 0
        self._position = 0
        self._resumed: Phases = ()  # the epoch's earlier phases (elastic resume), none when it began here
        self._generation = 0  # bumped by set_epoch/load_state_dict: a running pass no longer moves the state
        self._active: Run | None = None
        self._stats = Stats()
        # a loader dropped without close (``async for ... break`` over a fresh
        # Loader): its files and worker threads go with it, quietly
        self._finalizer = weakref.finalize(self, _release, self._files, self._workers)

    # -- order -------------------------------------------------------------------

    def _part(self, epoch: int, resumed: Phases = ()) -> np.ndarray[Any, Any]:
        order = epoch_order(self.layout.n, self.seed, epoch, self.shuffle)
        if resumed:  # the rest of an epoch other ranks began: the samples none of them handed out
            order = order[rest_index(self.layout.n, resumed, self.drop_last)]
        return rank_part(order, self.rank, self.world_size, self.drop_last)

    def _prepare(self, epoch: int, resumed: Phases = ()) -> np.ndarray[Any, Any]:
        for i in range(len(self.layout.files)):
            self.layout.check_unchanged(i)
        return self._part(epoch, resumed)

    def samples_per_epoch(self) -> int:
        """Samples this rank gets this epoch (before dropping an incomplete batch):
        after an elastic resume, its part of the rest of the epoch."""
        n = rest_count(self.layout.n, self._resumed, self.drop_last) if self._resumed else self.layout.n
        return rank_size(n, self.world_size, self.drop_last)

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
            self._resumed = ()
            self._generation += 1

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: epoch and samples of this rank's part handed out
        (and, after an elastic resume, the epoch's earlier phases: ``resumed``).
        Plain ints, bools, lists and None: JSON and ``torch.save`` keep it."""
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
            "resumed": phases_to_state(self._resumed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batches hold exactly the samples not yet handed out.

        ``state`` is this rank's :meth:`state_dict` (same rank and world size),
        or the states of every rank of another world size merged by
        :func:`~aionvme.data.merge_states` (any rank, any world size). The
        dataset, seed, shuffle and drop_last must be those of the saved
        loaders; the batch size may differ. Raises :class:`LoaderStateError`
        (a ``ValueError``) otherwise."""
        if not isinstance(state, dict):
            raise LoaderStateError(f"load_state_dict takes a state_dict() dict, got {type(state).__name__}")
        v = state.get("version", 1)
        if not isinstance(v, int) or v > STATE_VERSION:
            raise LoaderStateError(f"state_dict version {v!r} is newer than this aionvme ({STATE_VERSION})")
        mine = self.state_dict()
        merged = state.get("rank") is None and state.get("world_size") is None
        for k in ("seed", "shuffle", "drop_last", "samples") + (() if merged else ("world_size", "rank")):
            if state.get(k) != mine[k]:
                hint = ""
                if k == "world_size":
                    hint = (
                        ": to resume at another world size, load the states of all ranks "
                        "merged by aionvme.data.merge_states(states)"
                    )
                raise LoaderStateError(f"state_dict has {k}={state.get(k)!r}, this loader {mine[k]!r}{hint}")
        for k in ("epoch", "position"):
            check_whole(state, k)
        resumed = phases_of(state)
        check_phases(self.layout.n, resumed, self.drop_last)
        n = rest_count(self.layout.n, resumed, self.drop_last) if resumed else self.layout.n
        pos = int(state["position"])
        if not 0 <= pos <= rank_size(n, self.world_size, self.drop_last) or (merged and pos):
            raise LoaderStateError(f"state_dict position {pos} out of range")
        self._epoch = int(state["epoch"])
        self._position = pos
        self._resumed = resumed
        self._generation += 1

    # -- iteration -----------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return AsyncIter(self, Run(self))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # Plain ``for`` reads ahead on aionvme's background loop (one daemon
        # thread per process, shared with the other blocking twins), not on a
        # loop thread of its own. The user's step, ``transform`` and batch
        # assembly run in this (the consumer's) thread; the loop only plans
        # reads and resolves them, so a slow step holds this thread, never the
        # loop (tests/test_background.py checks that other blocking calls go
        # on meanwhile). Measured against the private uvloop thread it had
        # before (a probe since removed, bench/JOURNAL.md: 16k 4 KiB samples from the page cache,
        # batch 256, four runs of 5 alternated rounds on the loaded 2-core
        # machine): wall medians 51.5-60.9 vs 47.2-69.4 us per sample, CPU
        # 21.8-24.2 vs 20.9-24.3 us; within the noise (asyncio may cost up to
        # ~1 us of CPU per 4 KiB sample against uvloop), so no measured reason
        # to own a thread.
        run = Run(self)
        try:
            while True:
                got = background().run(run.next())
                if got is None:
                    return
                batch, lent = self._deliver(*got)  # in this thread: the loop thread goes on reading
                run.commit(lent)
                if self.transform is not None:
                    batch = self.transform(batch)
                yield batch
        finally:
            close_run(run)

    def _deliver(self, plan: BatchPlan, slab: Slab) -> tuple[dict[str, Any], Lent]:
        mem, lent = slab.lend(plan.nbytes)
        batch = plan.assemble(self.layout, mem, self.tensors)
        return (clone(batch) if self.copy else batch), lent

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
            ``slabs``/``slab_nbytes``: batch buffers there are and their size;
            ``slabs_beyond_budget``: buffers made beyond ``prefetch`` because
            every one held a batch still referenced (see Notes);
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
            "slabs_beyond_budget": self._pool.grown,
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
            close_run(run)
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


def _release(files: FileCache, workers: Workers) -> None:
    files.close()
    workers.shutdown(wait=False)
