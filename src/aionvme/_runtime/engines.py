"""The engines serving one :class:`aionvme.Handle`.

The per-request knobs (block size, intra-op parallelism, submit modes,
O_DIRECT) need no engine of their own: a handle whose engine shape (queue
depth, threads, backend, ring reaping, submit ramp) matches the defaults
uses the loop's shared reactor and the thread's blocking engine, so its
transfers are batched with everything else. Otherwise it owns engines of its
shape: one reactor per event loop it is used on, and a small pool for
blocking calls (one per thread calling at the same time), made on first use
and closed by :meth:`HandleEngines.close`.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

from .. import defaults
from .._engine import Engine
from ..exceptions import EngineClosedError
from .blocking import thread_engine
from .reactor import Reactor, adopt, current_pid, get_reactor, new_engine, running_loop

__all__ = ["HandleEngines"]


class HandleEngines:
    """Which engine serves a handle here, and the ones it owns."""

    def __init__(self, settings: defaults.Settings, may_share: bool) -> None:
        self._settings = settings
        self._may_share = may_share
        self._lock = threading.Lock()
        self.closed = False
        self._pid = current_pid()
        self._reactors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Reactor] = (
            weakref.WeakKeyDictionary()
        )
        self._idle: list[Engine] = []  # private engines for blocking calls, not in use
        self._engines: list[Engine] = []  # all of them

    def _fits(self, eng: Engine) -> bool:
        """Whether a shared engine has this handle's queue depth and backend."""
        s = self._settings
        if not self._may_share or eng.queue_depth != s.queue_depth:
            return False
        if s.engine == "thread":
            return not eng.use_aio
        if s.engine == "aio":
            return bool(eng.use_aio)
        return bool(eng.use_aio) or eng.aio_error is not None

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the aionvme Handle is closed")

    def reactor(self) -> Reactor:
        """The reactor serving the handle on the running loop."""
        self._check_open()
        loop = running_loop()  # no getpid() per call: hot path
        if self._may_share:
            shared = get_reactor(loop)
            if self._fits(shared.engine):
                return shared
        r = self._reactors.get(loop)
        if r is not None and not r.closed and r.pid == current_pid():
            return r
        with self._lock:
            self._check_open()
            for old_loop, old in list(self._reactors.items()):
                if old_loop.is_closed():  # its loop is gone: nothing can await it any more
                    old.close()
                    del self._reactors[old_loop]
            r = Reactor(loop, self._settings)
            self._reactors[loop] = r
        return r

    def take(self) -> tuple[Engine, bool]:
        """(engine, pooled) for one blocking call on this thread; give a
        pooled one back with :meth:`give_back`."""
        self._check_open()
        if self._may_share:
            eng = thread_engine()
            if self._fits(eng):
                return eng, False
        with self._lock:
            self._check_open()
            if self._pid != current_pid():  # a forked child: the parent's engines were abandoned
                self._pid = current_pid()
                self._idle.clear()
                self._engines.clear()
            if self._idle:
                eng = self._idle.pop()
                # this thread drives it now: exit must not close it under us
                adopt(eng)
                return eng, True
            eng = new_engine(self._settings)  # owned by this thread
            self._engines.append(eng)
            return eng, True

    def give_back(self, eng: Engine) -> None:
        with self._lock:
            if not self.closed and eng in self._engines:
                self._idle.append(eng)
                return
        eng.close()  # the handle was closed while this call ran

    def serving_here(self) -> list[Engine]:
        """The engine serving the running loop, or outside a loop the engines
        of blocking calls (one made if there is none yet); [] once closed."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            return [self.reactor().engine]
        if self.closed:
            return []
        if self._may_share:
            eng = thread_engine()
            if self._fits(eng):
                return [eng]
        with self._lock:
            if not self._engines:
                self._engines.append(new_engine(self._settings))
                self._idle.append(self._engines[-1])
            return list(self._engines)

    def owns_some(self) -> bool:
        """Whether engines of its own are still open (for ResourceWarning)."""
        return not self.closed and self._pid == current_pid() and bool(self._engines or len(self._reactors))

    def close(self) -> None:
        """Close the engines owned (shared ones stay): transfers in flight are
        waited for, queued ones fail with EngineClosedError. A loop running
        in another thread closes its engine on its own thread."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            reactors = list(self._reactors.values())
            self._reactors.clear()
            idle, self._idle = self._idle, []
            self._engines.clear()
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for r in reactors:
            if r.loop is current or r.loop.is_closed() or not r.loop.is_running():
                r.close()
            else:
                r.loop.call_soon_threadsafe(r.close)
        for eng in idle:
            eng.close()
