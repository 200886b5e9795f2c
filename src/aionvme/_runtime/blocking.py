"""Blocking I/O for code without an event loop: one engine per thread, driven
by ``Engine.run``, which waits on the eventfd with the GIL released."""

from __future__ import annotations

import errno
import threading

from .._engine import Engine, Request
from ..exceptions import os_error
from . import reactor as _reactor
from .reactor import new_engine

__all__ = ["drive", "result", "run", "thread_engine"]

_tls = threading.local()


def thread_engine() -> Engine:
    """This thread's engine for blocking calls (a fresh one after fork)."""
    pair = getattr(_tls, "pair", None)
    pid = _reactor._pid
    if pair is None or pair[1] != pid:
        pair = (new_engine(), pid)
        _tls.pair = pair
    eng: Engine = pair[0]
    return eng


def run(req: Request) -> int:
    """Drive req to the end; return its byte count or raise its error."""
    return drive(thread_engine(), req)


def drive(eng: Engine, req: Request) -> int:
    """Drive req to the end on eng (this thread's, or one it owns now); its
    byte count or its error."""
    eng.run(req)
    return result(req)


def result(req: Request) -> int:
    """The one "finished request -> byte count or raise" of the runtime, for
    the async and the blocking paths alike: the request's own error, else
    (the engine lost it, which it should never do) EIO naming the file."""
    if req.ok:
        n: int = req.nbytes
        return n
    exc = req.exception()
    raise exc if exc is not None else os_error(errno.EIO, req.file.path, op=req.op)
