"""What a streamed model is made of: its distinct tensors (*slots*) grouped
into *units* (a transformer block, the embedding with a tied head, ...), and
for each unit the reads that bring its bytes in.

Built once, by :func:`build_units`, before the model is changed; the
streamer (``_stream.py``) then makes units resident and releases them.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..formats import TensorNotFoundError
from ._index import Entry, WeightIndex

__all__ = [
    "ABSENT",
    "ALIGN",
    "LOADING",
    "READY",
    "Group",
    "Slot",
    "Unit",
    "build_units",
    "default_groups",
    "itemsize",
    "needs_copy",
    "placeholder",
    "round_up",
]

ALIGN = 4096  # O_DIRECT offset/length alignment that every device we know accepts
_MERGE_GAP = 256 * 1024  # reading a gap this small costs less than another request

ABSENT, LOADING, READY = 0, 1, 2


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Slot:
    """One distinct tensor of the model (all the names it has, tied weights included)."""

    entry: Entry
    target: torch.dtype
    param: nn.Parameter | None  # its Parameter once streaming (kept, .data swapped); None for a buffer
    buffer_refs: list[tuple[nn.Module, str]]  # every (module, name) holding it
    shape: tuple[int, ...]
    is_param: bool = False
    run: int = 0  # the read (store key) of its unit that holds its bytes
    pos: int = 0  # where its bytes are in that read


@dataclass
class Unit:
    """Weights made resident together (a block), where its reads land, and its state."""

    id: int
    name: str
    roots: list[nn.Module]
    slots: list[Slot]
    extents: list[tuple[str, int, int, int]] = field(default_factory=list)  # (file, offset, length, buf pos)
    keys: list[tuple[int, int]] = field(default_factory=list)  # the store key of each extent
    holds: list[Any] = field(default_factory=list)  # the store holds of its extents while resident
    outside: int = 0  # bytes it holds outside the store (converted copies, a direct read)
    buf_bytes: int = 0
    nbytes: int = 0  # reserved while resident: the read buffer plus converted copies
    state: int = ABSENT
    future: concurrent.futures.Future[dict[int, torch.Tensor]] | None = None
    active: int = 0


def placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of the right shape and dtype backed by one element: what a
    released weight holds (4 bytes instead of its size)."""
    return torch.zeros(1, dtype=dtype, device=device).as_strided(shape, [0] * len(shape))


def _largest_module_list(model: nn.Module) -> nn.Module | None:
    """The container of the model's repeated layers: the ModuleList (or
    Sequential) with the most children, then the most parameters."""
    best: nn.Module | None = None
    best_key = (1, 0)
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1:
            size = sum(p.numel() for p in m.parameters())
            key = (len(m), size)
            if key > best_key:
                best, best_key = m, key
    return best


def _contains(module: nn.Module, target: nn.Module) -> bool:
    return any(m is target for m in module.modules())


def _group_roots(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, recurse) per group: each child of the largest ModuleList,
    and each maximal submodule outside it that holds tensors; a module on the
    path to the list that holds tensors itself gives a group of those alone."""
    blocks = _largest_module_list(model)
    out: list[tuple[str, nn.Module, bool]] = []

    def has_tensors(m: nn.Module, recurse: bool) -> bool:
        return any(True for _ in m.parameters(recurse=recurse)) or any(
            True for _ in m.buffers(recurse=recurse)
        )

    def walk(name: str, m: nn.Module) -> None:
        if blocks is not None and m is blocks:
            for cname, c in m.named_children():
                if has_tensors(c, True):
                    out.append((f"{name}.{cname}" if name else cname, c, True))
            return
        if blocks is not None and _contains(m, blocks):
            if has_tensors(m, False):
                out.append((name or "<root>", m, False))
            for cname, c in m.named_children():
                walk(f"{name}.{cname}" if name else cname, c)
            return
        if has_tensors(m, True):
            out.append((name or "<root>", m, True))

    walk("", model)
    return out


Group = tuple[str, nn.Module, list[torch.Tensor]]  # (name, the module whose forward uses them, tensors)


def default_groups(model: nn.Module) -> list[Group]:
    """The streamer's own grouping (see :func:`_group_roots`), each group with its tensors."""
    return [
        (name, root, [*root.parameters(recurse=recurse), *root.buffers(recurse=recurse)])
        for name, root, recurse in _group_roots(model)
    ]


