"""Process-wide defaults, read from ``AIONVME_*`` environment variables at
import and changed with :func:`set`, which doubles as a context manager::

    aionvme.defaults.set(block_size="4M")           # from now on
    with aionvme.defaults.set(direct=False):        # inside the block only
        ...

============== ======================= ========================================
name           env                     meaning
============== ======================= ========================================
block_size     AIONVME_BLOCK_SIZE      bytes per chunk a request is split into
                                       (``"1M"``, ``"4MiB"``, ``"1.5M"``,
                                       ``65536``)
queue_depth    AIONVME_QUEUE_DEPTH     chunks in flight per engine (one engine
                                       per event loop / per thread for sync I/O)
threads        AIONVME_THREADS         worker threads per engine (buffered I/O,
                                       partial-block writes, fallback engine)
direct         AIONVME_DIRECT          open files with O_DIRECT (falls back to
                                       buffered where the filesystem refuses)
engine         AIONVME_ENGINE          ``auto`` (kernel AIO, else threads),
                                       ``uring`` (io_uring; fail if unavailable),
                                       ``aio`` (fail if AIO is unavailable) or
                                       ``thread`` (worker pool only)
max_inflight   AIONVME_MAX_INFLIGHT    chunks of one request in flight at once
                                       (intra-op parallelism); 0 = queue_depth
ring_reap      AIONVME_RING_REAP       reap completions from the mmapped AIO
                                       ring instead of io_getevents
submit_budget  AIONVME_SUBMIT_BUDGET   bytes submitted per loop iteration at
                                       most (io_submit pins pages: ~40 µs/MiB)
inflight_bytes AIONVME_INFLIGHT_BYTES  bytes in flight per engine at most
                                       (past the device's tags io_submit waits);
                                       blocking calls keep in flight only what
                                       the device completes in ~0.25 s, up to
                                       this (Ctrl-C waits for those bytes)
submit_batch   AIONVME_SUBMIT_BATCH    hand every N requests made in one loop
                                       iteration to the kernel at once, without
                                       waiting for the iteration to end (0: one
                                       io_submit per iteration)
submit_ramp    AIONVME_SUBMIT_RAMP     iocbs in the first io_submit of a
                                       batch, twice as many in each next call
                                       (the device starts on a batch only when
                                       its io_submit returns); 0 = one call
single_submit  AIONVME_SINGLE_SUBMIT   one io_submit per chunk instead of one
                                       per batch (used by :class:`Handle`)
refill_thread  AIONVME_REFILL_THREAD   while requests wait for chunk slots, a
                                       C thread of each kernel-AIO engine reaps
                                       their completions and refills the device
                                       without the event loop or the GIL; the
                                       loop wakes when requests finish (1)
overlap_events AIONVME_OVERLAP_EVENTS  refill the window as chunks complete;
                                       0 = batch-and-wait (used by Handle)
gpu_path       AIONVME_GPU_PATH        CUDA tensors: ``auto`` (cuFile where it
                                       does GPUDirect DMA, else pinned bounce
                                       buffers), ``gds`` (cuFile or an error,
                                       also in its compatibility mode) or
                                       ``bounce`` (never cuFile)
gpu_block_size AIONVME_GPU_BLOCK_SIZE  bytes per cuFile call (calls run in
                                       parallel) and per pinned bounce buffer
pinned_pool    AIONVME_PINNED_POOL     bytes of pinned host memory for bounce
                                       buffers, per process (allocated once,
                                       kept under RLIMIT_MEMLOCK)
write_copy     AIONVME_WRITE_COPY      O_DIRECT writes of items of 4 MiB and
                                       more: ``auto`` (through the engine's
                                       huge-page buffers when the memory is
                                       scattered in physical memory, which
                                       only a process with CAP_SYS_ADMIN can
                                       see), ``always`` or ``never`` (straight
                                       from the caller's memory)
============== ======================= ========================================

Engine-shaping settings (queue_depth, threads, engine, ring_reap, submit_ramp,
refill_thread) apply to
engines created afterwards; the others apply to every call. A config file
written by ``aionvme tune`` (or a DeepSpeed ``"aio"`` section) is applied with
:func:`load_config`, read without applying with :func:`read_config`.
"""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from typing import Any

