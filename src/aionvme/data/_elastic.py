"""Elastic resume: the states of all ranks of a world of size A merged into one
state that a loader of any rank at any world size B loads, so that the rest
of the epoch is covered exactly once, in the same shuffled order.

The model (pure functions, no I/O). An epoch's order is the permutation of
:func:`~aionvme.data.epoch_order` (seed, epoch, shuffle), whatever the world
size. A *phase* is a stretch of the epoch run at one world size: its ranks
split a list of samples (the whole order in the first phase) as torch's
DistributedSampler does (rank r takes positions r, r + ws, ... of the list
padded by repeating its beginning, or cut, :func:`~aionvme.data.rank_part`),
and each rank's state records how many of its part it handed out. The
samples handed out by any rank of the phase are *consumed*; the *rest* of
the epoch is the phase's list with every consumed sample removed, in the
list's order. The next phase splits the rest the same way among its ranks.
A merged state records the phases of the epoch so far (world size and the
positions of every rank): any loader recomputes the rest from them.

Why per-rank positions and not one global count (MosaicML streaming's
``sample_in_epoch``, which drops that many samples from the front of a
fixed global order, rounded down to a multiple of the node count): ranks
that stop unevenly (a rank that raised, one a step ahead) consumed a set
that is no prefix of the order; a count would repeat or skip samples. Here
the consumed set is exact, so nothing is repeated or skipped whatever the
stop points, at the price of O(sum of world sizes) integers in the state
and an O(n) pass (a byte per sample) to recompute the rest.

This is the same rule as resuming at the same world size: when every rank
stopped at the same position p, the rest is the order from A * p on, and
the new ranks' parts at B == A are the old parts from p on.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._errors import LoaderStateError
from ._order import rank_size

__all__ = ["STATE_VERSION", "Phases", "check_whole", "merge_states", "rest_count", "rest_index"]

STATE_VERSION = 2  # 2: the "resumed" phases (elastic resume); 1 (no phases) still loads

# ((world_size, (position of rank 0, position of rank 1, ...)), ...): the epoch's earlier phases
Phases = tuple[tuple[int, tuple[int, ...]], ...]

_SAME = ("seed", "shuffle", "drop_last", "samples")


def rest_index(n: int, phases: Phases, drop_last: bool) -> np.ndarray[Any, Any]:
    """Positions in the epoch's order (of n samples) not consumed by the phases, in order (int64)."""
    rest = np.arange(n, dtype=np.int64)
    for ws, positions in phases:
        m = len(rest)
        if m == 0:
            break
        done = np.zeros(m, dtype=bool)
        for r, p in enumerate(positions):
            if p:
                # rank r's part is the list padded (index mod m) or cut, at r, r + ws, ...
                done[(r + ws * np.arange(p, dtype=np.int64)) % m] = True
        rest = rest[~done]
    return rest


@functools.lru_cache(maxsize=16)
def rest_count(n: int, phases: Phases, drop_last: bool) -> int:
    """len(rest_index(n, phases, drop_last)) (kept: ``len(loader)`` asks often)."""
    return len(rest_index(n, phases, drop_last))


def phases_of(state: dict[str, Any]) -> Phases:
    """The phases recorded in a state (none in a version-1 state), checked for shape."""
    raw = state.get("resumed", ())
    try:
        phases = tuple((int(ws), tuple(int(p) for p in pos)) for ws, pos in _pairs(raw))
    except (TypeError, ValueError, KeyError) as e:
        raise LoaderStateError(f"state_dict has a malformed 'resumed' entry: {raw!r}") from e
    for ws, pos in phases:
        if ws < 1 or len(pos) != ws or min(pos) < 0:
            raise LoaderStateError(
                f"state_dict has a malformed phase: world_size={ws}, positions={list(pos)}"
            )
    return phases


def check_whole(state: dict[str, Any], key: str) -> None:
    """A state's count field is a whole number (not a bool or a float), >= 0
    (world_size >= 1): LoaderStateError if not."""
    v = state.get(key)
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < (1 if key == "world_size" else 0):
        least = " >= 1" if key == "world_size" else ""
        raise LoaderStateError(f"state_dict has {key}={v!r}: a whole number{least}")


def _pairs(raw: Any) -> list[tuple[Any, Any]]:
    out = []
    for ph in raw:
        if isinstance(ph, dict):
            out.append((ph["world_size"], ph["positions"]))
        else:
            ws, pos = ph
            out.append((ws, pos))
    return out


def phases_to_state(phases: Phases) -> list[dict[str, Any]]:
    """Phases as plain lists and ints (JSON, ``torch.save`` with ``weights_only``)."""
    return [{"world_size": ws, "positions": list(pos)} for ws, pos in phases]


