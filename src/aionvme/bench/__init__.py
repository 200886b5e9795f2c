"""Benchmarking, library side: what ``aionvme bench``, ``aionvme tune`` and
the scripts in the repository's ``bench/`` folder measure with.

- workloads: :func:`seqread`, :func:`seqwrite`, :func:`randread` (gather or
  batch), :func:`randwrite`, :func:`manyfiles`, the formats'
  :func:`~aionvme.bench.formats.safetensors` and
  :func:`~aionvme.bench.formats.checkpoint`, :func:`gpu_read`,
  :func:`gpu_write`; by name through the registry (:func:`register`,
  :func:`run`, :class:`Context`);
- one result type, :class:`Result`, and one way to take medians
  (:func:`median`, :func:`median_result`);
- one timer, :class:`Timer` (wall, CPU, event-loop stall);
- one renderer (:mod:`aionvme.bench.render`: tables that fit the terminal,
  JSON, plots);
- the machine: :func:`scratch_dir`, :func:`run_loop`, and a cold page cache
  for any user: :func:`drop_caches` (root), :func:`evict` (a file's pages,
  no root needed), :func:`cached_bytes` (mincore), :func:`make_cold` (all three);
- the tune sweep (:mod:`aionvme.bench.tune`).

Files hold a checkable pattern (:func:`make_file`, :func:`check_pattern`):
every 8-byte word is its own offset XOR a seed, so any block read back is
verified without keeping a copy.

Examples
--------
>>> import aionvme.bench as B
>>> with B.scratch_dir() as d:
...     r = B.run_loop(B.run("seqread", B.Context(d, size=1 << 20, request_size=1 << 18)), "asyncio")
>>> r.verified, r.nbytes
(True, 1048576)
"""

from __future__ import annotations

from . import render, tune
from .formats import transformer_state_dict
from .pattern import SEED, check_pattern, fill_pattern, holds_pattern, make_file, touched_buffers
from .registry import (
    Context,
    Entry,
    UnknownWorkloadError,
    Workload,
    cuda_unavailable,
    get,
    names,
    register,
    run,
)
from .result import Result, median, median_result, spread
from .system import (
    cached_bytes,
    drop_caches,
    evict,
    local_scratch_dir,
    make_cold,
    resolve_loop,
    run_loop,
    scratch_dir,
)
from .timer import StallMonitor, Timer
from .workloads import (
    GPU_WAYS,
    gpu_read,
    gpu_write,
    manyfiles,
    random_offsets,
    randread,
    randwrite,
    seqread,
    seqwrite,
)

__all__ = [
    "GPU_WAYS",
    "SEED",
    "Context",
    "Entry",
    "Result",
    "StallMonitor",
    "Timer",
    "UnknownWorkloadError",
    "Workload",
    "cached_bytes",
    "check_pattern",
    "cuda_unavailable",
    "drop_caches",
    "evict",
    "fill_pattern",
    "get",
    "gpu_read",
    "gpu_write",
    "holds_pattern",
    "local_scratch_dir",
    "make_cold",
    "make_file",
    "manyfiles",
    "median",
    "median_result",
    "names",
    "random_offsets",
    "randread",
    "randwrite",
    "register",
    "render",
    "resolve_loop",
    "run",
    "run_loop",
    "scratch_dir",
    "seqread",
    "seqwrite",
    "spread",
    "touched_buffers",
    "transformer_state_dict",
    "tune",
]