def build_units(
    model: nn.Module,
    index: WeightIndex,
    dtype: torch.dtype | None,
    device: torch.device,
    source: str,
    groups: list[Group] | None = None,
) -> list[Unit]:
    """The model's units: its distinct tensors found in the checkpoint (each with
    every name it has), grouped as :func:`_group_roots` groups modules (or as
    ``groups`` says), groups that share a tensor merged, and each unit's reads
    planned."""
    # Every (module, name) that refers to each distinct tensor.
    params: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    buffers: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str]]]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for pname, p in m._parameters.items():
            if p is not None:
                params.setdefault(id(p), (p, []))[1].append((m, pname, prefix + pname))
        for bname, b in m._buffers.items():
            if b is not None:
                buffers.setdefault(id(b), (b, []))[1].append((m, bname, prefix + bname))
    entries = index.entries
    slots: dict[int, Slot] = {}
    missing: list[str] = []
    if groups is not None:
        # given groups name the streamed tensors: the others are not ours to find
        ours = {id(t) for _, _, ts in groups for t in ts}
        params = {k: v for k, v in params.items() if k in ours}
        buffers = {k: v for k, v in buffers.items() if k in ours}

    def find(refs: list[tuple[nn.Module, str, str]]) -> Entry | None:
        for _, _, full in refs:
            if full in entries:
                return entries[full]
        return None

    for p, refs in params.values():
        e = find(refs)
        if e is None:
            if p.is_meta:
                missing.append(refs[0][2])
            continue
        target = _target(p.dtype, e, dtype)
        _check_shape(e, tuple(p.shape), refs[0][2])
        slots[id(p)] = Slot(e, target, None, [(m, n) for m, n, _ in refs], e.shape, is_param=True)
    for b, brefs in buffers.values():
        e = find(brefs)
        if e is None:
            if b.is_meta:
                m0, name0, full0 = brefs[0]
                if name0 in m0._non_persistent_buffers_set:
                    raise ValueError(
                        f"buffer {full0} is on the meta device, and checkpoints do not hold it "
                        "(a non-persistent buffer, computed when the module is built): build the "
                        "model with accelerate.init_empty_weights(), which leaves buffers real"
                    )
                missing.append(full0)
            continue
        target = _target(b.dtype, e, dtype)
        _check_shape(e, tuple(b.shape), brefs[0][2])
        slots[id(b)] = Slot(e, target, None, [(m, n) for m, n, _ in brefs], e.shape)
    if missing:
        raise TensorNotFoundError(missing, source)

    # Groups of modules, then the distinct tensors each one uses; groups
    # sharing a tensor (tied weights) are merged into one unit.
    if groups is None:
        groups = default_groups(model)
    group_slots: list[list[int]] = []
    for _, _, tensors in groups:
        group_slots.append([k for k in dict.fromkeys(id(t) for t in tensors) if k in slots])
    parent = list(range(len(groups)))

    def top(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for gi, keys in enumerate(group_slots):
        for k in keys:
            if k in owner:
                parent[top(gi)] = top(owner[k])
            else:
                owner[k] = gi
    merged: dict[int, list[int]] = {}
    for gi in range(len(groups)):
        if group_slots[gi]:
            merged.setdefault(top(gi), []).append(gi)
    units: list[Unit] = []
    for members in sorted(merged.values()):
        keys = list(dict.fromkeys(k for gi in members for k in group_slots[gi]))
        u = Unit(
            len(units),
            "+".join(groups[gi][0] for gi in members),
            [groups[gi][1] for gi in members],
            [slots[k] for k in keys],
        )
        _plan_reads(u, index.sizes, device)
        units.append(u)
    return units


def _target(model_dtype: torch.dtype, e: Entry, asked: torch.dtype | None) -> torch.dtype:
    stored: torch.dtype = getattr(torch, e.dtype)
    if asked is not None and stored.is_floating_point:
        return asked
    if model_dtype.is_floating_point and stored.is_floating_point:
        return model_dtype
    return stored


def _check_shape(e: Entry, shape: tuple[int, ...], name: str) -> None:
    if e.shape != shape:
        raise ValueError(f"{name}: the model has shape {shape}, the checkpoint {e.shape} ({e.path})")


def _plan_reads(u: Unit, sizes: dict[str, int], device: torch.device) -> None:
    """One request per file for the unit: its tensors' byte ranges, sorted,
    merged across small gaps, widened to the O_DIRECT alignment, packed
    into one page-aligned buffer; each tensor a view at its position."""
    by_file: dict[str, list[Slot]] = {}
    for s in u.slots:
        by_file.setdefault(s.entry.path, []).append(s)
    pos = 0
    converted = 0
    for path, ss in by_file.items():
        ss.sort(key=lambda s: s.entry.offset)
        runs: list[list[Slot]] = []
        for s in ss:
            if runs:
                last = runs[-1][-1].entry
                if s.entry.offset - (last.offset + last.nbytes) <= _MERGE_GAP:
                    runs[-1].append(s)
                    continue
            runs.append([s])
        for run in runs:
            start = run[0].entry.offset // ALIGN * ALIGN
            # widened to the block size, but not past the end of the file
            end = min(
                round_up(max(s.entry.offset + s.entry.nbytes for s in run), ALIGN),
                sizes[path],
            )
            for s in run:
                s.run = len(u.extents)
                s.pos = s.entry.offset - start
            u.keys.append((u.id, len(u.extents)))
            u.extents.append((path, start, end - start, pos))
            pos += round_up(end - start, ALIGN)
    for s in u.slots:
        if needs_copy(s, device):
            converted += round_up(s.entry.nbytes // itemsize(s.entry.dtype) * itemsize_of(s.target), 64)
    u.buf_bytes = pos
    # A converted or device copy replaces the read buffer once it is made;
    # both exist for a moment, so both are reserved.
    u.nbytes = pos + converted


def needs_copy(s: Slot, device: torch.device) -> bool:
    """The slot's tensor cannot be used in place of its read: another dtype, a
    device copy, or an offset its dtype cannot be viewed at."""
    return (
        getattr(torch, s.entry.dtype) != s.target
        or device.type != "cpu"
        or s.pos % itemsize(s.entry.dtype) != 0
    )


def itemsize(dtype_name: str) -> int:
    return int(torch.empty(0, dtype=getattr(torch, dtype_name)).element_size())


def itemsize_of(dtype: torch.dtype) -> int:
    return int(torch.empty(0, dtype=dtype).element_size())
