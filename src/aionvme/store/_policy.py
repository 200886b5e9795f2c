"""Eviction policies and admission control for the TieredStore's memory tiers.

A policy orders the items resident in one tier from coldest to hottest. The
store tells it what happens (``insert``, ``touch``, ``remove``) and asks it for
victims when it needs room; it skips victims it cannot evict now (held, in
flight) and asks again. A policy never sees values: the items it is given are
opaque hashable handles, one per stored version of a key, with read-only
``.key`` (the user's key) and ``.nbytes`` attributes.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol, runtime_checkable

__all__ = [
    "Admission",
    "AdmitAll",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "SecondTouch",
    "make_admission",
    "make_policy",
]


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the store needs from an eviction policy (one instance per tier).

    ``insert(item, nbytes)``: the item became resident in the tier.
    ``touch(item)``: the resident item was read (a hit).
    ``remove(item)``: the item left the tier (evicted, deleted, replaced).
    ``victims()``: resident items, coldest first. The store takes what it
    needs from the front and is done with the iterator before it changes the
    tier (it never resumes one after an ``insert``/``remove``), so the policy
    may return a live iterator (no O(items) snapshot per eviction). It may
    stop early and skip items it cannot evict now.
    Items are handles with ``.key`` and ``.nbytes``; one key may have two
    items resident for a moment while a put replaces it.
    """

    def insert(self, key: Hashable, nbytes: int) -> None: ...

    def touch(self, key: Hashable) -> None: ...

    def remove(self, key: Hashable) -> None: ...

    def victims(self) -> Iterator[Hashable]: ...


class LRUPolicy:
    """Least recently used first (the default)."""

    def __init__(self) -> None:
        self._order: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    def insert(self, key: Hashable, nbytes: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(self._order)  # live: a put that evicts reads only the cold end


class LFUPolicy:
    """Least frequently used first; least recently used among equal counts.

    Counts are kept while a key is resident (a key that comes back starts at 1).
    """

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}
        self._buckets: dict[int, collections.OrderedDict[Hashable, None]] = {}

    def insert(self, key: Hashable, nbytes: int) -> None:
        self.remove(key)
        self._count[key] = 1
        self._buckets.setdefault(1, collections.OrderedDict())[key] = None

    def touch(self, key: Hashable) -> None:
        c = self._count.get(key)
        if c is None:
            return
        b = self._buckets[c]
        del b[key]
        if not b:
            del self._buckets[c]
        self._count[key] = c + 1
        self._buckets.setdefault(c + 1, collections.OrderedDict())[key] = None

    def remove(self, key: Hashable) -> None:
        c = self._count.pop(key, None)
        if c is not None:
            b = self._buckets[c]
            del b[key]
            if not b:
                del self._buckets[c]

    def victims(self) -> Iterator[Hashable]:
        for c in sorted(self._buckets):  # live, as LRU's (a few distinct counts to sort)
            yield from self._buckets[c]


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO for new keys, a main FIFO
    for keys read again while in the small one, and a ghost FIFO of keys
    recently evicted from the small one (a ghost that comes back goes to
    main). Scan-resistant: one-hit keys leave through the small queue.

    ``small_ratio`` is the small queue's share of the tier, in keys.
    """

    def __init__(self, small_ratio: float = 0.1) -> None:
        self.small_ratio = small_ratio
        self._small: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._main: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._ghost: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._freq: dict[Hashable, int] = {}

    def insert(self, key: Hashable, nbytes: int) -> None:
        self.remove(key)
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, 3)

    def remove(self, key: Hashable) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None  # evicted from small: remembered
            limit = max(16, len(self._small) + len(self._main))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        # A generator: a put that evicts takes the few victims it needs, not
        # an O(keys) pass. Reinsertion on the way, as S3-FIFO evicts: touched
        # keys in small move to main, touched keys in main go round again
        # with their count decremented; untouched keys are the victims and
        # stay where they are (the store evicts them, or skips held ones).
        total = len(self._small) + len(self._main)
        small_target = max(1, int(total * self.small_ratio))
        yielded: set[Hashable] = set()
        for _ in range(2):
            if len(self._small) >= small_target or not self._main:
                yield from self._sweep(self._small, yielded, promote=True)
            yield from self._sweep(self._main, yielded, promote=False)
            if yielded:
                break
        # the store needs more: every other resident key, small queue first
        for k in itertools.chain(self._small, self._main):
            if k not in yielded:
                yield k

    def _sweep(
        self, q: collections.OrderedDict[Hashable, None], yielded: set[Hashable], promote: bool
    ) -> Iterator[Hashable]:
        """One pass over q's keys, front to back, each looked at once; q is
        read in slices of 64 (victims stay at its front, counted in skip)."""
        skip = seen = 0
        n = len(q)
        while seen < n:
            batch = list(itertools.islice(q, skip, skip + 64))
            if not batch:
                return
            for k in batch:
                seen += 1
                if self._freq[k] > 0:
                    if promote:
                        del q[k]
                        self._freq[k] = 0
                        self._main[k] = None
                    else:
                        self._freq[k] -= 1
                        q.move_to_end(k)
                else:
                    skip += 1
                    if k not in yielded:
                        yielded.add(k)
                        yield k
                if seen >= n:
                    return


class Admission(Protocol):
    """Decides whether a read from a colder tier is copied into a hotter one.

    ``admit(key, nbytes)`` is called on each read that misses the tier; True
    promotes the value into it. ``forget(key)`` is called when a key is deleted.
    """

    def admit(self, key: Hashable, nbytes: int) -> bool: ...

    def forget(self, key: Hashable) -> None: ...


class AdmitAll:
    """Promote on every read (the default)."""

    def admit(self, key: Hashable, nbytes: int) -> bool:
        return True

    def forget(self, key: Hashable) -> None:
        return None


class SecondTouch:
    """Promote on the second read of a key among the last ``window`` misses:
    a key read once (a scan) does not push hot keys out."""

    def __init__(self, window: int = 4096) -> None:
        self.window = window
        self._seen: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    def admit(self, key: Hashable, nbytes: int) -> bool:
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self.window:
            self._seen.popitem(last=False)
        return False

    def forget(self, key: Hashable) -> None:
        self._seen.pop(key, None)


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "s3fifo": S3FIFOPolicy,
    "s3-fifo": S3FIFOPolicy,
}


def make_policy(policy: str | Callable[[], EvictionPolicy]) -> Callable[[], EvictionPolicy]:
    """A factory of per-tier policy instances from a name or a callable."""
    if isinstance(policy, str):
        try:
            return _POLICIES[policy.lower()]
        except KeyError:
            raise ValueError(
                f"unknown policy {policy!r}: use one of {sorted(_POLICIES)} or a class"
            ) from None
    if callable(policy):
        return policy
    raise TypeError(f"policy must be a name or a callable returning a policy, got {policy!r}")


def make_admission(admit: str | Admission | None) -> Admission:
    if admit is None or admit == "always":
        return AdmitAll()
    if admit in ("second-touch", "second_touch", "2nd"):
        return SecondTouch()
    if isinstance(admit, str):
        raise ValueError(f"unknown admission {admit!r}: use 'always', 'second-touch' or an object")
    if hasattr(admit, "admit"):
        return admit
    raise TypeError(f"admit must be a name or an object with admit(key, nbytes), got {admit!r}")
