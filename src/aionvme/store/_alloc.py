"""An extent allocator over a byte range: aligned extents, best-fit, free
extents coalesced with their neighbours. Used for the NVMe slab files and for
the host tier's arena. Pure bookkeeping, no I/O."""

from __future__ import annotations

import bisect

__all__ = ["ExtentAllocator", "round_up"]

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class ExtentAllocator:
    """Allocates ``align``-aligned extents in ``[0, capacity)``.

    Free space is a sorted list of disjoint extents; ``free`` merges an extent
    with the free ones touching it, so a freed neighbourhood becomes one
    extent again. ``alloc`` is best-fit (the smallest free extent that fits,
    lowest offset on ties), which keeps large holes whole.

    Invariants: free extents are disjoint, non-adjacent (always coalesced),
    aligned, and within capacity; ``used + free_bytes == capacity``.
    """

    def __init__(self, capacity: int = 0, align: int = ALIGN) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.align = align
        self.capacity = 0
        self._offs: list[int] = []  # sorted offsets of free extents
        self._lens: dict[int, int] = {}  # offset -> length
        self.free_bytes = 0
        if capacity:
            self.grow(capacity)

    @property
    def used(self) -> int:
        return self.capacity - self.free_bytes

    def size_of(self, nbytes: int) -> int:
        """The extent length that holds nbytes."""
        return round_up(max(nbytes, 1), self.align)

    def grow(self, new_capacity: int) -> None:
        """Extend the range to new_capacity (rounded down to the alignment)."""
        new_capacity -= new_capacity % self.align
        if new_capacity <= self.capacity:
            return
        added = new_capacity - self.capacity
        old = self.capacity
        self.capacity = new_capacity
        self._insert(old, added)

    def largest_free(self) -> int:
        return max(self._lens.values(), default=0)

    def tail_free(self) -> int:
        """Length of the free extent that ends at capacity (0 if none)."""
        if self._offs:
            o = self._offs[-1]
            if o + self._lens[o] == self.capacity:
                return self._lens[o]
        return 0

    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes (0: all free space in one piece)."""
        if not self.free_bytes:
            return 0.0
        return 1.0 - self.largest_free() / self.free_bytes

    def extents(self) -> list[tuple[int, int]]:
        """The free extents as (offset, length), in offset order."""
        return [(o, self._lens[o]) for o in self._offs]

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``size_of(nbytes)`` bytes, or None if no free extent fits."""
        need = self.size_of(nbytes)
        best = -1
        best_len = 0
        for o in self._offs:
            ln = self._lens[o]
            if ln >= need and (best < 0 or ln < best_len):
                best, best_len = o, ln
                if ln == need:
                    break
        if best < 0:
            return None
        self._remove(best)
        if best_len > need:
            self._put(best + need, best_len - need)
        self.free_bytes -= need
        return best

    def alloc_below(self, nbytes: int, limit: int) -> int | None:
        """The lowest-placed extent for nbytes that ends at or before ``limit``
        (compaction moves data down into it), or None."""
        need = self.size_of(nbytes)
        for o in self._offs:
            if o + need > limit:
                return None
            ln = self._lens[o]
            if ln >= need:
                self._remove(o)
                if ln > need:
                    self._put(o + need, ln - need)
                self.free_bytes -= need
                return o
        return None

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark [offset, offset + size_of(nbytes)) used (rebuilding from an index).

        Raises ValueError if any part of it is not free.
        """
        need = self.size_of(nbytes)
        i = bisect.bisect_right(self._offs, offset) - 1
        if i < 0:
            raise ValueError(f"extent {offset}+{need} is not free")
        o = self._offs[i]
        ln = self._lens[o]
        if offset + need > o + ln:
            raise ValueError(f"extent {offset}+{need} is not free")
        self._remove(o)
        if offset > o:
            self._put(o, offset - o)
        if o + ln > offset + need:
            self._put(offset + need, o + ln - offset - need)
        self.free_bytes -= need

    def free(self, offset: int, nbytes: int) -> None:
        """Return an extent (as allocated: the same offset and nbytes)."""
        ln = self.size_of(nbytes)
        if offset % self.align or offset < 0 or offset + ln > self.capacity:
            raise ValueError(f"extent {offset}+{ln} is outside [0, {self.capacity})")
        self._insert(offset, ln)

    def _insert(self, offset: int, ln: int) -> None:
        i = bisect.bisect_left(self._offs, offset)
        # overlap checks: a double free must not corrupt the free list
        if i < len(self._offs) and self._offs[i] < offset + ln:
            raise ValueError(f"extent {offset}+{ln} is already (partly) free")
        if i > 0:
            p = self._offs[i - 1]
            if p + self._lens[p] > offset:
                raise ValueError(f"extent {offset}+{ln} is already (partly) free")
        self.free_bytes += ln
        if i < len(self._offs) and self._offs[i] == offset + ln:  # merge with the next
            nxt = self._offs[i]
            ln += self._lens.pop(nxt)
            del self._offs[i]
        if i > 0:
            p = self._offs[i - 1]
            if p + self._lens[p] == offset:  # merge with the previous
                self._lens[p] += ln
                return
        self._offs.insert(i, offset)
        self._lens[offset] = ln

    def _put(self, offset: int, ln: int) -> None:
        bisect.insort(self._offs, offset)
        self._lens[offset] = ln

    def _remove(self, offset: int) -> None:
        i = bisect.bisect_left(self._offs, offset)
        del self._offs[i]
        del self._lens[offset]
