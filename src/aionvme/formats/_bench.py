"""Format workloads for ``aionvme bench --workload`` and bench/bench_formats.py.

Each workload builds a state dict of realistic transformer shapes, runs our
save/load and the formats' own (safetensors.torch.save_file / load_file,
torch.save / torch.load) on the same data, verifies what was read, and
returns figures: seconds, GB/s, ratios. One call measures each operation once;
callers repeat and take medians (this VM is noisy).

Fairness:
- Loads are cold: the page cache is dropped before each one (root only;
  ``cold_cache`` says whether it was). ``safetensors.torch.load_file`` maps
  the file lazily, so every page of every tensor is touched after it returns;
  ours and torch.load are touched the same way.
- Saves include durability for everyone: the baselines' files are fsynced and
  their directory too, as our atomic save does.
- The cost of fresh memory is measured separately after the loads
  (``fresh_memory_s``: allocate and fault in as many bytes as the data), and so
  is the device alone (``device_read_s``: an O_DIRECT read of the file into
  memory already faulted in). Any loader that returns new tensors pays the
  first; on this VM it is large and erratic (see bench/README.md).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

__all__ = ["WORKLOADS", "transformer_state_dict"]

Workload = Callable[..., Awaitable[dict[str, float]]]


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


def _drop_caches() -> bool:
    from ..cli._common import drop_caches

    return drop_caches() is None


def _fsync_path(path: str) -> None:
    for p, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(p, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _verify(expected: dict[str, Any], got: dict[str, Any], what: str) -> None:
    import torch

    if set(expected) != set(got):
        raise RuntimeError(f"{what}: tensor names differ")
    for k, v in expected.items():
        if not torch.equal(v, got[k]):
            raise RuntimeError(f"{what}: tensor {k!r} differs")


def _unlink(*paths: str) -> None:
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def _cold_load(
    load: Callable[[], Awaitable[Any]], expected: dict[str, Any], what: str, verify: bool, pause: float
) -> tuple[float, Any]:
    """Drop the page cache, wait ``pause`` seconds, load, touch every page of
    the tensors; the time and what was loaded (a dict of tensors, or a
    checkpoint with "model")."""
    gc.collect()
    _drop_caches()
    if pause:
        await asyncio.sleep(pause)  # let the VM hand freed memory back to the host, as between jobs
    t0 = time.perf_counter()
    got = await load()
    tensors = got.get("model", got)
    _touch(tensors)
    elapsed = time.perf_counter() - t0
    if verify:
        _verify(expected, tensors, what)
    return elapsed, got


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
    from ..file import pread
    from ..memory import empty

    buf = empty(os.path.getsize(path))
    buf[::4096] = 1
    _drop_caches()
    t0 = time.perf_counter()
    await pread(buf, path)
    device = time.perf_counter() - t0
    del buf
    gc.collect()
    t0 = time.perf_counter()
    fresh = empty(nbytes)
    fresh[::4096] = 1
    fault = time.perf_counter() - t0
    return {"device_read_s": device, "fresh_memory_s": fault}


async def bench_safetensors(
    directory: str, total_bytes: int, *, verify: bool = True, pause: float = 0.0
) -> dict[str, float]:
    """load_safetensors vs safetensors.torch.load_file (cold, every page
    touched) and save_safetensors vs safetensors.torch.save_file (+ fsync).
    ``pause``: seconds to idle before each load (see _cold_load)."""
    import safetensors.torch as st

    from ._safetensors import load_safetensors, save_safetensors

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
    cold = _drop_caches()
    t_load, _ = await _cold_load(lambda: load_safetensors(ref), sd, "load_safetensors", verify, pause)
    t_load_ref, _ = await _cold_load(load_ref, sd, "safetensors.torch.load_file", verify, pause)
    if verify:
        _verify(sd, st.load_file(ours), "safetensors.torch.load_file of our file")
    extra = await _device_and_memory(ref, nbytes)
    _unlink(ours, ref)
    return {
        "bytes": float(nbytes),
        "tensors": float(len(sd)),
        "cold_cache": float(cold),
        **_compare(nbytes, "load", "safetensors", t_load, t_load_ref),
        **_compare(nbytes, "save", "safetensors", t_save, t_save_ref),
        **extra,
    }


async def bench_checkpoint(
    directory: str, total_bytes: int, *, verify: bool = True, pause: float = 0.0
) -> dict[str, float]:
    """nvme.save / nvme.load / save_in_background vs torch.save (+ fsync) and
    torch.load (cold) on a checkpoint: weights plus step and config.
    ``pause``: seconds to idle before each load and background save."""
    import torch

    from ._checkpoint import load, release_snapshot_buffers, save, save_in_background

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

    # Background: how long training is blocked (the snapshot) and until it is
    # durable, first into a fresh snapshot buffer, then into the kept one.
    background: dict[str, float] = {}
    release_snapshot_buffers()
    for kind in ("fresh", "reused"):
        gc.collect()
        if pause:
            await asyncio.sleep(pause)
        t0 = time.perf_counter()
        task = save_in_background(ckpt, ours)
        background[f"background_{kind}_return_s"] = time.perf_counter() - t0
        await task
        background[f"background_{kind}_total_s"] = time.perf_counter() - t0
    release_snapshot_buffers()

    cold = _drop_caches()
    t_load, got = await _cold_load(lambda: load(ours), sd, "nvme.load", verify, pause)
    if verify and (got["step"] != 1000 or got["config"]["betas"] != (0.9, 0.95)):
        raise RuntimeError("nvme.load: the non-tensor values differ")
    del got
    t_load_ref, _ = await _cold_load(load_ref, sd, "torch.load", verify, pause)
    extra = await _device_and_memory(ours, nbytes)
    _unlink(ours, ref)
    return {
        "bytes": float(nbytes),
        "tensors": float(len(sd)),
        "cold_cache": float(cold),
        **_compare(nbytes, "save", "torch", t_save, t_save_ref),
        **background,
        **_compare(nbytes, "load", "torch", t_load, t_load_ref),
        **extra,
    }


WORKLOADS: dict[str, Workload] = {"safetensors": bench_safetensors, "checkpoint": bench_checkpoint}