from .exceptions import InvalidSettingError, SettingTypeError

__all__ = [
    "Settings",
    "check_call",
    "get",
    "load_config",
    "on_change",
    "parse_size",
    "positive_int",
    "read_config",
    "set",
    "settings",
    "validate",
]

_ENGINES = ("auto", "uring", "aio", "thread")
_GPU_PATHS = ("auto", "gds", "bounce")
_WRITE_COPY = ("auto", "always", "never")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZES = frozenset({"block_size", "submit_budget", "inflight_bytes", "gpu_block_size", "pinned_pool"})
_INTS = frozenset({"queue_depth", "threads", "max_inflight", "submit_batch", "submit_ramp"})
_BOOLS = frozenset({"direct", "ring_reap", "single_submit", "overlap_events", "refill_thread"})
_CHOICES = {"engine": _ENGINES, "gpu_path": _GPU_PATHS, "write_copy": _WRITE_COPY}
_BLOCK = 4096  # chunks are whole 4 KiB blocks: aligned for O_DIRECT on every device we know
# (lowest, highest) of each integer setting; None: unbounded.
_RANGES: dict[str, tuple[int, int | None]] = {
    "queue_depth": (1, 65536),
    "threads": (1, 1024),
    "max_inflight": (0, None),
    "submit_batch": (0, None),
    "submit_ramp": (0, None),
    "submit_budget": (0, None),
    "inflight_bytes": (0, None),
    "pinned_pool": (0, None),
}
# Public keyword names users pass for a setting (one name inside: the field's).
ALIASES = {"intra_op_parallelism": "max_inflight", "parallelism": "max_inflight", "backend": "engine"}


