"""The optimizer's parameters cut into chunks, and each chunk's state laid
out in one page-aligned blob.

A *chunk* is the parameters (of one group) whose state is read, updated and
written together. A parameter of more than two chunks' bytes is cut into
*pieces*, flat element ranges each a chunk of its own: torch's updates are
elementwise, so stepping the pieces gives the whole parameter's result bit
for bit. Everything here is pure bookkeeping on tensors, no I/O: the
optimizer (``_optimizer.py``) decides when chunks are read and written.

The smallest budget a set of parameters can be stepped in is found here too
(:func:`smallest_budget`): the largest chunk's state must fit in it whole.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._planner import StateLostError

__all__ = [
    "MASTER",
    "Chunk",
    "Layout",
    "check_saved",
    "cut",
    "join_pieces",
    "layout_of",
    "pages",
    "param_bytes",
    "piece_views",
    "settle",
    "size_text",
    "smallest_budget",
    "spec_of",
    "split_pieces",
    "view",
]

ALIGN = 64  # state tensors inside a blob start on cache-line boundaries
PAGE = 4096  # a blob is whole pages: read and written with O_DIRECT, no bounce for a tail
PIECE = 1024  # a split parameter's pieces are multiples of this many elements
LOW = (torch.bfloat16, torch.float16)  # parameters that get an fp32 master with master_weights=True
MASTER = "master"  # the state key of a parameter's fp32 master copy

Spec = tuple[tuple[int, str, torch.dtype, tuple[int, ...], int], ...]  # (param#, key, dtype, shape, pos)


@dataclass
class Chunk:
    """Parameters whose state is read, updated and written together (one group each)."""

    key: str
    params: list[tuple[int, torch.Tensor]]  # (group index, param)
    spec: Spec = ()
    nbytes: int = 0
    stored: bool = False  # its state is in the blob store
    resident: torch.Tensor | None = None  # its blob, kept in memory under the budget
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)  # non-tensor state per param#
    lost: BaseException | None = None  # the error of the write that should have saved its state
    # A piece of a split parameter: params is [(group, a view of parent's
    # elements [lo, hi))], made again at each step (see piece_views).
    parent: torch.Tensor | None = None
    lo: int = 0
    hi: int = 0


def _round(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def pages(n: int) -> int:
    return max(PAGE, _round(n, PAGE))


def spec_of(states: list[dict[str, Any]]) -> tuple[Spec, int]:
    """Where each state tensor of these parameters goes in a blob, and the bytes it spans."""
    spec = []
    pos = 0
    for i, st in enumerate(states):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                spec.append((i, k, v.dtype, tuple(v.shape), pos))
                pos += _round(v.numel() * v.element_size(), ALIGN)
    return tuple(spec), pos


def param_bytes(c: Chunk) -> int:
    return sum(p.numel() * p.element_size() for _, p in c.params)


def view(blob: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], pos: int) -> torch.Tensor:
    n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    return blob[pos : pos + n].view(dtype).reshape(shape)


def check_saved(chunks: Iterable[Chunk]) -> None:
    """StateLostError for the first chunk whose last write failed."""
    for c in chunks:
        if c.lost is not None:
            raise StateLostError(
                f"the optimizer state of chunk {c.key} was not saved (its write failed: {c.lost}); "
                "load a state_dict to go on"
            ) from c.lost


def settle(writes: list[tuple[Chunk, concurrent.futures.Future[None]]]) -> BaseException | None:
    """Wait for the writes and mark each chunk whose write failed as lost: the
    first write's error, or None."""
    first: BaseException | None = None
    for c, w in writes:
        try:
            err = w.exception()
        except concurrent.futures.CancelledError as e:
            err = e
        if err is not None:
            c.lost = err
            first = first or err
    return first


# -- cutting ---------------------------------------------------------------------------------


