"""Workloads by name: what ``aionvme bench -w NAME`` runs.

A workload is an async callable that takes a :class:`Context` and returns
one :class:`~aionvme.bench.Result`. Register one with :func:`register` (a
decorator, for code that is imported anyway) or add a line to
:data:`_LAZY` (``"name": ("package.module:function", "help")``): the module
is imported only when the workload runs, so a workload may need packages
the rest of aionvme does not. ``-w package.module:function`` runs any such
callable without registering it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..exceptions import AionvmeError
from . import formats, workloads
from .pattern import make_file
from .result import Result

__all__ = ["Context", "Entry", "UnknownWorkloadError", "Workload", "get", "names", "register", "run"]

Workload = Callable[["Context"], Awaitable[Result]]
W = TypeVar("W", bound=Workload)


class UnknownWorkloadError(AionvmeError, KeyError):
    """No workload of that name is registered (the message lists those that are)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class Context:
    """What a workload is asked to do, and where.

    Attributes
    ----------
    workdir : str
        A scratch directory the workload may fill (the caller removes it).
    size : int
        The data size: a file for seq*/rand*, a state dict for the formats.
    file : str or None
        Read this file (made when missing) instead of one in ``workdir``.
    overwrite : bool
        Let ``file`` replace a file that is not a benchmark file.
    options : dict of str to str
        Workload-specific settings (``aionvme bench -o KEY=VALUE``); read
        them with :meth:`option`.
    """

    workdir: str
    size: int = 1 << 30
    file: str | None = None
    overwrite: bool = False
    request_size: int = 64 << 20
    bs: int = 4096
    iodepth: int = 64
    ops: int = 100_000
    mode: str = "gather"
    nfiles: int = 1000
    file_size: int = 1 << 20
    misalign: int = 0
    verify: bool = True
    options: dict[str, str] = field(default_factory=dict)

    def path(self, name: str = "bench.bin") -> str:
        """``file`` if given, else ``name`` in the scratch directory."""
        return self.file or os.path.join(self.workdir, name)

    def option(self, key: str, default: Any, convert: Callable[[str], Any] = str) -> Any:
        """``options[key]`` converted (e.g. with ``int`` or ``parse_size``), else ``default``."""
        return convert(self.options[key]) if key in self.options else default


@dataclass(frozen=True)
class Entry:
    """A registered workload: ``target`` is the callable or a 'module:function' string."""

    name: str
    target: Workload | str
    help: str = ""
    modes: tuple[str, ...] = ()  # values of Context.mode the workload runs in (randread: gather, batch, rows)
    in_all: bool = True  # part of ``-w all``

    def load(self) -> Workload:
        if not isinstance(self.target, str):
            return self.target
        return _import(self.target)


_REGISTRY: dict[str, Entry] = {}

# Workloads imported only when they run: "name": ("package.module:function", "help").
_LAZY: dict[str, tuple[str, str]] = {
    "deepspeed": (
        "aionvme.bench.peers:deepspeed_workload",
        "DeepSpeed's own aio_handle on the file (child process; -o op=read|write, -o grid=quick|full)",
    ),
    "loader": (
        "aionvme.bench.loader:loader_workload",
        "aionvme.data.Loader: one shuffled epoch, fio randread alongside (-o sample=128K,batch=64,mode=sync)",
    ),
    "store": ("aionvme.bench.tiered:store_workload", "TieredStore put/get/host-hit (-o value=4M -o host=16)"),
    "kv": (
        "aionvme.bench.kv:kv_workload",
        "the store as a serving engine's KV tier: load/store grid vs fio, churn, host hit "
        "(-o sizes=512K,2M,8M,32M -o batches=1,8,32,128 -o total=256M -o churn=64M)",
    ),
    "offload": (
        "aionvme.bench.offload:offload_workload",
        "offload.stream pass + Optimizer step vs their bounds",
    ),
}


def _import(target: str) -> Workload:
    mod, _, attr = target.partition(":")
    if not attr:
        raise UnknownWorkloadError(
            f"{target!r}: a workload outside the registry is 'package.module:function'"
        )
    fn: Workload = getattr(importlib.import_module(mod), attr)
    return fn


def register(
    name: str, *, help: str = "", modes: tuple[str, ...] = (), in_all: bool = True
) -> Callable[[W], W]:
    """Decorator: make ``fn(ctx) -> Result`` runnable as ``aionvme bench -w name``."""

    def deco(fn: W) -> W:
        _REGISTRY[name] = Entry(name, fn, help or (fn.__doc__ or "").strip().split("\n")[0], modes, in_all)
        return fn

    return deco


def _entries() -> dict[str, Entry]:
    out = dict(_REGISTRY)
    for name, (target, help_text) in _LAZY.items():
        out.setdefault(name, Entry(name, target, help_text))
    return out