def parse_size(value: int | str, name: str = "size") -> int:
    """``4096``, ``"64K"``, ``"1M"``, ``"1MiB"``, ``"2g"``, ``"1.5G"`` -> bytes.

    Units are powers of 1024. A fraction (``"1.5G"``, ``"0.5K"``) must come to a
    whole number of bytes.

    Raises :class:`~aionvme.exceptions.SettingTypeError` for a bool, float or
    other non-int, non-str value, :class:`~aionvme.exceptions.InvalidSettingError`
    for a string that is not a size.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidSettingError.of_type(name, value, "an int or a string like '1M'")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", value, re.IGNORECASE)
    if not m:
        raise InvalidSettingError(
            f"{name}: not a size: {value!r} (examples: 4096, '64K', '1M', '1.5G')", name=name, value=value
        )
    n = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
    if n.denominator != 1:
        raise InvalidSettingError(
            f"{name}: {value!r} is not a whole number of bytes ({float(n)})", name=name, value=value
        )
    return int(n)


def _parse_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidSettingError.of_type(name, value, "an int")
    if isinstance(value, int):
        return value
    try:
        return int(value.strip())
    except ValueError:
        raise InvalidSettingError(f"{name}: not an integer: {value!r}", name=name, value=value) from None


def positive_int(name: str, value: Any) -> int:
    """value as an int >= 1, checked like every integer setting (for knobs
    outside :class:`Settings`, such as DeepSpeed's)."""
    v = _parse_int(name, value)
    if v < 1:
        raise InvalidSettingError(f"{name} must be positive, got {v}", name=name, value=value)
    return v


def _parse_bool(value: str | bool, name: str = "value") -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if not isinstance(value, str):
        raise InvalidSettingError.of_type(name, value, "a bool")
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise InvalidSettingError(f"{name}: not a boolean: {value!r}", name=name, value=value)


def validate(name: str, value: Any, label: str | None = None) -> Any:
    """The one check of a setting's value, for every entry point: converted
    (strings from the environment, the CLI or a config file, sizes like
    ``"1M"``) and range-checked.

    Parameters
    ----------
    name : str
        A :class:`Settings` field, or a public alias (``parallelism``,
        ``intra_op_parallelism``, ``backend``).
    label : str, optional
        The name the user wrote, for the message (default: ``name``).

    Raises
    ------
    SettingTypeError
        An unknown setting, or a value of the wrong type (bool or float for an
        integer, ...).
    InvalidSettingError
        A value out of range or not parseable.
    """
    label = label or name
    name = ALIASES.get(name, name)
    if name in _SIZES:
        v: Any = parse_size(value, label)
        if name in ("block_size", "gpu_block_size") and (v < _BLOCK or v % _BLOCK):
            raise InvalidSettingError(
                f"{label} must be a positive multiple of {_BLOCK}, got {v}", name=label, value=value
            )
    elif name in _INTS:
        v = _parse_int(label, value)
    elif name in _BOOLS:
        return _parse_bool(value, label)
    elif name in _CHOICES:
        if not isinstance(value, str):
            raise InvalidSettingError.of_type(label, value, f"one of {_CHOICES[name]}")
        v = value.strip().lower()
        if v not in _CHOICES[name]:
            who = name if label == name else f"{label}: {name}"
            raise InvalidSettingError(
                f"{who} must be one of {_CHOICES[name]}, got {value!r}", name=label, value=value
            )
        return v
    else:
        known = sorted([*(f.name for f in fields(Settings)), *ALIASES])
        raise SettingTypeError(f"unknown setting {label!r}; known: {known}", name=label, value=value)
    lo, hi = _RANGES.get(name, (0, None))
    if v < lo or (hi is not None and v > hi):
        if name == "max_inflight":
            rule = ">= 0 (0: no cap)"
        elif hi is None:
            rule = f">= {lo}"
        else:
            rule = f"in {lo}..{hi}"
        raise InvalidSettingError(f"{label} must be {rule}, got {v}", name=label, value=value)
    return v


def check_call(block_size: int | str | None, parallelism: int | None) -> tuple[int | None, int | None]:
    """Per-call knobs (File, the path functions) checked like the defaults."""
    block = validate("block_size", block_size) if block_size is not None else None
    par = validate("max_inflight", parallelism, "parallelism") if parallelism is not None else None
    return block, par


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
    submit_batch: int = 4
    submit_ramp: int = 4
    single_submit: bool = False
    overlap_events: bool = True
    refill_thread: bool = True
    gpu_path: str = "auto"
    gpu_block_size: int = 4 << 20
    pinned_pool: int = 64 << 20
    write_copy: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, validate(f.name, getattr(self, f.name)))
        if self.pinned_pool < 2 * self.gpu_block_size:
            raise InvalidSettingError(
                f"pinned_pool ({self.pinned_pool}) must hold at least two gpu_block_size buffers "
                f"({2 * self.gpu_block_size}): one is read while the other is copied",
                name="pinned_pool",
                value=self.pinned_pool,
            )

    @classmethod
    def coerce(cls, **values: Any) -> dict[str, Any]:
        """Validate and convert user-supplied values (strings from env/CLI);
        public aliases (``intra_op_parallelism``, ``backend``) are accepted."""
        return {ALIASES.get(k, k): validate(k, v) for k, v in values.items()}


def _from_env(environ: Mapping[str, str]) -> Settings:
    values = {}
    for f in fields(Settings):
        env = "AIONVME_" + f.name.upper()
        if env in environ:
            raw = environ[env]
            try:
                values[f.name] = validate(f.name, raw)
            except InvalidSettingError as e:
                raise type(e)(f"{env}={raw!r}: {e}", name=f.name, value=raw, variable=env) from None
    try:
        return Settings(**values)
    except InvalidSettingError as e:
        names = ", ".join(f"AIONVME_{k.upper()}" for k in values) or "the defaults"
        raise InvalidSettingError(f"{names}: {e}", name=e.name, value=e.value, variable=names) from None


