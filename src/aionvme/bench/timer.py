"""The one timer of the benchmarks: wall clock, process CPU time and the
longest event-loop stall, around any block of code."""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

from .._runtime.reactor import longest_callback
from .result import Result

__all__ = ["StallMonitor", "Timer"]


class StallMonitor:
    """Longest delay of a callback that should run every ``interval`` seconds.

    A callback scheduled with ``call_at`` measures how late it runs. With
    nothing else running the lateness is the loop's timer granularity (epoll
    and libuv time out in whole milliseconds, so ~1 ms); anything more is time
    the loop spent in other callbacks, ours included.
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.max_delay = 0.0
        self.samples = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        """Start watching the running loop (call from a coroutine or callback)."""
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + self.interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        self.max_delay = max(self.max_delay, now - self._due)
        self.samples += 1
        self._due = now + self.interval
        self._handle = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._loop = None


class Timer:
    """``with Timer() as t: ...``: wall time, user and system CPU time of the
    process, and (when an event loop runs in this thread) the longest stall of
    that loop, measured while the block ran.

    ``stalls="timer"`` (the default) watches the loop from outside with a
    :class:`StallMonitor`, which sees every callback's but wakes the loop every
    millisecond: in 4 KiB random-read runs that cost ~0.35 µs of CPU per read
    and a few percent of the IOPS (the randread suite against fio io_uring:
    0.941x with the timer, 0.979x without).
    ``stalls="reactor"`` takes the longest of aionvme's own loop callbacks
    instead (every reactor of the loop: ``aionvme.stats()["longest_callback_s"]``
    is the shared one's; the tasks they wake included), which costs nothing:
    for timing aionvme's reads against peers that are not watched either (fio).

    Examples
    --------
    >>> with Timer() as t:
    ...     pass
    >>> t.result("nothing", nbytes=0).wall_s >= 0
    True
    """

    def __init__(self, stalls: str = "timer") -> None:
        if stalls not in ("timer", "reactor"):
            raise ValueError(f"stalls must be 'timer' or 'reactor', got {stalls!r}")
        self.stalls = stalls
        self.stall = StallMonitor()
        # stalls="reactor": the loop whose reactors time themselves
        self._loop: asyncio.AbstractEventLoop | None = None
        self._longest = 0.0
        self.wall = self.cpu = self.user = self.sys = 0.0
        self._t = 0.0
        self._ru: Any = None
        self._watching = False

    def __enter__(self) -> Timer:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._watching = False
        else:
            if self.stalls == "reactor":
                self._loop = asyncio.get_running_loop()
                longest_callback(self._loop, reset=True)
            else:
                self.stall.start()
            self._watching = True
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        ru = resource.getrusage(resource.RUSAGE_SELF)
        if self._watching:
            if self._loop is not None:
                self._longest = longest_callback(self._loop, reset=True)
                self._loop = None
            else:
                self.stall.stop()
        self.user = ru.ru_utime - self._ru.ru_utime
        self.sys = ru.ru_stime - self._ru.ru_stime
        self.cpu = self.user + self.sys

    @property
    def max_stall(self) -> float:
        return self._longest if self.stalls == "reactor" else self.stall.max_delay

    def result(self, workload: str, nbytes: int, ops: int = 0, verified: bool = True, **kw: Any) -> Result:
        """A :class:`Result` of what this timer measured."""
        return Result(
            workload=workload,
            nbytes=nbytes,
            ops=ops,
            wall_s=self.wall,
            cpu_s=self.cpu,
            user_s=self.user,
            sys_s=self.sys,
            max_stall_s=self.max_stall,
            verified=verified,
            **kw,
        )