def cut(groups: Sequence[dict[str, Any]], chunk_size: int) -> list[Chunk]:
    """Chunks of about ``chunk_size`` parameter bytes per group, in order; a
    contiguous parameter larger than two chunks is cut into pieces of about
    ``chunk_size`` (multiples of :data:`PIECE` elements), each a chunk."""
    chunks: list[Chunk] = []
    for gi, g in enumerate(groups):
        cur: list[tuple[int, torch.Tensor]] = []
        size = 0
        for p in g["params"]:
            n = p.numel() * p.element_size()
            per = chunk_size // p.element_size() // PIECE * PIECE
            if n > 2 * chunk_size and per and p.is_contiguous() and p.numel() > per:
                # a parameter larger than two chunks: pieces of ~chunk_size, each a chunk
                if cur:
                    chunks.append(Chunk(f"g{gi}c{len(chunks)}", cur))
                    cur, size = [], 0
                for lo in range(0, p.numel(), per):
                    hi = min(p.numel(), lo + per)
                    part = p.detach().view(-1)[lo:hi]
                    chunks.append(Chunk(f"g{gi}c{len(chunks)}", [(gi, part)], parent=p, lo=lo, hi=hi))
                continue
            # a chunk less than half full takes the next parameter even past chunk_size:
            # a bias between two weights joins the next weight instead of making a tiny
            # chunk (chunks of even sizes share the pipeline's buffers best)
            if cur and size + n > chunk_size and 2 * size >= chunk_size:
                chunks.append(Chunk(f"g{gi}c{len(chunks)}", cur))
                cur, size = [], 0
            cur.append((gi, p))
            size += n
        if cur:
            chunks.append(Chunk(f"g{gi}c{len(chunks)}", cur))
    return chunks


# -- the smallest budget ---------------------------------------------------------------------

_PROBE = 2 * PIECE  # elements of the parameter a layout is measured on


@dataclass(frozen=True)
class Layout:
    """The state an optimizer keeps per parameter: bytes per element of each
    tensor as large as the parameter, and how many small tensors (a step count)."""

    per_element: tuple[int, ...]
    small: int

    def nbytes(self, numel: int) -> int:
        """State bytes of one parameter of ``numel`` elements, packed as :func:`spec_of` packs them."""
        return sum(_round(numel * b, ALIGN) for b in self.per_element) + self.small * ALIGN


ADAM = Layout((4, 4), 1)  # the guess when the optimizer cannot be probed: fp32 Adam(W)


def layout_of(
    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    group: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
) -> Layout:
    """The state layout of a fresh optimizer (``make(param_groups)``) with
    ``group``'s options, for a parameter of ``dtype`` on ``device``: measured by one step
    on a zero gradient of a :data:`_PROBE`-element parameter (made and
    dropped here). :data:`ADAM` where that step fails (an optimizer that
    needs a closure, say)."""
    p = torch.zeros(_PROBE, dtype=dtype, device=device, requires_grad=True)
    p.grad = torch.zeros_like(p)
    try:
        probe = make([{**{k: v for k, v in group.items() if k != "params"}, "params": [p]}])
        probe.step()
    except Exception:  # any optimizer's own error: its layout is then guessed, not measured
        return ADAM
    st = probe.state.get(p, {})
    tensors = [v for v in st.values() if isinstance(v, torch.Tensor)]
    per = tuple(v.element_size() for v in tensors if v.numel() == _PROBE)
    return Layout(per, sum(v.numel() != _PROBE for v in tensors))


def _need(chunks: list[Chunk], state_bytes: Callable[[int, torch.Tensor], int]) -> tuple[int, Chunk | None]:
    """The largest chunk's state in pages, and that chunk."""
    best, which = 0, None
    for c in chunks:
        n = pages(sum(state_bytes(gi, p) for gi, p in c.params))
        if n > best:
            best, which = n, c
    return best, which


