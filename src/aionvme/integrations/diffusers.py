"""diffusers' group offloading to disk, each byte read once and the next group read ahead.

::

    from aionvme.integrations.diffusers import apply_group_offloading   # was diffusers.hooks'
    apply_group_offloading(unet, onload_device="cpu", offload_type="block_level",
                           num_blocks_per_group=1, offload_to_disk_path="/nvme/unet")
    with torch.no_grad():
        out = unet(sample, t).sample            # bit for bit diffusers' own group offload to disk

diffusers' own disk path (``ModuleGroup._onload_from_disk``) loads each group
with ``safetensors.torch.load_file`` when the group's first block starts, and
nothing ahead. Here the grouping is diffusers' (the children of the model's
``ModuleList``/``Sequential`` children are blocks, ``block_modules`` are
recursed into, and everything else is one group, resident for the whole
forward), each block a group of its own, saved once as its own safetensors
file; the forward runs under
:class:`aionvme.offload.Streamer` (the engine of ``aionvme.offload.stream``):
a group is read in one O_DIRECT request into memory that the model uses in
place, the next ``prefetch`` groups are read while one computes, within
``budget`` bytes. diffusers keeps its loader inside ``ModuleGroup``, with no
hook to give it another, so this is a replacement with the same call shape,
applied with torch's module hooks, not a patch of diffusers.

diffusers is not imported by this module (the models are torch modules).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_write
from ..defaults import parse_size
from ..formats._header import TORCH_CODES, build_header
from ..memory import empty
from ..offload._index import read_index
from ..offload._loop import LoopThread
from ..offload._stream import start_streamer, streamer_of
from ..offload._units import ALIGN, Group, round_up

__all__ = ["apply_group_offloading", "remove_group_offloading", "stats"]

INDEX_NAME = "aionvme-groups.safetensors.index.json"
_TENSOR_ALIGN = 64  # torch's CPU allocator aligns to 64 bytes
_ATTR = "_aionvme_streamer"  # the attribute stream() uses: streamer_of() finds it


def _block_groups(
    module: nn.Module, n: int, block_modules: set[str], prefix: str, out: list[Group]
) -> set[int]:
    """diffusers' block-level grouping of ``module`` (``_apply_group_offloading_block_level``):
    the children of each ``ModuleList``/``Sequential`` child are blocks, the
    ``block_modules`` children are recursed into, and the rest (other children
    and the module's own tensors) is one group led by ``module``, resident for
    its whole forward. Each block is a group of its own here (read alone, the
    next one ahead): ``n``, diffusers' blocks per group, sizes the default
    budget instead. Returns the ids of the tensors placed in a group."""
    placed: set[int] = set()
    rest: list[torch.Tensor] = []
    for name, child in module.named_children():
        if name in block_modules:
            placed |= _block_groups(child, n, block_modules, f"{prefix}{name}.", out)
            # diffusers' recursion leaves the child's own remainder led by the child
        elif isinstance(child, (nn.ModuleList, nn.Sequential)):
            kids = list(child)
            for i in range(0, len(kids), n):
                for j, m in enumerate(kids[i : i + n]):
                    ts = [*m.parameters(), *m.buffers()]
                    placed |= {id(t) for t in ts}
                    out.append((f"{prefix}{name}.{i + j}", m, ts))
        else:
            rest.extend((*child.parameters(), *child.buffers()))
    rest.extend((*module.parameters(recurse=False), *module.buffers(recurse=False)))
    rest = [t for t in rest if id(t) not in placed]
    if rest:
        out.append((f"{prefix}<rest>", module, rest))
    return placed | {id(t) for t in rest}


def _write_group(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file whose every tensor starts at a multiple of 64 bytes in the file
    (and so in the page-aligned memory it is read into), as torch's own allocations do:
    some CPU kernels sum in another order for weights at other addresses (diffusers' own
    files, 8-byte aligned, give UNet outputs ~1e-6 off the model in memory). The gaps are
    ``U8`` padding entries, so the file has no holes and any safetensors reader reads it."""
    entries: list[tuple[str, str, tuple[int, ...], int, int]] = []
    parts: list[tuple[torch.Tensor, int]] = []
    pos = 0
    for i, (name, t) in enumerate(tensors.items()):
        gap = -pos % _TENSOR_ALIGN
        if gap:
            entries.append((f"__aionvme_pad_{i}", "U8", (gap,), pos, pos + gap))
            pos += gap
        t = t.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        entries.append((name, TORCH_CODES[str(t.dtype).removeprefix("torch.")], tuple(t.shape), pos, pos + n))
        parts.append((t, pos))
        pos += n
    header = build_header(entries, {"writer": "aionvme.integrations.diffusers"}, _TENSOR_ALIGN)
    buf = empty(len(header) + pos, "uint8", like="torch")
    buf[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for t, at in parts:
        n = t.numel() * t.element_size()
        if n:
            buf[len(header) + at : len(header) + at + n] = t.reshape(-1).view(torch.uint8)
    with atomic_write(path) as f:
        f.sync_pwrite(buf, 0)


def _save_groups(model: nn.Module, groups: list[Group], folder: str) -> str:
    """Each group's tensors in a safetensors file of its own (by their model names), and an
    index of them; kept when the index is already there (as diffusers keeps its files)."""
    index_path = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index_path):
        return index_path
    os.makedirs(folder, exist_ok=True)
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    for n, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), n)
    weight_map: dict[str, str] = {}
    for gname, _, tensors in groups:
        todo = {names[id(t)]: t for t in tensors if id(t) in names and names[id(t)] not in weight_map}
        if not todo:
            continue
        fname = f"aionvme-group-{hashlib.sha256(gname.encode()).hexdigest()[:12]}.safetensors"
        _write_group(os.path.join(folder, fname), todo)
        weight_map.update(dict.fromkeys(todo, fname))
    tmp = index_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:  # written last: its presence means every group file is
        json.dump({"metadata": {"writer": "aionvme.integrations.diffusers"}, "weight_map": weight_map}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, index_path)
    return index_path


