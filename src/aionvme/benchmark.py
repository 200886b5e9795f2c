"""Old home of the benchmark workloads: :mod:`aionvme.bench` now. Kept as a
re-export so ``from aionvme import benchmark`` keeps working."""

from __future__ import annotations

from .bench import (
    GPU_WAYS,
    Result,
    StallMonitor,
    check_pattern,
    fill_pattern,
    gpu_read,
    gpu_write,
    holds_pattern,
    make_file,
    manyfiles,
    randread,
    randwrite,
    seqread,
    seqwrite,
)

__all__ = [
    "GPU_WAYS",
    "Result",
    "StallMonitor",
    "check_pattern",
    "fill_pattern",
    "gpu_read",
    "gpu_write",
    "holds_pattern",
    "make_file",
    "manyfiles",
    "randread",
    "randwrite",
    "seqread",
    "seqwrite",
]
