"""The peers aionvme is measured against: fio and DeepSpeed's ``aio_handle``
(DeepNVMe, its real ``async_io`` op).

- :func:`fio` runs one fio job (O_DIRECT) and returns its figures as a
  :class:`~aionvme.bench.Result`; :func:`fio_unavailable` says why it cannot.
- :func:`deepspeed_sweep` times DeepSpeed's ``aio_handle`` reading (or
  writing + fsync) a whole file into (from) one buffer over a block size x
  queue depth x ``intra_op_parallelism`` grid, with buffers from
  ``new_cpu_locked_tensor`` (page-aligned, mlocked) and with plain
  page-aligned tensors (DeepSpeed reads those through a locked bounce buffer
  and copies). It runs in a child process (``python -m aionvme.bench.peers``)
  that imports DeepSpeed's own op and checks that
  :func:`aionvme.compat.deepspeed.install` is not in effect there, so what is
  measured is DeepSpeed's code, never aionvme's drop-in.
  :func:`deepspeed_unavailable` says why it cannot run (DeepSpeed missing, its
  op not built, libaio missing); nothing is built unless asked.
- ``deepspeed`` and ``fio-seqread`` are registered workloads
  (``aionvme bench -w deepspeed -o grid=quick``).

The page cache is dropped before each measurement (root only).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from .result import Result

__all__ = [
    "BUFFERS",
    "DS_GRIDS",
    "DSPoint",
    "best",
    "deepspeed_sweep",
    "deepspeed_unavailable",
    "deepspeed_workload",
    "disk_figures",
    "disk_stats",
    "fio",
    "fio_unavailable",
    "point_label",
]

#: (block_size, queue_depth, intra_op_parallelism)
DSPoint = tuple[int, int, int]

_M = 1 << 20
#: the sweeps: ``full`` is issue 17's (block 1M/4M/8M x QD 32/64/128 x IOP 1/4/8), ``write``
#: a smaller one for writes (each point writes the whole file), ``quick`` three points
#: (DeepSpeed's defaults, its best point here, and a deep parallel one)
DS_GRIDS: dict[str, list[DSPoint]] = {
    "full": [(b * _M, q, p) for b in (1, 4, 8) for q in (32, 64, 128) for p in (1, 4, 8)],
    "write": [(b * _M, q, p) for b in (1, 8) for q in (32, 128) for p in (1, 8)],
    "quick": [(1 * _M, 128, 1), (8 * _M, 32, 1), (1 * _M, 32, 8)],
}
BUFFERS = ("locked", "plain")


# -- fio --------------------------------------------------------------------------------------


def fio_unavailable() -> str | None:
    """None where fio is on PATH, else why not."""
    return None if shutil.which("fio") else "fio is not installed (apt-get install fio)"


def fio(path: str, rw: str, bs: str, iodepth: int, engine: str, size: int, **extra: Any) -> Result:
    """One fio job on ``path`` (O_DIRECT, ``--thread``), as a Result: fio's
    runtime, bytes, I/Os and its own user+sys CPU. ``extra`` become ``--key=value``
    options (``end_fsync=1``, ``io_size=...``)."""
    cmd = [
        "fio",
        "--name=job",
        f"--filename={path}",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--iodepth={iodepth}",
        f"--ioengine={engine}",
        "--direct=1",
        f"--size={size}",
        "--output-format=json",
        "--thread",
    ] + [f"--{k}={v}" for k, v in extra.items()]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
    side = job["read"] if rw in ("read", "randread") else job["write"]
    runtime = side["runtime"] / 1000.0
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime
    return Result(
        f"fio-{rw}",
        nbytes=side["io_bytes"],
        ops=side["total_ios"],
        wall_s=runtime,
        cpu_s=cpu,
        user_s=job["usr_cpu"] / 100.0 * runtime,
        sys_s=job["sys_cpu"] / 100.0 * runtime,
        params=dict(engine=engine, bs=bs, iodepth=iodepth),
    )


# -- DeepSpeed ----------------------------------------------------------------------------------


# -- what the device saw -----------------------------------------------------------------------


def disk_stats(path: str) -> list[int] | None:
    """The block device counters (``/sys/dev/block/MAJ:MIN/stat``) of the
    device holding ``path``, or None where there are none (tmpfs, overlay...)."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None


def disk_figures(before: list[int] | None, after: list[int] | None, wall_s: float) -> dict[str, float]:
    """What the device did between two :func:`disk_stats`: requests, merges,
    KiB per request and the average number of requests in the device's queue
    (time in queue / wall time), for reads and writes. Counts the whole
    device: other I/O on it at the same time is included."""
    if before is None or after is None or wall_s <= 0:
        return {}
    d = [a - b for a, b in zip(after, before, strict=False)]
    out: dict[str, float] = {}
    for side, (ios, merges, sectors, ticks) in (("read", d[0:4]), ("write", d[4:8])):
        if ios:
            out[f"dev_{side}_requests"] = float(ios)
            out[f"dev_{side}_merges"] = float(merges)
            out[f"dev_{side}_kib_per_request"] = sectors * 512 / 1024 / ios
            out[f"dev_{side}_avg_queue"] = ticks / 1000.0 / wall_s
    return out