_lock = threading.Lock()
settings: Settings = _from_env(os.environ)


def get(name: str | None = None) -> Any:
    """One setting by name, or all of them as a dict."""
    if name is None:
        return asdict(settings)
    return getattr(settings, name)


_listeners: list[Callable[[], None]] = []


def on_change(fn: Callable[[], None]) -> None:
    """Call fn() (no arguments, quick, never raising) each time the defaults
    change: set(), its undoing, load_config(). How the runtime keeps what it
    derived from them (a File's transfer parameters) current."""
    _listeners.append(fn)


def _changed() -> None:
    for fn in _listeners:
        fn()


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
            _changed()


def set(**values: Any) -> _Restore:
    """Change defaults now; use as ``with set(...):`` to restore them afterwards."""
    global settings
    with _lock:
        previous = settings
        settings = replace(settings, **Settings.coerce(**values))
        _changed()
    return _Restore(previous)


# -- bulk writes ---------------------------------------------------------------------
# Chunk size of the library's own bulk O_DIRECT writes of caller memory
# (checkpoint shards, TieredStore swap-outs and write-behind): at least this.
# Caller memory is mostly 4 KiB pages (torch, numpy), which the block layer
# cuts into requests of max_segments pages; fewer, larger chunks keep more
# bytes in flight. On the virtio disk of bench/README.md, 2 GiB of 32 MiB bf16
# tensors written zero-copy into a fresh file ran 1.28 GB/s in 1 MiB chunks,
# 1.38 in 4 MiB and 1.60 in 16 MiB (medians of 4 alternated runs); from
# huge-page memory, and for reads, the chunk size made no difference.
BULK_WRITE_BLOCK = 16 << 20


def bulk_write_block() -> int:
    """The chunk size for the library's bulk writes (see BULK_WRITE_BLOCK)."""
    return max(settings.block_size, BULK_WRITE_BLOCK)


# -- config files ----------------------------------------------------------------
# DeepSpeed's ZeRO "aio" section: the keys its runtime reads and the defaults it
# uses for absent ones (deepspeed/runtime/swap_tensor/constants.py, aio_config.py).
DEEPSPEED_AIO_DEFAULTS: dict[str, Any] = {
    "block_size": 1048576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
    "use_gds": False,
}
# DeepSpeed before 0.15 called intra_op_parallelism "thread_count"; ds_nvme_tune
# prints "num_threads", which DeepSpeed's runtime never reads.
_DS_TUNER_KEY = "num_threads"
_DS_ALIASES = {"thread_count": "intra_op_parallelism", _DS_TUNER_KEY: "intra_op_parallelism"}
_DS_KEYS = frozenset(DEEPSPEED_AIO_DEFAULTS) | frozenset(_DS_ALIASES)  # (set() is ours here)
# An "aionvme" section may use Handle's names for two settings.
_HANDLE_NAMES = {"intra_op_parallelism": "max_inflight", "backend": "engine"}