def check_phases(n: int, phases: Phases, drop_last: bool) -> None:
    """Every recorded position within its rank's part of that phase."""
    rest = n
    for k, (ws, pos) in enumerate(phases):
        per = rank_size(rest, ws, drop_last)
        for r, p in enumerate(pos):
            if p > per:
                raise LoaderStateError(
                    f"state_dict phase {k} (world_size {ws}): rank {r} at position {p}, "
                    f"past the {per} samples of its part"
                )
        rest = rest_count(n, phases[: k + 1], drop_last)


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge the :meth:`Loader.state_dict` of every rank of one world into one
    state that a loader of any rank at any world size loads.

    Parameters
    ----------
    states : sequence of dict
        One state per rank, ranks 0 .. world_size - 1 each exactly once (any
        order), as ``torch.distributed.all_gather_object`` gives them. Ranks
        may have progressed unevenly, and a rank may already have finished
        the epoch (its state is then the next epoch's, at position 0).

    Returns
    -------
    dict
        A state with ``rank`` and ``world_size`` None: pass it to
        ``load_state_dict`` of every new rank's loader (same dataset, seed,
        shuffle and drop_last; any world size and batch size).

    Raises
    ------
    LoaderStateError (a ValueError)
        States of different datasets, seeds, shuffle or drop_last, a rank
        missing or given twice, ranks more than one epoch apart, positions
        out of range.

    Notes
    -----
    **What "exactly once" covers.** A sample counts as consumed when its batch
    was handed out (the state is taken between steps: a batch handed out but
    not yet trained on counts as consumed). Samples read ahead but not handed
    out, and batches whose reads were in flight, are not consumed: they come
    again after the resume. Over the whole epoch, every sample is then handed
    out once, in the first phases or in the rest, except:

    - padding (``drop_last=False``): a phase whose list does not divide by
      its world size repeats the list's first samples to even the ranks out
      (fewer than world-size repeats per phase, as DistributedSampler does);
    - dropping (``drop_last=True``): a phase cuts the last
      ``len(list) % world_size`` samples of its list, and each rank drops its
      last incomplete batch. A rank that finished the epoch counts its part
      as consumed, the dropped batch included. Cut samples of one phase are
      not consumed, so the next phase's list still holds them.

    The rest keeps the epoch's order: its samples come in the order the
    shuffle gave them, split among the new ranks by the same rule.
    """
    if not states:
        raise LoaderStateError("merge_states needs the state of every rank: got none")
    for s in states:
        if not isinstance(s, dict):
            raise LoaderStateError(f"merge_states takes Loader.state_dict() dicts, got {type(s).__name__}")
        if s.get("world_size") is None or s.get("rank") is None:
            raise LoaderStateError(
                "a merged state cannot be merged again: load it into the new ranks' loaders, "
                "and merge their states"
            )
        v = s.get("version", 1)
        if not isinstance(v, int) or v > STATE_VERSION:
            raise LoaderStateError(f"state_dict version {v!r} is newer than this aionvme ({STATE_VERSION})")
    for s in states:
        for k in ("rank", "world_size", "epoch", "position", "samples"):
            check_whole(s, k)
    first = states[0]
    for s in states:
        for k in (*_SAME, "world_size"):
            if s.get(k) != first.get(k):
                raise LoaderStateError(
                    f"states of different loaders: {k}={s.get(k)!r} (rank {s.get('rank')}) "
                    f"against {first.get(k)!r} (rank {first.get('rank')})"
                )
    ws = int(first["world_size"])
    ranks = sorted(int(s["rank"]) for s in states)
    if len(ranks) != ws or ranks != list(range(ws)):  # (no list of a hostile world_size's length)
        given = {r for r in ranks if 0 <= r < ws}
        missing = [r for r in range(min(ws, len(ranks) + 10)) if r not in given][:10]
        more = ws - len(given) - len(missing)
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        raise LoaderStateError(
            f"merge_states needs each of the {ws} ranks' states once, got {len(states)}: "
            f"missing {missing}{f' and {more} more' if more else ''}, given twice {twice}, "
            f"out of range {[r for r in ranks if not 0 <= r < ws]}"
        )
    n, drop_last = int(first["samples"]), bool(first["drop_last"])
    epochs = {int(s["epoch"]) for s in states}
    e = min(epochs)
    if max(epochs) > e + 1:
        raise LoaderStateError(f"ranks are more than an epoch apart: epochs {sorted(epochs)}")
    ahead = [s for s in states if int(s["epoch"]) == e + 1]
    behind = [s for s in states if int(s["epoch"]) == e]
    if not behind:  # all in one epoch: e is it
        behind, ahead = ahead, []
    elif ahead and any(int(s["position"]) != 0 or phases_of(s) for s in ahead):
        raise LoaderStateError(
            f"ranks in epoch {e} while others went on into epoch {e + 1}: merge states taken at the same step"
        )
    epoch = int(behind[0]["epoch"])
    phases = phases_of(behind[0])
    for s in behind:
        if phases_of(s) != phases:
            raise LoaderStateError(
                f"ranks {behind[0]['rank']} and {s['rank']} resumed from different merged states"
            )
    check_phases(n, phases, drop_last)
    rest = rest_count(n, phases, drop_last)
    part = rank_size(rest, ws, drop_last)
    positions = [0] * ws
    for s in behind:
        p = int(s["position"])
        if not 0 <= p <= part:
            raise LoaderStateError(f"rank {s['rank']} at position {p}: its part has {part} samples")
        positions[int(s["rank"])] = p
    for s in ahead:  # finished the epoch: its whole part counts (a dropped last batch included)
        positions[int(s["rank"])] = part
    new: Phases = (*phases, (ws, tuple(positions)))
    if not ahead and all(p == 0 for p in positions):
        new = phases  # nobody moved: the same phases (no empty phase recorded)
    return {
        "version": STATE_VERSION,
        "merged": True,
        "epoch": epoch,
        "position": 0,
        "seed": first["seed"],
        "shuffle": first["shuffle"],
        "drop_last": first["drop_last"],
        "rank": None,
        "world_size": None,
        "samples": n,
        "resumed": phases_to_state(new),
    }
