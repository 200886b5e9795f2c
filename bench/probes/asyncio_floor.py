"""The event loop's own cost of the gather pattern, without any I/O: 64 tasks
each awaiting one future per "read", all futures of a loop iteration resolved
together by one callback (what the reactor does with a burst of completions).

This is the floor under `aionvme gather` CPU per op that no I/O engine can
remove: a task switch, a future, a callback per operation. Compare it with
bench/probes/gather_cpu.py (the same pattern with real 4 KiB O_DIRECT reads) and with
fio's CPU per op (bench/suites/compare.py):

    python3 bench/probes/asyncio_floor.py             # asyncio and uvloop, 3 runs each
    python3 bench/probes/asyncio_floor.py --ops 200000

Each loop runs twice: with exact asyncio futures (what a Task awaiting an
aionvme transfer waited on before transfers became future-likes of their own,
resolved without a Future or a Handle: bench/JOURNAL.md, 2026-12-02) and with
a Python subclass of asyncio.Future (what the runtime used before that): a
Task takes its C fast path only for an exact Future, and the subclass also
costs more to make.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Iterator


class _SubFuture(asyncio.Future):  # type: ignore[type-arg]
    __slots__ = ("_extra",)


async def _run(ops: int, tasks: int, subclass: bool = False) -> float:
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future[int]] = []
    scheduled = False

    def pump() -> None:
        nonlocal scheduled, pending
        scheduled = False
        done, pending = pending, []
        for f in done:
            f.set_result(4096)

    def op() -> asyncio.Future[int]:
        nonlocal scheduled
        f: asyncio.Future[int] = _SubFuture(loop=loop) if subclass else loop.create_future()
        pending.append(f)
        if not scheduled:
            scheduled = True
            loop.call_soon(pump)
        return f

    async def worker(it: Iterator[int]) -> None:
        for _ in it:
            await op()

    it = iter(range(ops))
    c0 = time.process_time()
    await asyncio.gather(*(worker(it) for _ in range(tasks)))
    return (time.process_time() - c0) / ops * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    loops: list[tuple[str, object]] = [("asyncio", asyncio.run)]
    try:
        import uvloop

        loops.append(("uvloop", uvloop.run))
    except ImportError:
        pass
    for name, run in loops:
        for subclass in (False, True):
            us = [run(_run(a.ops, a.tasks, subclass)) for _ in range(a.repeat)]  # type: ignore[operator]
            kind = "Future subclass" if subclass else "exact Future"
            print(
                f"{name:8s} {kind:15s} {statistics.median(us):5.2f} us CPU per await (median of {a.repeat}: "
                + ", ".join(f"{u:.2f}" for u in us)
                + ")"
            )


if __name__ == "__main__":
    main()