def _built_op() -> str | None:
    """Path of a JIT-built ``async_io`` op in torch's extension cache, if any."""
    roots = [os.environ.get("TORCH_EXTENSIONS_DIR", "")]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    roots.append(os.path.join(cache, "torch_extensions", "*"))
    for root in roots:
        if root:
            for so in glob.glob(os.path.join(root, "async_io", "async_io*.so")):
                return so
    return None


def deepspeed_unavailable(build: bool = False) -> str | None:
    """None where DeepSpeed's real ``async_io`` op can be loaded without
    building it (or, with ``build``, once built: minutes), else why not.
    Imports DeepSpeed (seconds) only where no built op is found in torch's
    extension cache."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed)"
    if _built_op():
        return None
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception as e:  # DeepSpeed's import fails in many ways (ImportError, its own checks)
        return f"deepspeed is not importable ({type(e).__name__}: {e})"
    if installed_ops.get("async_io"):
        return None
    if not os.path.exists("/usr/include/libaio.h"):
        return "DeepSpeed's async_io op is not built and libaio-dev is missing (apt-get install libaio-dev)"
    if not build:
        return (
            "DeepSpeed's async_io op is not built (build it once, ~4 min: python3 -c 'from "
            "deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()', needs "
            "libaio-dev and ninja; or pass --ds-build / -o build=1)"
        )
    return None


def deepspeed_sweep(
    path: str,
    op: str = "read",
    points: Iterable[DSPoint] = DS_GRIDS["quick"],
    buffers: Sequence[str] = BUFFERS,
    *,
    size: int = 1 << 30,
    build: bool = False,
    timeout: float = 1800.0,
    wrap: Sequence[str] = (),
) -> list[Result]:
    """Time DeepSpeed's ``aio_handle`` on ``path`` at every point and buffer
    kind, in a child process, page cache dropped before each.

    Parameters
    ----------
    path : str
        For ``op="read"`` an existing benchmark file (:func:`~aionvme.bench.make_file`),
        read whole into one buffer; for ``op="write"`` the file to (re)create:
        ``size`` bytes written from one buffer, then fsynced.
    op : {"read", "write"}
    points : iterable of (block_size, queue_depth, intra_op_parallelism)
    buffers : sequence of {"locked", "plain"}
    size : int
        Bytes to write (``op="write"`` only).
    build : bool
        Build DeepSpeed's op first when it is not (minutes).
    wrap : sequence of str
        A command the child runs under (``["strace", "-f", ...]``).

    Returns
    -------
    list of Result
        One per point and buffer (``params``: block_size, queue_depth,
        intra_op_parallelism, buffer, op_file), or one skipped Result saying why
        DeepSpeed could not run.

    Notes
    -----
    The file size must be divisible by every ``intra_op_parallelism`` (DeepSpeed
    refuses otherwise). Timed: the ``sync_pread``/``sync_pwrite`` call (and the
    fsync for writes); the buffer is allocated and faulted in before.
    """
    why = deepspeed_unavailable(build)
    if why:
        return [Result.skip(f"deepspeed-{op}", why)]
    spec = dict(
        path=path, op=op, size=size, points=[list(p) for p in points], buffers=list(buffers), build=build
    )
    env = dict(os.environ)
    env.pop("AIONVME_DEEPSPEED", None)
    proc = subprocess.run(
        [*wrap, sys.executable, "-m", "aionvme.bench.peers", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    out = [
        Result.from_dict(json.loads(line[4:])) for line in proc.stdout.splitlines() if line.startswith("RES ")
    ]
    if proc.returncode != 0 or not out:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [Result.skip(f"deepspeed-{op}", f"the DeepSpeed child failed (rc {proc.returncode}): {tail}")]
    return out


def point_label(r: Result) -> str:
    """``bs=1M qd=128 iop=1``: a DeepSpeed result's point."""
    p = r.params
    return f"bs={p['block_size'] >> 20}M qd={p['queue_depth']} iop={p['intra_op_parallelism']}"


def best(results: Iterable[Result], buffer: str | None = None) -> Result | None:
    """The fastest verified, not skipped result (of ``buffer`` kind when given)."""
    ok = [
        r for r in results if r.skipped is None and r.verified and (buffer in (None, r.params.get("buffer")))
    ]
    return max(ok, key=lambda r: r.mb_s) if ok else None


# -- the child: DeepSpeed's own op, aionvme's drop-in NOT installed -------------------------------------


