"""Sample order: a global permutation per epoch from (seed, epoch), split
between ranks like torch's DistributedSampler, cut into batches.

Pure functions of their arguments (no state, no I/O), so every rank and every
restart computes the same order.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

__all__ = ["epoch_order", "rank_part", "rank_size", "resolve_rank"]


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray[Any, Any]:
    """All n sample indices in this epoch's order (int64)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    # SeedSequence over (seed, epoch): independent streams per epoch, same on every machine
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & (2**64 - 1), epoch])))
    return rng.permutation(n).astype(np.int64, copy=False)


def rank_size(n: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank sees per epoch."""
    if drop_last:
        return n // world_size
    return math.ceil(n / world_size) if n else 0


def rank_part(
    order: np.ndarray[Any, Any], rank: int, world_size: int, drop_last: bool
) -> np.ndarray[Any, Any]:
    """This rank's samples of an epoch, as torch's DistributedSampler cuts them.

    drop_last=False: the order is padded by repeating its beginning until it
    divides evenly (a few samples are seen twice in the epoch); drop_last=True:
    its tail is dropped. Then rank r takes positions r, r + world_size, ...
    """
    n = len(order)
    per = rank_size(n, world_size, drop_last)
    total = per * world_size
    if total > n:
        reps = math.ceil(total / n)
        order = np.tile(order, reps)[:total]
    else:
        order = order[:total]
    return order[rank:total:world_size]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): given, else torch.distributed's when it is initialised, else (0, 1)."""
    if rank is None or world_size is None:
        dist_rank, dist_ws = 0, 1
        torch = sys.modules.get("torch")
        if torch is not None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                dist_rank, dist_ws = int(dist.get_rank()), int(dist.get_world_size())
        rank = dist_rank if rank is None else rank
        world_size = dist_ws if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return int(rank), int(world_size)