def names(all_only: bool = False) -> list[str]:
    """Registered workload names (``all_only``: those ``-w all`` runs)."""
    return [n for n, e in _entries().items() if e.in_all or not all_only]


def get(name: str) -> Entry:
    """The entry of ``name``, or of a 'module:function' spec."""
    entry = _entries().get(name)
    if entry is not None:
        return entry
    if ":" in name:
        return Entry(name, name)
    raise UnknownWorkloadError(f"unknown workload {name!r} (known: {', '.join(names())})")


async def run(name: str, ctx: Context) -> Result:
    """Run the workload ``name`` in ``ctx`` on the running loop."""
    return await get(name).load()(ctx)


# -- the built-in workloads -----------------------------------------------------------------------


@register("seqread", help="read one file as large requests, all in flight (like loading tensors)")
async def _seqread(ctx: Context) -> Result:
    path = ctx.path()
    make_file(path, ctx.size, overwrite=ctx.overwrite)
    return await workloads.seqread(path, request_size=ctx.request_size, misalign=ctx.misalign)


@register("seqwrite", help="write a fresh file as large requests, all in flight, then fsync")
async def _seqwrite(ctx: Context) -> Result:
    # a fresh file in the scratch directory (next to --file's would risk another's data)
    return await workloads.seqwrite(
        os.path.join(ctx.workdir, "write.bin"), ctx.size, request_size=ctx.request_size
    )


@register("randread", help="random reads of bs bytes, iodepth in flight", modes=("gather", "batch", "rows"))
async def _randread(ctx: Context) -> Result:
    path = ctx.path()
    make_file(path, ctx.size, overwrite=ctx.overwrite)
    return await workloads.randread(path, ops=ctx.ops, bs=ctx.bs, iodepth=ctx.iodepth, mode=ctx.mode)


@register("randwrite", help="random writes of bs bytes, iodepth in flight")
async def _randwrite(ctx: Context) -> Result:
    path = ctx.path()
    make_file(path, ctx.size, overwrite=ctx.overwrite)
    return await workloads.randwrite(path, ops=ctx.ops, bs=ctx.bs, iodepth=ctx.iodepth)


@register("manyfiles", help="read many small files by path with one gather")
async def _manyfiles(ctx: Context) -> Result:
    d = os.path.join(ctx.workdir, "many")
    os.makedirs(d, exist_ok=True)
    return await workloads.manyfiles(d, nfiles=ctx.nfiles, file_size=ctx.file_size)


def _missing(*modules: str) -> str | None:
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError:
            return f"needs {m} (pip install {m})"
    return None


@register("safetensors", help="load_safetensors/save_safetensors vs safetensors' own (cold cache)")
async def _safetensors(ctx: Context) -> Result:
    why = _missing("torch", "safetensors")
    if why:
        return Result.skip("safetensors", why)
    return await formats.safetensors(
        ctx.workdir, ctx.size, verify=ctx.verify, pause=ctx.option("pause", 0.0, float)
    )


@register("checkpoint", help="nvme.save/load/save_in_background vs torch.save/torch.load (cold cache)")
async def _checkpoint(ctx: Context) -> Result:
    why = _missing("torch")
    if why:
        return Result.skip("checkpoint", why)
    return await formats.checkpoint(
        ctx.workdir, ctx.size, verify=ctx.verify, pause=ctx.option("pause", 0.0, float)
    )


def cuda_unavailable() -> str | None:
    """None where torch sees a CUDA device, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (
            f"torch.cuda.is_available() is False (torch {torch.__version__}; "
            "a CPU-only build or no visible GPU)"
        )
    return None


@register("gpu-read", help="file -> CUDA tensor (-o way=gds|bounce|host, -o device=cuda)", in_all=False)
async def _gpu_read(ctx: Context) -> Result:
    way = ctx.option("way", "bounce")
    why = cuda_unavailable()
    if why:
        return Result.skip("gpu-read", why, way=way)
    path = ctx.path("gpu.bin")
    make_file(path, ctx.size, overwrite=ctx.overwrite)
    return await workloads.gpu_read(
        path, way=way, request_size=ctx.request_size, device=ctx.option("device", "cuda")
    )


@register("gpu-write", help="CUDA tensor -> fresh file + fsync (-o way=..., -o device=...)", in_all=False)
async def _gpu_write(ctx: Context) -> Result:
    way = ctx.option("way", "bounce")
    why = cuda_unavailable()
    if why:
        return Result.skip("gpu-write", why, way=way)
    return await workloads.gpu_write(
        os.path.join(ctx.workdir, "gpu-w.bin"),
        ctx.size,
        way=way,
        request_size=ctx.request_size,
        device=ctx.option("device", "cuda"),
    )
