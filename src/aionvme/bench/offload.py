"""The ``offload`` workload: one cold pass of a layer-streamed model and one
optimizer step with its state on NVMe, each against its bound.

Small by default (a 32 MiB model, a 4M-parameter optimizer), so that
``aionvme bench -w offload`` runs in seconds; ``bench/suites/bench_offload.py`` is
the full benchmark (a transformers Llama, accelerate and DeepSpeed side by side).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from ..defaults import parse_size
from .result import Result
from .system import drop_caches
from .workloads import seqread, seqwrite

__all__ = ["offload_workload"]


def _stream_pass(workdir: str, model_bytes: int, budget: int, prefetch: int) -> dict[str, Any]:
    """Build an MLP of ``model_bytes`` fp32 (blocks in a ModuleList), save it
    with aionvme, run one cold streamed pass and the model in memory."""
    import torch
    from torch import nn

    from .. import save_safetensors
    from ..offload import stream, streamer_of

    hidden = 512
    layers = max(2, model_bytes // (4 * (hidden * hidden + hidden)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

        def forward(self, x: Any) -> Any:
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x

    torch.manual_seed(0)
    ref = Net().eval()
    path = os.path.join(workdir, "offload-model.safetensors")
    asyncio.run(save_safetensors(ref.state_dict(), path))
    x = torch.randn(64, hidden, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(x)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            ref(x)
            times.append(time.perf_counter() - t0)
    compute_s = sorted(times)[1]
    with torch.device("meta"):
        empty = Net().eval()
    cold = drop_caches() is None
    model = stream(empty, path, budget=budget, prefetch=prefetch)
    s = streamer_of(model)
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            got = model(x)
            stream_s = time.perf_counter() - t0
        st = s.stats()
    finally:
        s.close()
    return {
        "path": path,
        "cold": cold,
        "layers": layers,
        "compute_s": compute_s,
        "stream_s": stream_s,
        "bytes_read": st["bytes_read"],
        "peak_memory_bytes": st["peak_memory_bytes"],
        "direct_loads": st["direct_loads"],
        "equal": bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5)),
    }


def _optimizer_step(workdir: str, params: int, budget: int) -> dict[str, Any]:
    """AdamW over ``params`` fp32 parameters with its state on NVMe: the
    second step (the first creates the state), cold cache."""
    import torch

    from ..offload import Optimizer

    # a chunk holds a tensor at least: tensors of budget/256 bytes keep the pipeline within the budget
    per = max(1024, min(1 << 16, budget // 256))
    ps = [torch.nn.Parameter(torch.randn(min(per, params - i))) for i in range(0, params, per)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = Optimizer(torch.optim.AdamW, ps, os.path.join(workdir, "optim"), lr=1e-4, budget=budget)
    try:
        opt.step()
        before = opt.stats()
        drop_caches()
        t0 = time.perf_counter()
        opt.step()
        step_s = time.perf_counter() - t0
        after = opt.stats()
    finally:
        opt.close()
    return {
        "step_s": step_s,
        "read": after["bytes_read"] - before["bytes_read"],
        "written": after["bytes_written"] - before["bytes_written"],
        "state_bytes": after["state_bytes"],
        "peak_memory_bytes": after["peak_memory_bytes"],
    }


async def offload_workload(ctx: Any) -> Result:
    """``aionvme bench -w offload``: ``offload.stream`` (one cold pass) and
    ``offload.Optimizer`` (one step) against their bounds. Options:
    ``-o model=32M -o budget=<model/4> -o prefetch=2 -o params=4M -o opt_budget=8M``.

    The stream's bound is max(bytes read / sequential read bandwidth of the
    same file, the in-memory forward); the optimizer's is bytes read / read
    bandwidth + bytes written / write bandwidth, both bandwidths measured
    here with aionvme's own sequential workloads (``seqread``/``seqwrite``)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return Result.skip("offload", "needs torch")
    model_bytes = ctx.option("model", 32 << 20, parse_size)
    budget = ctx.option("budget", model_bytes // 4, parse_size)
    prefetch = ctx.option("prefetch", 2, int)
    params = ctx.option("params", 4 << 20, parse_size)
    opt_budget = ctx.option("opt_budget", 8 << 20, parse_size)
    s = await asyncio.to_thread(_stream_pass, ctx.workdir, model_bytes, budget, prefetch)
    o = await asyncio.to_thread(_optimizer_step, ctx.workdir, params, opt_budget)
    await asyncio.to_thread(drop_caches)
    rd = await seqread(s["path"], request_size=8 << 20)
    wr = await seqwrite(
        os.path.join(ctx.workdir, "offload-w.bin"), max(o["written"], 4 << 20), request_size=8 << 20
    )
    read_bw, write_bw = rd.nbytes / rd.wall_s, wr.nbytes / wr.wall_s
    stream_bound = max(s["bytes_read"] / read_bw, s["compute_s"])
    opt_bound = o["read"] / read_bw + o["written"] / write_bw
    within = s["peak_memory_bytes"] <= budget and o["peak_memory_bytes"] <= opt_budget
    r = Result(
        "offload",
        nbytes=s["bytes_read"] + o["read"] + o["written"],
        ops=2,
        wall_s=s["stream_s"] + o["step_s"],
        verified=s["equal"] and within,
        params={
            "model": model_bytes,
            "budget": budget,
            "prefetch": prefetch,
            "layers": s["layers"],
            "params": params,
            "opt_budget": opt_budget,
            "cold_cache": s["cold"],
        },
        figures={
            "stream_s": round(s["stream_s"], 4),
            "stream_bound_s": round(stream_bound, 4),
            "stream_ratio_to_bound": round(stream_bound / s["stream_s"], 3),
            "stream_read_MB": round(s["bytes_read"] / 1e6, 1),
            "stream_peak_memory_MB": round(s["peak_memory_bytes"] / 1e6, 2),
            "stream_direct_loads": s["direct_loads"],
            "optimizer_step_s": round(o["step_s"], 4),
            "optimizer_io_bound_s": round(opt_bound, 4),
            "optimizer_ratio_to_bound": round(opt_bound / o["step_s"], 3) if o["step_s"] else 0.0,
            "optimizer_io_MB": round((o["read"] + o["written"]) / 1e6, 1),
            "optimizer_peak_memory_MB": round(o["peak_memory_bytes"] / 1e6, 2),
            "read_MBps": round(read_bw / 1e6, 1),
            "write_MBps": round(write_bw / 1e6, 1),
        },
    )
    r.notes.append(
        f"stream {s['stream_s']:.3f} s, bound {stream_bound:.3f} s: {stream_bound / s['stream_s']:.2f}x "
        f"(target 0.9x); peak {s['peak_memory_bytes'] / 1e6:.1f} of {budget / 1e6:.1f} MB"
    )
    r.notes.append(
        f"optimizer step {o['step_s']:.3f} s, I/O bound {opt_bound:.3f} s: "
        f"{opt_bound / max(o['step_s'], 1e-9):.2f}x (target 0.85x); peak {o['peak_memory_bytes'] / 1e6:.1f} "
        f"of {opt_budget / 1e6:.1f} MB"
    )
    if not s["cold"]:
        r.notes.append("page cache not dropped (not root): reads may be cached")
    if not within:
        r.notes.append("a budget was exceeded")
    if not s["equal"]:
        r.notes.append("streamed outputs differ from the model in memory")
    return r
