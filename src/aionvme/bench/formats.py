"""Format workloads: aionvme's safetensors and checkpoint save/load next to
the formats' own (``safetensors.torch.save_file``/``load_file``,
``torch.save``/``torch.load``) on the same realistic state dict.

Each returns one :class:`~aionvme.bench.Result`: the timed figures are our
cold load (wall, CPU, loop stall), and ``figures`` holds every operation's
seconds, GB/s and ratio to the baseline (``load_ratio`` = baseline seconds /
ours: above 1, ours is faster).

Fairness:

- Loads are cold: before each one the page cache is dropped (root) and the
  file read is evicted from it (anyone: :func:`~aionvme.bench.system.evict`);
  ``figures["cold_cache"]`` is 1.0 when ``mincore`` found none of the files'
  pages cached before any of the timed loads. ``safetensors.torch.load_file``
  maps the file lazily, so every page of every tensor is touched after it
  returns; ours and torch.load are touched the same way.
- Saves include durability for everyone: the baselines' files are fsynced
  and their directory too, as our atomic save does.
- The cost of fresh memory is measured separately (``fresh_memory_s``:
  allocate and fault in as many bytes as the data), and so is the device
  alone (``device_read_s``: an O_DIRECT read of the file into memory already
  faulted in). Any loader that returns new tensors pays the first.
- The floor of a safetensors load (issue 17): fio's best cold read of the
  same file (libaio, O_DIRECT, bs 4M and 16M at QD 32; ``floor_fio_s``,
  scaled to the whole file when fio's size rounding left a tail) plus touching
  every page of the loaded tensors once they are resident (``touch_s``):
  ``floor_s`` = their sum, ``floor_ratio`` = ``floor_s`` / our load (1.0:
  as fast as the floor). Needs fio; without it the figures are absent and a
  note says why.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .. import empty
from .. import pread as nvme_pread
from .peers import fio, fio_unavailable
from .result import Result
from .system import drop_caches, make_cold
from .timer import Timer

__all__ = ["FORMAT_BASELINES", "checkpoint", "safetensors", "transformer_state_dict"]

#: each format workload's baselines, by operation (for reports)
FORMAT_BASELINES = {
    "safetensors": {"load": "safetensors load_file", "save": "safetensors save_file"},
    "checkpoint": {"load": "torch.load", "save": "torch.save"},
}


def transformer_state_dict(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    """bf16 weights of a Llama-like decoder of about ``total_bytes``: embedding
    and output head (vocab 32000), per layer q/k/v/o (H x H), gate/up (I x H),
    down (H x I) and two norms (H). H grows with the size."""
    import torch

    hidden = 1024 if total_bytes < 256 << 20 else 2048 if total_bytes < 4 << 30 else 4096
    inter = (hidden * 11 // 4 + 255) // 256 * 256
    vocab = 32000
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    per_layer = [
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.k_proj.weight", (hidden, hidden)),
        ("self_attn.v_proj.weight", (hidden, hidden)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.gate_proj.weight", (inter, hidden)),
        ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)),
        ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]
    layer_bytes = 2 * sum(int(np.prod(s)) for _, s in per_layer)
    fixed = 2 * (2 * vocab * hidden + hidden)
    layers = max(1, round((total_bytes - fixed) / layer_bytes))
    for i in range(layers):
        shapes += [(f"model.layers.{i}.{n}", s) for n, s in per_layer]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=torch.float32).to(torch.bfloat16) for n, s in shapes}


def _touch(tensors: Any) -> int:
    """Read one byte per page of every tensor (defeats lazy mmap loading)."""
    import torch

    total = 0
    for t in tensors.values():
        if t.numel():
            total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def _fsync_path(path: str) -> None:
    for p, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(p, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _same(expected: dict[str, Any], got: dict[str, Any]) -> bool:
    import torch

    return set(expected) == set(got) and all(torch.equal(v, got[k]) for k, v in expected.items())


def _unlink(*paths: str) -> None:
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    gc.collect()
    with Timer() as t:
        await fn()
    return t.wall


async def _cold_load(load: Callable[[], Awaitable[Any]], path: str, pause: float) -> tuple[Timer, Any, int]:
    """Make reading ``path`` cold (:func:`~aionvme.bench.system.make_cold`), idle
    ``pause`` seconds, then time loading and touching every page of the
    tensors; the timer, what was loaded (a dict of tensors, or a checkpoint
    with "model") and the bytes of ``path`` that were still cached."""
    gc.collect()  # what an earlier load returned unmaps the file, whose pages can then go
    cached = make_cold(path)
    if pause:
        await asyncio.sleep(pause)  # let a VM hand freed memory back to its host, as between jobs
    with Timer() as t:
        got = await load()
        _touch(got.get("model", got))
    return t, got, cached


def _compare(nbytes: int, op: str, base: str, ours_s: float, base_s: float) -> dict[str, float]:
    gb = nbytes / 1e9
    return {
        f"{op}_s": ours_s,
        f"{op}_{base}_s": base_s,
        f"{op}_GBps": gb / ours_s,
        f"{op}_{base}_GBps": gb / base_s,
        f"{op}_ratio": base_s / ours_s,
    }


async def _device_and_memory(path: str, nbytes: int) -> dict[str, float]:
    """The device alone (cold O_DIRECT read into pre-faulted memory) and the
    cost of faulting in ``nbytes`` of fresh memory."""
    buf = empty(os.path.getsize(path))
    buf[::4096] = 1
    drop_caches()
    t0 = time.perf_counter()
    await nvme_pread(buf, path)
    device = time.perf_counter() - t0
    del buf
    gc.collect()
    t0 = time.perf_counter()
    fresh = empty(nbytes)
    fresh[::4096] = 1
    fault = time.perf_counter() - t0
    return {"device_read_s": device, "fresh_memory_s": fault}


#: fio configurations whose best cold read is the floor of a load (bs, iodepth)
FLOOR_FIO = (("4M", 32), ("16M", 32))


def _fio_floor(path: str) -> dict[str, float]:
    """fio's best cold O_DIRECT read of ``path`` (:data:`FLOOR_FIO`), in
    seconds for the whole file; empty where fio is missing."""
    if fio_unavailable():
        return {}
    total = os.path.getsize(path)
    best = 0.0
    for bs, depth in FLOOR_FIO:
        drop_caches()
        r = fio(path, "read", bs, depth, "libaio", total)
        if r.nbytes and r.wall_s > 0:
            best = max(best, r.nbytes / r.wall_s)
    return {"floor_fio_s": total / best} if best else {}


def _notes(name: str, figures: dict[str, float], ops: tuple[str, ...]) -> list[str]:
    base = FORMAT_BASELINES[name]
    out = []
    for op in ops:
        key = "safetensors" if name == "safetensors" else "torch"
        out.append(
            f"{op} {figures[f'{op}_GBps']:.2f} GB/s vs {base[op]} {figures[f'{op}_{key}_GBps']:.2f} "
            f"({figures[f'{op}_ratio']:.2f}x)"
        )
    return out


def _warm(ours: int, base: int) -> list[str]:
    """A note when a load was not cold (the file could not be evicted)."""
    if not ours and not base:
        return []
    return [f"NOT COLD: {ours} bytes of our file and {base} of the baseline's were cached before the load"]


async def safetensors(directory: str, total_bytes: int, *, verify: bool = True, pause: float = 0.0) -> Result:
    """``load_safetensors`` vs ``safetensors.torch.load_file`` (cold, every
    page touched) and ``save_safetensors`` vs ``safetensors.torch.save_file``
    (+ fsync) on a transformer state dict of about ``total_bytes`` in ``directory``.

    Returns
    -------
    Result
        Timed: our cold load. ``figures``: load_s, load_safetensors_s,
        load_GBps, load_safetensors_GBps, load_ratio, the same for save,
        device_read_s, fresh_memory_s, bytes, tensors, cold_cache.
    """
    import safetensors.torch as st

    from ..formats import load_safetensors, save_safetensors

    sd = transformer_state_dict(total_bytes)
    nbytes = sum(t.nbytes for t in sd.values())
    ours, ref = os.path.join(directory, "ours.safetensors"), os.path.join(directory, "ref.safetensors")
    _unlink(ours, ref)

    async def save_ref() -> None:
        st.save_file(sd, ref)
        _fsync_path(ref)

    async def load_ref() -> Any:
        return st.load_file(ref)

    t_save_ref = await _timed(save_ref)
    t_save = await _timed(lambda: save_safetensors(sd, ours))
    timer, got, cached = await _cold_load(lambda: load_safetensors(ref), ref, pause)
    t0 = time.perf_counter()
    _touch(got)  # resident now: what touching costs by itself
    touch = time.perf_counter() - t0
    ok = not verify or _same(sd, got)
    del got
    t_ref, got, cached_ref = await _cold_load(load_ref, ref, pause)
    ok = ok and (not verify or _same(sd, got))
    del got
    if verify:
        ok = ok and _same(sd, st.load_file(ours))  # the reference reader takes our file
    extra = await _device_and_memory(ref, nbytes)
    floor = await asyncio.to_thread(_fio_floor, ref)
    _unlink(ours, ref)
    figures = {
        "bytes": float(nbytes),
        "tensors": float(len(sd)),
        "cold_cache": float(cached == cached_ref == 0),
        "cached_bytes_before_load": float(cached),
        "cached_bytes_before_load_safetensors": float(cached_ref),
        **_compare(nbytes, "load", "safetensors", timer.wall, t_ref.wall),
        **_compare(nbytes, "save", "safetensors", t_save, t_save_ref),
        **extra,
        "touch_s": touch,
    }
    notes = _notes("safetensors", figures, ("load", "save")) + _warm(cached, cached_ref)
    if floor:
        figures.update(floor, floor_s=floor["floor_fio_s"] + touch)
        figures["floor_ratio"] = figures["floor_s"] / timer.wall
        notes.append(
            f"floor (fio's best cold read {floor['floor_fio_s']:.3f} s + touching {touch:.3f} s): "
            f"{figures['floor_s']:.3f} s; load at {figures['floor_ratio']:.2f}x of it"
        )
    else:
        notes.append(f"no floor: {fio_unavailable()}")
    return timer.result(
        "safetensors",
        nbytes,
        verified=ok,
        params=dict(op="load", tensors=len(sd)),
        figures=figures,
        notes=notes,
    )


async def checkpoint(directory: str, total_bytes: int, *, verify: bool = True, pause: float = 0.0) -> Result:
    """``nvme.save``/``nvme.load``/``save_in_background`` vs ``torch.save``
    (+ fsync) and ``torch.load`` (cold) on a checkpoint: weights plus step and config.

    Returns
    -------
    Result
        Timed: our cold load. ``figures``: as :func:`safetensors` (baseline
        ``torch``), plus background_{fresh,reused}_{return,total}_s: how long
        ``save_in_background`` blocked the caller and when the save was
        durable, into a fresh snapshot buffer and into the kept one.
    """
    import torch

    from ..formats import load, release_snapshot_buffers, save, save_in_background

    sd = transformer_state_dict(total_bytes)
    nbytes = sum(t.nbytes for t in sd.values())
    ckpt = {"model": sd, "step": 1000, "config": {"lr": 3e-4, "betas": (0.9, 0.95)}}
    ours, ref = os.path.join(directory, "ours.ckpt"), os.path.join(directory, "ref.pt")
    _unlink(ours, ref)

    async def save_ref() -> None:
        torch.save(ckpt, ref)
        _fsync_path(ref)

    async def load_ref() -> Any:
        return torch.load(ref)

    t_save_ref = await _timed(save_ref)
    t_save = await _timed(lambda: save(ckpt, ours))

    background: dict[str, float] = {}
    release_snapshot_buffers()
    for kind in ("fresh", "reused"):
        gc.collect()
        if pause:
            await asyncio.sleep(pause)
        t0 = time.perf_counter()
        task = await save_in_background(ckpt, ours)
        background[f"background_{kind}_return_s"] = time.perf_counter() - t0
        await task
        background[f"background_{kind}_total_s"] = time.perf_counter() - t0
    release_snapshot_buffers()

    timer, got, cached = await _cold_load(lambda: load(ours), ours, pause)
    ok = not verify or (
        _same(sd, got["model"]) and got["step"] == 1000 and got["config"]["betas"] == (0.9, 0.95)
    )
    del got
    t_ref, got, cached_ref = await _cold_load(load_ref, ref, pause)
    ok = ok and (not verify or _same(sd, got["model"]))
    del got
    extra = await _device_and_memory(ours, nbytes)
    _unlink(ours, ref)
    figures = {
        "bytes": float(nbytes),
        "tensors": float(len(sd)),
        "cold_cache": float(cached == cached_ref == 0),
        "cached_bytes_before_load": float(cached),
        "cached_bytes_before_load_torch": float(cached_ref),
        **_compare(nbytes, "save", "torch", t_save, t_save_ref),
        **background,
        **_compare(nbytes, "load", "torch", timer.wall, t_ref.wall),
        **extra,
    }
    notes = _notes("checkpoint", figures, ("load", "save")) + _warm(cached, cached_ref)
    notes.append(
        f"save_in_background returns in {background['background_reused_return_s']:.3f} s "
        f"(reused buffer), durable after {background['background_reused_total_s']:.3f} s"
    )
    return timer.result(
        "checkpoint",
        nbytes,
        verified=ok,
        params=dict(op="load", tensors=len(sd)),
        figures=figures,
        notes=notes,
    )
