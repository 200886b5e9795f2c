"""Residency planning for layer streaming: pure functions and a ledger, no I/O.

A *unit* is a group of weights made resident together (a transformer block,
the embedding with a tied output head, the final norm, ...). The *schedule*
is the order in which units run in one forward pass, treated as cyclic (the
next pass starts again at its head). The planner decides which units stay
resident for good (*pinned*) and the ledger keeps the bytes resident or in
flight under the budget at every moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..exceptions import AionvmeError

__all__ = [
    "BudgetError",
    "InferenceOnlyError",
    "Ledger",
    "ResidencyPlan",
    "StateLostError",
    "plan_residency",
    "upcoming",
]


class BudgetError(AionvmeError, MemoryError):
    """The memory budget cannot hold what must be resident at once."""


class InferenceOnlyError(AionvmeError, RuntimeError):
    """A streamed model was run with autograd on. Streaming is inference only:
    a block's weights are released once it has run, and a backward pass
    would need them again (and gradients for them). Run the model under
    ``torch.inference_mode()`` or ``torch.no_grad()``."""


class StateLostError(AionvmeError, RuntimeError):
    """Optimizer state that a failed write did not save: the step that updated
    it raised the write's error; this is raised by every later use of that
    state (a step, ``state_dict()``) until ``load_state_dict()`` replaces it.
    ``__cause__`` is the write's error."""


@dataclass(frozen=True)
class ResidencyPlan:
    """Which units stay resident, and how much room is left for streaming.

    Attributes
    ----------
    pinned : frozenset of unit ids kept resident after their first load.
    stream_room : bytes of the budget left for the units that are streamed.
    """

    pinned: frozenset[int]
    stream_room: int


def plan_residency(
    sizes: Sequence[int], schedule: Sequence[int], budget: int, prefetch: int
) -> ResidencyPlan:
    """Choose the units to keep resident under ``budget``.

    Everything is pinned when it all fits (a model that fits does no I/O after
    its first pass). Otherwise units are pinned greedily, those used most often
    in a pass first (a tied embedding/head runs twice), then in schedule order,
    while the rest still leaves room for the ``1 + prefetch`` largest streamed
    units (the one running and those being read ahead).

    Raises
    ------
    BudgetError
        When the budget cannot hold even the largest unit.
    """
    if budget <= 0:
        raise BudgetError(f"budget must be positive, got {budget}")
    n = len(sizes)
    largest = max(sizes, default=0)
    if largest > budget:
        raise BudgetError(
            f"the largest block needs {largest} bytes, more than the budget of {budget} bytes: "
            "raise the budget (every block must fit in memory while it runs)"
        )
    if sum(sizes) <= budget:
        return ResidencyPlan(frozenset(range(n)), budget - sum(sizes))
    uses = [0] * n
    first = [len(schedule)] * n
    for pos, u in enumerate(schedule):
        uses[u] += 1
        first[u] = min(first[u], pos)
    order = sorted(range(n), key=lambda u: (-uses[u], first[u], u))
    pinned: set[int] = set()
    used = 0

    def reserve(excluding: set[int]) -> int:
        rest = sorted((sizes[u] for u in range(n) if u not in excluding), reverse=True)
        return sum(rest[: 1 + max(0, prefetch)])

    for u in order:
        trial = pinned | {u}
        if used + sizes[u] + reserve(trial) <= budget and len(trial) < n:
            pinned = trial
            used += sizes[u]
    return ResidencyPlan(frozenset(pinned), budget - used)


def upcoming(schedule: Sequence[int], pos: int, count: int) -> list[int]:
    """The next ``count`` distinct units after position ``pos`` (cyclic)."""
    out: list[int] = []
    n = len(schedule)
    for k in range(n):
        if len(out) >= count:
            break
        u = schedule[(pos + k) % n]
        if u not in out:
            out.append(u)
    return out


@dataclass
class Ledger:
    """Bytes reserved per unit under a budget; the peak is what tests assert."""

    budget: int
    used: int = 0
    peak: int = 0
    held: dict[int, int] = field(default_factory=dict)

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.budget

    def reserve(self, unit: int, nbytes: int) -> None:
        if unit in self.held:
            raise ValueError(f"unit {unit} is already reserved")
        if not self.fits(nbytes):
            raise BudgetError(
                f"{nbytes} more bytes would exceed the budget ({self.used} of {self.budget} in use)"
            )
        self.held[unit] = nbytes
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, unit: int) -> None:
        self.used -= self.held.pop(unit)
