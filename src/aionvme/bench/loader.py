"""The data loader as a workload (``aionvme bench -w loader``): one shuffled
epoch of :class:`aionvme.data.Loader` over a dataset written in the scratch
directory, next to fio's random reads of the same sample size on the same
shard.

Options (``-o KEY=VALUE``): ``sample`` (bytes per sample, 128K), ``batch``
(64), ``prefetch`` (the loader's budget; default a quarter of the dataset,
at most 256M), ``mode`` (``async``: ``async for`` on the workload's loop;
``sync``: a plain ``for`` on the loader's own loop thread), ``fio`` (1: also
run fio ``randread`` at the sample size, QD 64, libaio, O_DIRECT).

The result's ``ops`` are samples (so its IOPS column is samples/s) and
``figures`` holds ``samples_s``, ``cpu_us_per_sample`` (the whole process:
loop, workers, kernel), ``loop_cpu_max_ms`` (async only: the most CPU the
loop's thread spent between two ticks of a 1 ms probe, i.e. the loop's own
work, which other processes on the machine do not inflate, unlike the
stall), the loader's
``consumer_wait_s``/``io_wait_s``, the batch buffers it made, and with fio
``fio_MB_s`` and ``vs_fio``. Every sample is checked: it starts with its
index, an epoch must deliver each index once, and its bytes must hold the
pattern it was written with.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any

import numpy as np

from ..defaults import parse_size
from .peers import fio, fio_unavailable
from .registry import Context
from .result import Result
from .system import drop_caches
from .timer import Timer

__all__ = ["LoopProbe", "loader_workload", "sample_bytes"]


class LoopProbe:
    """The loop's own work: the most CPU time its thread spent between two
    ticks of a callback that asks to run every ``interval`` seconds.

    A stall measured in wall time (:class:`~aionvme.bench.StallMonitor`)
    also counts the time the thread waited for a CPU that other processes
    held; this counts only what ran on the loop's thread (our callbacks, the
    engine's system calls, the garbage collector).
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.max_cpu = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._cpu = 0.0

    def start(self) -> None:
        """Start on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._cpu = time.thread_time()
        self._handle = self._loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        loop = self._loop
        if loop is None:
            return
        now = time.thread_time()
        self.max_cpu = max(self.max_cpu, now - self._cpu)
        self._cpu = now
        self._handle = loop.call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._loop = None


def sample_bytes(i: int, nbytes: int) -> np.ndarray[Any, Any]:
    """Sample ``i`` of the workload: its index as int64, then the byte ``i % 251``."""
    x = np.full(nbytes, i % 251, dtype=np.uint8)
    x[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
    return x


def _check(x: np.ndarray[Any, Any], seen: np.ndarray[Any, Any]) -> bool:
    """Count the batch's indices in ``seen``; True when every row holds its pattern."""
    ids = x[:, :8].copy().view(np.int64).reshape(-1)
    if ids.min() < 0 or ids.max() >= len(seen):
        return False
    np.add.at(seen, ids, 1)
    want = (ids % 251).astype(np.uint8)
    return bool((x[:, 8] == want).all() and (x[:, -1] == want).all())


async def loader_workload(ctx: Context) -> Result:
    """One shuffled epoch of the data loader (async or sync) and fio randread at the sample size."""
    from .. import data

    sample = ctx.option("sample", 128 << 10, parse_size)
    batch = ctx.option("batch", 64, int)
    mode = ctx.option("mode", "async")
    if mode not in ("async", "sync"):
        raise ValueError(f"-o mode= must be async or sync, got {mode!r}")
    if sample < 16:
        raise ValueError(f"-o sample= must be at least 16 bytes, got {sample}")
    n = max(batch, ctx.size // sample)
    prefetch = ctx.option("prefetch", max(min(n * sample // 4, 256 << 20), 4 * batch * sample), parse_size)
    path = os.path.join(ctx.workdir, f"loader-{sample}")
    try:
        ds = data.Dataset(path)  # written by an earlier repetition
    except (data.DatasetError, OSError):
        ds = None
    if ds is None or len(ds) != n or ds.keys != ["x"]:
        samples = ({"x": sample_bytes(i, sample)} for i in range(n))
        await data.write_dataset(path, samples, shard_size=1 << 40, progress=False)
        ds = data.Dataset(path)
    loader = data.Loader(ds, batch_size=batch, shuffle=True, seed=0, prefetch=prefetch, tensors="numpy")
    seen = np.zeros(n, dtype=np.int32)
    ok = True
    cold = drop_caches() is None
    gc.collect()  # a full collection owed by the set-up must not land in the timed epoch
    probe = LoopProbe()
    probe.start()
    try:
        with Timer() as t:
            if mode == "async":
                async for b in loader:
                    ok = _check(b["x"], seen) and ok
            else:

                def epoch() -> bool:
                    good = True
                    for b in loader:
                        good = _check(b["x"], seen) and good
                    return good

                ok = await asyncio.to_thread(epoch)
    finally:
        probe.stop()
        await loader.aclose()
    st = loader.stats()
    ok = ok and bool((seen == 1).all())
    figures: dict[str, float] = {
        "samples_s": n / t.wall if t.wall else 0.0,
        "cpu_us_per_sample": t.cpu / n * 1e6,
        "consumer_wait_s": st["consumer_wait_s"],
        "io_wait_s": st["io_wait_s"],
        "slabs": float(st["slabs"]),
        "cold_cache": float(cold),
    }
    notes = [
        f"loader {mode}: {n} samples of {sample} B, batch {batch}, prefetch {prefetch >> 20} MiB; "
        f"{figures['cpu_us_per_sample']:.1f} us CPU/sample"
    ]
    if mode == "async":  # sync: the loader reads on its own loop thread, not on this one
        figures["loop_cpu_max_ms"] = probe.max_cpu * 1e3
        notes[0] += f", the loop's own work at most {probe.max_cpu * 1e3:.2f} ms per 1 ms tick"
    if ctx.option("fio", 1, int):
        why = fio_unavailable()
        if why is None:
            shard = ds.layout.files[0]
            drop_caches()
            f = await asyncio.to_thread(
                fio, shard, "randread", str(sample), 64, "libaio", os.path.getsize(shard)
            )
            figures["fio_MB_s"] = f.mb_s
            figures["vs_fio"] = (st["bytes"] / t.wall / 1e6) / f.mb_s if f.mb_s and t.wall else 0.0
            notes.append(
                f"fio randread bs={sample} QD 64: {f.mb_s:.0f} MB/s; loader at {figures['vs_fio']:.2f}x"
            )
        else:
            notes.append(f"no fio: {why}")
    return t.result(
        "loader",
        st["bytes"],
        n,
        verified=ok,
        params=dict(mode=mode, sample=sample, batch=batch, prefetch=prefetch),
        figures=figures,
        notes=notes,
    )