def _page_aligned(nbytes: int) -> Any:
    """A plain page-aligned uint8 tensor (anonymous mmap: no MADV_HUGEPAGE, no
    mlock), every page touched."""
    import mmap

    import numpy as np
    import torch

    m = mmap.mmap(-1, nbytes)
    a = np.frombuffer(m, dtype=np.uint8)
    a[::4096] = 1
    return torch.from_numpy(a), m


def _emit(r: Result) -> None:
    """One result line of the child's protocol (``RES {json}``) on stdout."""
    sys.stdout.write("RES " + json.dumps(r.to_dict()) + "\n")
    sys.stdout.flush()


def _child(spec: dict[str, Any]) -> int:
    import numpy as np
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from ..compat import deepspeed as dropin
    from .pattern import check_pattern, fill_pattern
    from .system import drop_caches
    from .timer import Timer

    if dropin.installed():
        raise RuntimeError("aionvme.compat.deepspeed.install() is in effect: not DeepSpeed's own op")
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        _emit(Result.skip("deepspeed", "AsyncIOBuilder().is_compatible() is False"))
        return 0
    lib = builder.load(verbose=False)
    op_file = getattr(lib, "__file__", "") or ""
    if "aionvme" in op_file or not op_file.endswith(".so"):
        raise RuntimeError(f"AsyncIOBuilder().load() gave {op_file!r}, not DeepSpeed's built op")
    path, op = spec["path"], spec["op"]
    size = os.path.getsize(path) if op == "read" else int(spec.get("size", 1 << 30))
    cold = drop_caches() is None
    for bs, qd, iop in spec["points"]:
        for kind in spec["buffers"]:
            h = lib.aio_handle(bs, qd, False, False, iop)
            keep: Any = None
            if kind == "locked":
                t = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
            else:
                t, keep = _page_aligned(size)
            arr = t.numpy()
            if op == "write":
                fill_pattern(arr, 0)
                if os.path.exists(path):
                    os.unlink(path)
            drop_caches()
            before = disk_stats(path) if op == "read" else disk_stats(os.path.dirname(path) or ".")
            with Timer() as timer:
                if op == "read":
                    n = h.sync_pread(t, path)
                else:
                    n = h.sync_pwrite(t, path)
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            after = disk_stats(path)
            if op == "read":
                ok = n > 0 and check_pattern(arr, 0)
            else:
                ok = n > 0 and os.path.getsize(path) == size
                if ok:
                    with open(path, "rb") as f:
                        f.seek(size - 4096)
                        ok = check_pattern(np.frombuffer(f.read(4096), np.uint8).copy(), size - 4096)
            res = timer.result(
                f"deepspeed-{op}",
                size,
                -(-size // bs),
                ok,
                params=dict(
                    block_size=bs,
                    queue_depth=qd,
                    intra_op_parallelism=iop,
                    buffer=kind,
                    op_file=op_file,
                    cold_cache=cold,
                ),
                figures=disk_figures(before, after, timer.wall),
            )
            _emit(res)
            if kind == "locked":
                h.free_cpu_locked_tensor(t)
            del t, arr, keep, h
    return 0


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))  # errors raise: the parent sees a non-zero status and the traceback


async def deepspeed_workload(ctx: Any) -> Result:
    """The ``deepspeed`` workload: DeepSpeed's ``aio_handle`` reading ``ctx``'s
    file whole into one buffer (``-o op=write``: writing it + fsync), best of
    ``-o grid=quick|full|write`` (quick) over ``-o buffers=locked,plain``;
    ``-o build=1`` builds DeepSpeed's op when missing. ``figures`` holds every
    point's MB/s (``"{buffer} bs=..M qd=.. iop=.."``)."""
    import asyncio

    from .pattern import make_file

    op = ctx.option("op", "read")
    if op not in ("read", "write"):
        return Result.skip(f"deepspeed-{op}", "op must be read or write")
    grid = ctx.option("grid", "quick")
    if grid not in DS_GRIDS:
        return Result.skip(f"deepspeed-{op}", f"grid must be one of {', '.join(DS_GRIDS)}")
    kinds = tuple(k for k in ctx.option("buffers", "locked,plain").split(",") if k in BUFFERS)
    if op == "read":
        path = ctx.path()
        make_file(path, ctx.size, overwrite=ctx.overwrite)
    else:
        path = os.path.join(ctx.workdir, "ds-write.bin")
    got = await asyncio.to_thread(
        deepspeed_sweep,
        path,
        op,
        DS_GRIDS[grid],
        kinds,
        size=ctx.size,
        build=bool(ctx.option("build", 0, int)),
    )
    top = best(got)
    if top is None:
        return got[0] if got[0].skipped else Result(f"deepspeed-{op}", verified=False)
    for r in got:
        p = r.params
        if r.skipped is None:
            top.figures[f"{p['buffer']} {point_label(r)}"] = round(r.mb_s, 1)
    top.notes.append(f"best of {len(got)} points (figures: MB/s of each)")
    return top
