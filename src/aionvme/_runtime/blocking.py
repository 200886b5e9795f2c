"""Blocking I/O for code without an event loop: one engine per thread, driven
by ``Engine.run``, which waits on the eventfd with the GIL released.

The thread's engine is adaptive (``Engine.adaptive``): it keeps in flight only
what the device completes in about 0.25 s, measured from its completions, up
to the ``inflight_bytes`` setting. Kernel AIO cannot cancel a transfer, so
Ctrl-C in a blocking call must wait for the bytes in flight; with the whole
64 MiB allowed in flight that takes 16 s on a device that delivers 4 MiB/s.
On a fast device the window grows to the setting within a few round trips.
(Engines of a Handle with its own engine shape are not adaptive: DeepNVMe's
knobs mean exactly what they say there.)"""

from __future__ import annotations

import errno
import threading

from .._engine import Engine, Request
from ..exceptions import os_error
from . import reactor as _reactor
from .reactor import new_engine

__all__ = ["run", "thread_engine"]

_tls = threading.local()


def thread_engine() -> Engine:
    """This thread's engine for blocking calls (a fresh one after fork)."""
    pair = getattr(_tls, "pair", None)
    pid = _reactor._pid
    if pair is None or pair[1] != pid:
        eng = new_engine()
        eng.adaptive = True
        pair = (eng, pid)
        _tls.pair = pair
    mine: Engine = pair[0]
    return mine


def run(req: Request, eng: Engine | None = None) -> int:
    """Drive req to the end; return its byte count or raise its error.

    On eng, or this thread's engine. The one "request -> result or raise" of
    the blocking paths (host, cuFile and bounce transfers): when the engine
    lost the request's error, which it never should, EIO naming the file."""
    (eng or thread_engine()).run(req)
    if req.ok:
        n: int = req.nbytes
        return n
    exc = req.exception()
    raise exc if exc is not None else os_error(errno.EIO, req.file.path, op=req.op)