def read_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Settings from a config, validated, without applying them.

    Parameters
    ----------
    config : dict, or path of a JSON file
        One of:

        - what ``aionvme tune`` writes: ``{"aionvme": {...}, "aio": {...}}``;
          the ``"aionvme"`` section is used;
        - a DeepSpeed config (a dict with an ``"aio"`` key) or its ``"aio"``
          section alone, as DeepSpeed reads it: absent keys take DeepSpeed's
          defaults, ``thread_count`` is accepted for ``intra_op_parallelism``;
        - a bare dict of aionvme settings (:class:`Settings` names, or
          :class:`~aionvme.Handle`'s ``intra_op_parallelism`` and ``backend``).

    Returns
    -------
    dict
        :class:`Settings` field names to values.

    Notes
    -----
    DeepNVMe splits each request into ``intra_op_parallelism`` parts, each
    served by its own thread with ``queue_depth`` chunks in flight. The same
    number of chunks in flight per request, ``queue_depth *
    intra_op_parallelism``, becomes aionvme's engine queue depth and its
    per-request cap (``max_inflight``). A bare dict whose keys are all
    DeepSpeed ``aio`` keys is read as a DeepSpeed section; wrap aionvme's
    meaning in ``{"aionvme": {...}}``. A DeepSpeed ``block_size`` that is not a
    multiple of 4096 is rounded up to one (the engine's chunks are whole blocks).
    """
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        with open(path) as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise InvalidSettingError(f"{path}: not a JSON config: {e}", value=path) from None
    if not isinstance(config, Mapping):
        raise TypeError(f"a config is a dict or a JSON file path, not {type(config).__name__}")
    if "aionvme" in config:
        return _from_aionvme(config["aionvme"])
    if "aio" in config:
        return _from_deepspeed(config["aio"] or {})
    if config and frozenset(config) <= _DS_KEYS:
        return _from_deepspeed(config)
    return _from_aionvme(config)


def _from_aionvme(section: Any) -> dict[str, Any]:
    if not isinstance(section, Mapping):
        raise TypeError(f'the "aionvme" section must be a dict, not {type(section).__name__}')
    names = {f.name for f in fields(Settings)}
    values = {_HANDLE_NAMES.get(str(k), str(k)): v for k, v in section.items()}
    unknown = sorted(frozenset(values) - names)
    if unknown:
        raise SettingTypeError(
            f"unknown aionvme settings {unknown}; known: {sorted([*names, *_HANDLE_NAMES])}", value=unknown
        )
    out = Settings.coerce(**values)
    replace(settings, **out)  # validates ranges
    return out


def _from_deepspeed(section: Any) -> dict[str, Any]:
    if not isinstance(section, Mapping):
        raise TypeError(f'a DeepSpeed "aio" section must be a dict, not {type(section).__name__}')
    unknown = sorted(frozenset(section) - _DS_KEYS)
    if unknown:
        known = sorted(DEEPSPEED_AIO_DEFAULTS)
        raise SettingTypeError(
            f"unknown keys in the DeepSpeed aio section: {unknown}; DeepSpeed reads {known}", value=unknown
        )
    aio = dict(DEEPSPEED_AIO_DEFAULTS)
    for key, v in section.items():
        k = str(key)
        if k == _DS_TUNER_KEY:
            warnings.warn(
                f'"{_DS_TUNER_KEY}" (written by ds_nvme_tune) is ignored by DeepSpeed; '
                'aionvme reads it as "intra_op_parallelism": rename it so DeepSpeed uses it too',
                UserWarning,
                stacklevel=3,
            )
        aio[_DS_ALIASES.get(k, k)] = v
    block = parse_size(aio["block_size"], "block_size")
    depth = _parse_int("queue_depth", aio["queue_depth"]) * max(
        1, _parse_int("intra_op_parallelism", aio["intra_op_parallelism"])
    )
    if _parse_bool(aio["use_gds"], "use_gds"):
        warnings.warn(
            "use_gds: this section's knobs apply to host I/O; aionvme moves CUDA tensors with "
            "GPUDirect Storage by itself where available (aionvme.defaults gpu_path='auto', or 'gds' "
            "to require it)",
            UserWarning,
            stacklevel=3,
        )
    out = Settings.coerce(
        block_size=-(-block // 4096) * 4096,  # the engine's chunks are whole 4 KiB blocks
        queue_depth=depth,
        max_inflight=depth,
        single_submit=aio["single_submit"],
        overlap_events=aio["overlap_events"],
    )
    replace(settings, **out)
    return out


def load_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> _Restore:
    """Apply a config (see :func:`read_config`) as the defaults; like :func:`set`,
    usable as ``with load_config(path):`` to restore the previous ones."""
    return set(**read_config(config))