def smallest_budget(
    groups: Sequence[dict[str, Any]],
    chunk_size: int,
    chunk_size_of: Callable[[int], int],
    state_bytes: Callable[[int, torch.Tensor], int],
    budget: int,
) -> tuple[int, int, Chunk | None]:
    """(the state of the largest chunk of ``chunk_size``, the smallest budget
    whose largest chunk fits in it, that chunk). ``chunk_size_of(b)`` is the
    chunk size a budget ``b`` gives, ``state_bytes(group, param)`` a
    parameter's state. A budget smaller than its largest chunk's state
    cannot step that chunk without going over it."""
    need, which = _need(cut(groups, chunk_size), state_bytes)
    if need <= budget:
        return need, budget, which

    def fits(b: int) -> bool:
        return _need(cut(groups, chunk_size_of(b)), state_bytes)[0] <= b

    hi = need  # a larger budget makes larger chunks: grow until its largest fits
    for _ in range(64):
        n = _need(cut(groups, chunk_size_of(hi)), state_bytes)[0]
        if n <= hi:
            break
        hi = n
    lo = budget  # does not fit, hi does: halve the gap down to a page
    while hi - lo > PAGE:
        mid = _round((lo + hi) // 2, PAGE)
        if mid >= hi:
            break
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return need, hi, which


def size_text(n: int) -> str:
    """``n`` bytes as the shortest string ``parse_size`` reads back exactly ("48K", "3M")."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


# -- the pieces of split parameters -----------------------------------------------------------


def piece_views(chunks: list[Chunk], grads: bool) -> None:
    """The pieces of split parameters as views of their parameter's memory
    now (made again when the parameter's memory was replaced), and their
    gradients as views of its gradient (``grads``), or none."""
    flat: dict[int, torch.Tensor | None] = {}  # each parameter's flat gradient, made once
    for c in chunks:
        p = c.parent
        if p is None:
            continue
        gi, part = c.params[0]
        if part.data_ptr() != p.data_ptr() + c.lo * p.element_size() or part.dtype != p.dtype:
            part = p.detach().view(-1)[c.lo : c.hi]
            c.params = [(gi, part)]
        if id(p) not in flat:
            g = p.grad if grads else None
            flat[id(p)] = None if g is None else g.detach().reshape(-1)  # a copy only if not contiguous
        g = flat[id(p)]
        part.grad = None if g is None else g[c.lo : c.hi]


def _pieces(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    """The chunks of each split parameter (by id(parameter)), in order."""
    out: dict[int, list[Chunk]] = {}
    for c in chunks:
        if c.parent is not None:
            out.setdefault(id(c.parent), []).append(c)
    return out


def join_pieces(state: dict[Any, Any], chunks: list[Chunk]) -> None:
    """Each split parameter's state as one entry of ``state`` (the wrapped
    optimizer's), as the optimizer in memory has it: per-element tensors
    (``exp_avg``, a master...) joined in order, the others (``step``) from
    the first piece."""
    for pieces in _pieces(chunks).values():
        parent = pieces[0].parent
        if parent is None:
            continue
        have = [c.params[0][1] in state for c in pieces]
        if not any(have):
            continue  # never stepped (no gradient yet): no state, as in memory
        if not all(have):
            # a step that failed part way through this parameter's pieces
            raise StateLostError(
                f"the optimizer state of a {tuple(parent.shape)} parameter is partial: "
                f"{sum(have)} of its {len(pieces)} pieces have state (a step failed part way); "
                "load a state_dict to go on"
            )
        sts = [state.pop(c.params[0][1]) for c in pieces]
        joined: dict[str, Any] = {}
        for k, v in sts[0].items():
            if isinstance(v, torch.Tensor) and v.numel() == pieces[0].hi - pieces[0].lo > 1:
                joined[k] = torch.cat([st[k].reshape(-1) for st in sts]).view(parent.shape)
            else:
                joined[k] = v
        state[parent] = joined


def split_pieces(state: dict[Any, Any], chunks: list[Chunk]) -> None:
    """The inverse of :func:`join_pieces`: a split parameter's state (loaded,
    or joined) into its pieces' entries, as views."""
    piece_views(chunks, grads=False)
    for pieces in _pieces(chunks).values():
        parent = pieces[0].parent
        st = None if parent is None else state.pop(parent, None)
        if parent is None or st is None:
            continue
        n = parent.numel()
        whole = {k for k, v in st.items() if isinstance(v, torch.Tensor) and v.numel() == n > 1}
        for c in pieces:
            state[c.params[0][1]] = {
                k: v.reshape(-1)[c.lo : c.hi] if k in whole else v for k, v in st.items()
            }
