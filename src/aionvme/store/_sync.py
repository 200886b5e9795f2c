"""SyncTieredStore: the TieredStore for code without an event loop."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Coroutine, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from .._runtime.background import background
from ._errors import StoreClosedError
from ._store import TieredStore

__all__ = ["SyncTieredStore"]

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


class SyncTieredStore:
    """A :class:`TieredStore` with blocking methods: it lives on aionvme's
    background event loop (one daemon thread per process, shared with the
    other blocking twins), and each call waits for its result.

    Takes TieredStore's arguments. Methods: ``put``, ``get``, ``put_many``,
    ``get_many``, ``prefetch``, ``evict``, ``delete``, ``hold`` (a plain
    ``with``), ``stats``, ``keys``, ``where``, ``in``, ``len``, ``close`` (or
    ``with``). Safe to call from several threads at once. The KV-tier calls
    of TieredStore work from any thread without waiting for the loop:
    ``pin``, ``unpin``, ``touch``, ``drain_evicted``, ``count_prefix``, ``contains``,
    ``submit_put_many``, ``submit_get_many`` (futures), ``completion_fd``. ``store.aio`` is the
    TieredStore itself, for coroutines run on ``store.loop``.

    Notes
    -----
    Ctrl-C during a call cancels it and waits until its transfers have ended.
    A store belongs to the process that made it: in a forked child, make a
    new one (the parent's raises :class:`StoreClosedError` there).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.aio = TieredStore(*args, **kwargs)
        self._bg = background()
        self.loop = self._bg.loop
        self.aio._home = self.loop  # submit_* runs there
        self._closed = False
        # thread-safe without a hop to the loop (see TieredStore)
        self.pin = self.aio.pin
        self.unpin = self.aio.unpin
        self.drain_evicted = self.aio.drain_evicted
        self.touch = self.aio.touch
        self.count_prefix = self.aio.count_prefix
        self.contains = self.aio.contains
        self.submit_put_many = self.aio.submit_put_many
        self.submit_get_many = self.aio.submit_get_many
        self.completion_fd = self.aio.completion_fd

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed or self._bg.pid != os.getpid():
            coro.close()
            raise StoreClosedError(
                "the store is closed" if self._closed else "the store belongs to the parent process (fork)"
            )
        return self._bg.run(coro)

    def put(self, key: Hashable, value: Any, *, to: str | None = None, timeout: float | None = None) -> None:
        self._run(self.aio.put(key, value, to=to, timeout=timeout))

    def put_many(
        self, items: Mapping[K, Any], *, to: str | None = None, timeout: float | None = None
    ) -> None:
        self._run(self.aio.put_many(items, to=to, timeout=timeout))

    def attach(
        self,
        key: Hashable,
        path: str | os.PathLike[str],
        offset: int,
        shape: Sequence[int],
        dtype: str = "uint8",
        *,
        like: str = "torch",
    ) -> None:
        """:meth:`TieredStore.attach`: a read-only value backed by a file region."""
        self._run(self.aio.attach(key, path, offset, shape, dtype, like=like))

    def get(
        self, key: Hashable, device: str = "cpu", *, out: Any = None, timeout: float | None = None
    ) -> Any:
        return self._run(self.aio.get(key, device, out=out, timeout=timeout))

    def get_many(
        self,
        keys: Iterable[Hashable],
        device: str = "cpu",
        *,
        out: Sequence[Any] | None = None,
        missing: str = "raise",
        timeout: float | None = None,
    ) -> list[Any]:
        return self._run(self.aio.get_many(list(keys), device, out=out, missing=missing, timeout=timeout))

    def prefetch(self, keys: Iterable[Hashable], to: str = "host", *, timeout: float | None = None) -> None:
        self._run(self.aio.prefetch(list(keys), to, timeout=timeout))

    def evict(self, key: Hashable, to: str = "nvme", *, timeout: float | None = None) -> None:
        self._run(self.aio.evict(key, to, timeout=timeout))

    def delete(self, key: Hashable) -> None:
        self._run(self.aio.delete(key))

    @contextlib.contextmanager
    def hold(self, key: Hashable, device: str = "cpu", *, timeout: float | None = None) -> Iterator[Any]:
        h = self.aio.hold(key, device, timeout=timeout)
        t = self._run(h.__aenter__())
        try:
            yield t
        finally:
            self._run(h.__aexit__(None, None, None))

    def stats(self) -> dict[str, dict[str, Any]]:
        return self._run(_call(self.aio.stats))

    def keys(self) -> list[Hashable]:
        return self._run(_call(self.aio.keys))

    def where(self, key: Hashable) -> list[str]:
        return self._run(_call(self.aio.where, key))

    @property
    def evicted_lost(self) -> int:
        """:attr:`TieredStore.evicted_lost`."""
        return self.aio.evicted_lost

    def __contains__(self, key: object) -> bool:
        return key in self.aio  # thread-safe without the loop (see TieredStore.contains)

    def __len__(self) -> int:
        return int(self._run(_call(self.aio.__len__)))

    def close(self) -> None:
        """Close the store (the background loop goes on serving others)."""
        if self._closed:
            return
        try:
            self._run(self.aio.close())
        finally:
            self._closed = True

    def __enter__(self) -> SyncTieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self.aio).replace("TieredStore", "SyncTieredStore", 1)


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)