def _default_budget(
    model: nn.Module, groups: list[Group], entries: dict[str, Any], sizes: dict[str, int], blocks: int
) -> int:
    """What diffusers holds at once (every remainder group, and ``blocks`` of the largest
    block), each group counted as the streamer reads it: its files, rounded to blocks."""
    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}

    def group_bytes(tensors: list[torch.Tensor]) -> int:
        files = {entries[names[id(t)]].path for t in tensors if names.get(id(t)) in entries}
        return sum(round_up(sizes[f], ALIGN) for f in files)

    rest = sum(group_bytes(ts) for n, _, ts in groups if n.endswith("<rest>"))
    block = max((group_bytes(ts) for n, _, ts in groups if not n.endswith("<rest>")), default=0)
    return rest + blocks * block


def apply_group_offloading(
    module: nn.Module,
    onload_device: str | torch.device,
    offload_device: str | torch.device = "cpu",
    offload_type: str = "block_level",
    num_blocks_per_group: int | None = None,
    non_blocking: bool = False,
    use_stream: bool = False,
    record_stream: bool = False,
    low_cpu_mem_usage: bool = False,
    offload_to_disk_path: str | os.PathLike[str] | None = None,
    block_modules: list[str] | None = None,
    exclude_kwargs: list[str] | None = None,
    *,
    budget: int | str | None = None,
    prefetch: int = 1,
) -> None:
    """diffusers' ``apply_group_offloading`` to disk, read through aionvme.

    The parameters before ``*`` are diffusers' (``diffusers.hooks.apply_group_offloading``);
    ``offload_type="block_level"`` and ``offload_to_disk_path`` are required
    here (offloading to host memory is diffusers' own business). The groups'
    files are written on the first call and reused by later ones, as diffusers
    reuses its own: delete the folder when the weights change. Each block is
    read on its own, the next ones ahead; ``num_blocks_per_group`` (diffusers'
    blocks held at once) sizes the default budget.

    Parameters
    ----------
    budget : int or str, optional
        Memory the groups read ahead and in use may take. Default: what
        diffusers itself holds (the rest of the model and one group of
        ``num_blocks_per_group`` blocks) plus ``prefetch`` blocks read ahead.
    prefetch : int
        Blocks read ahead while one computes.

    Notes
    -----
    ``non_blocking``, ``use_stream``, ``record_stream``, ``low_cpu_mem_usage``
    and ``exclude_kwargs`` concern diffusers' device copies and are accepted
    for the call shape; reads ahead need no CUDA stream here. Inference only
    (diffusers' pipelines run under ``torch.no_grad()``); a forward with
    autograd on raises :class:`aionvme.offload.InferenceOnlyError`.
    :func:`remove_group_offloading` ends it (the weights stay on disk).
    """
    del non_blocking, use_stream, record_stream, low_cpu_mem_usage, exclude_kwargs
    if str(getattr(offload_type, "value", offload_type)) != "block_level":
        raise NotImplementedError(f"offload_type={offload_type!r}: only 'block_level' reads through aionvme")
    if offload_to_disk_path is None:
        raise ValueError("offload_to_disk_path is required: aionvme offloads groups to disk")
    if num_blocks_per_group is None or num_blocks_per_group < 1:
        raise ValueError(
            "`num_blocks_per_group` must be a positive int when using offload_type='block_level'"
        )
    if torch.device(offload_device).type != "cpu":
        raise ValueError(f"offload_device={offload_device!r}: groups are read from disk into host memory")
    if getattr(module, _ATTR, None) is not None:
        raise ValueError(
            "group offloading is already applied to this module; remove_group_offloading() first"
        )
    blocks = set(
        block_modules
        if block_modules is not None
        else getattr(module, "_group_offload_block_modules", None) or ()
    )
    groups: list[Group] = []
    _block_groups(module, num_blocks_per_group, blocks, "", groups)
    index_path = _save_groups(module, groups, os.fspath(offload_to_disk_path))
    loop = LoopThread("diffusers-index")
    try:
        index = loop.run(read_index(index_path))
    finally:
        loop.close()
    if budget is None:
        budget = _default_budget(module, groups, index.entries, index.sizes, num_blocks_per_group + prefetch)
    s = start_streamer(
        module,
        index,
        name="diffusers",
        budget=parse_size(budget),
        device=torch.device(onload_device),
        prefetch=prefetch,
        dtype=None,
        source=index_path,
        groups=groups,
    )
    setattr(module, _ATTR, s)


def remove_group_offloading(module: nn.Module) -> None:
    """End what :func:`apply_group_offloading` started: hooks removed, memory released.
    The module's weights are placeholders afterwards (they live in the offload folder)."""
    streamer_of(module).close()


def stats(module: nn.Module) -> dict[str, Any]:
    """Bytes read, waits, peak memory and budget of a module under :func:`apply_group_offloading`."""
    return streamer_of(module).stats()
