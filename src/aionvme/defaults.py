"""Process-wide defaults, read from ``AIONVME_*`` environment variables at
import and changed with :func:`set`, which doubles as a context manager::

    aionvme.defaults.set(block_size="4M")           # from now on
    with aionvme.defaults.set(direct=False):        # inside the block only
        ...

============== ======================= ========================================
name           env                     meaning
============== ======================= ========================================
block_size     AIONVME_BLOCK_SIZE      bytes per chunk a request is split into
                                       (``"1M"``, ``"4MiB"``, ``65536``)
queue_depth    AIONVME_QUEUE_DEPTH     chunks in flight per engine (one engine
                                       per event loop / per thread for sync I/O)
threads        AIONVME_THREADS         worker threads per engine (buffered I/O,
                                       partial-block writes, fallback engine)
direct         AIONVME_DIRECT          open files with O_DIRECT (falls back to
                                       buffered where the filesystem refuses)
engine         AIONVME_ENGINE          ``auto`` (kernel AIO, else threads),
                                       ``aio`` (fail if AIO is unavailable) or
                                       ``thread`` (worker pool only)
max_inflight   AIONVME_MAX_INFLIGHT    chunks of one request in flight at once
                                       (intra-op parallelism); 0 = queue_depth
ring_reap      AIONVME_RING_REAP       reap completions from the mmapped AIO
                                       ring instead of io_getevents
submit_budget  AIONVME_SUBMIT_BUDGET   bytes submitted per loop iteration at
                                       most (io_submit pins pages: ~40 µs/MiB)
inflight_bytes AIONVME_INFLIGHT_BYTES  bytes in flight per engine at most
                                       (past the device's tags io_submit waits)
============== ======================= ========================================

Engine-shaping settings (queue_depth, threads, engine, ring_reap) apply to
engines created afterwards; the others apply to every call.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["Settings", "get", "parse_size", "set", "settings"]

_ENGINES = ("auto", "aio", "thread")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """``4096``, ``"64K"``, ``"1M"``, ``"1MiB"``, ``"2g"`` -> bytes."""
    if isinstance(value, bool):
        raise TypeError("size must be an int or a string like '1M'")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {value!r} (examples: 4096, '64K', '1M')")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


@dataclass(frozen=True)
class Settings:
    block_size: int = 1 << 20
    queue_depth: int = 128
    threads: int = 8
    direct: bool = True
    engine: str = "auto"
    max_inflight: int = 0
    ring_reap: bool = True
    submit_budget: int = 8 << 20
    inflight_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.block_size < 4096 or self.block_size % 4096:
            raise ValueError(f"block_size must be a positive multiple of 4096, got {self.block_size}")
        if not 1 <= self.queue_depth <= 65536:
            raise ValueError(f"queue_depth must be in 1..65536, got {self.queue_depth}")
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must be in 1..1024, got {self.threads}")
        if self.engine not in _ENGINES:
            raise ValueError(f"engine must be one of {_ENGINES}, got {self.engine!r}")
        if self.max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0, got {self.max_inflight}")
        if self.submit_budget < 0 or self.inflight_bytes < 0:
            raise ValueError("submit_budget and inflight_bytes must be >= 0 (0: no limit)")

    @classmethod
    def coerce(cls, **values: Any) -> dict[str, Any]:
        """Validate and convert user-supplied values (strings from env/CLI)."""
        names = {f.name for f in fields(cls)}
        out: dict[str, Any] = {}
        for k, v in values.items():
            if k not in names:
                raise TypeError(f"unknown setting {k!r}; known: {sorted(names)}")
            if k in ("block_size", "submit_budget", "inflight_bytes"):
                v = parse_size(v)
            elif k in ("queue_depth", "threads", "max_inflight"):
                v = int(v)
            elif k in ("direct", "ring_reap"):
                v = _parse_bool(v)
            elif k == "engine":
                v = str(v).lower()
            out[k] = v
        return out


def _from_env(environ: Mapping[str, str]) -> Settings:
    values = {}
    for f in fields(Settings):
        env = "AIONVME_" + f.name.upper()
        if env in environ:
            values[f.name] = environ[env]
    return Settings(**Settings.coerce(**values))


_lock = threading.Lock()
settings: Settings = _from_env(os.environ)


def get(name: str | None = None) -> Any:
    """One setting by name, or all of them as a dict."""
    if name is None:
        return asdict(settings)
    return getattr(settings, name)


class _Restore:
    """What set() returns: already applied; as a context manager, undone on exit."""

    def __init__(self, previous: Settings) -> None:
        self._previous = previous

    def __enter__(self) -> Settings:
        return settings

    def __exit__(self, *exc: object) -> None:
        global settings
        with _lock:
            settings = self._previous


def set(**values: Any) -> _Restore:
    """Change defaults now; use as ``with set(...):`` to restore them afterwards."""
    global settings
    with _lock:
        previous = settings
        settings = replace(settings, **Settings.coerce(**values))
    return _Restore(previous)
