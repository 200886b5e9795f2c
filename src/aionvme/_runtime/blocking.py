"""Blocking I/O for code without an event loop: one engine per thread, driven
by ``Engine.run``, which waits on the eventfd with the GIL released."""

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
        pair = (new_engine(), pid)
        _tls.pair = pair
    eng: Engine = pair[0]
    return eng


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
