"""accelerate's disk offload and diffusers' group offload to disk, next to aionvme's drop-ins.

    python3 bench/suites/bench_integrations_offload.py                     # 512 MiB Llama, ~220 MiB UNet
    python3 bench/suites/bench_integrations_offload.py --workload accelerate --model-size 2G --repeat 5
    python3 bench/suites/bench_integrations_offload.py --json

accelerate: a transformers Llama-style model (random weights, built here, no
download) of ``--model-size`` fp32 bytes, offloaded once to an accelerate
offload folder (``index.json`` + ``.dat``, accelerate's own writer), then, per
round, one cold forward pass (batch 1, ``--seq`` tokens, on ``--device``: CPU,
or ``cuda`` for the GPU path; page cache dropped just before; the offload
applied to the empty model and the pass timed together, since ours starts
reading when it is applied) of ``accelerate.disk_offload`` and of
``aionvme.integrations.accelerate.disk_offload`` with ``budget`` = the model /
``--ratio`` (4: the model is 4x its memory budget), both over the same folder,
both models built empty (``init_empty_weights``). Logits are compared bitwise
with the model in memory, which also runs once per round (after the same
cache drop): ours is given against its bound max(bytes it read / fio's
sequential read bandwidth, that round's forward in memory).

diffusers: a ``UNet2DModel`` (random weights) under group offloading to disk,
``block_level``, ``num_blocks_per_group=1``, one cold pass of diffusers' own
``apply_group_offloading(..., offload_to_disk_path=...)`` and of
``aionvme.integrations.diffusers.apply_group_offloading`` (same arguments,
its default budget), each on its own folder written before the round; outputs
compared bitwise with the model in memory (a side of each round too); bytes
read from the device counted by ``/proc/self/io``
(``read_bytes``) and, for ours, by the streamer.

``--repeat`` rounds, each side once per round, the order reversed every other
round; the median per side and the median of the per-round ratios are
reported. Run as root, so the page cache can be dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from aionvme.bench import drop_caches
from aionvme.bench.render import human_bytes
from aionvme.defaults import parse_size


def _read_bytes() -> int:
    """Bytes this process (all its threads) had the block layer read (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _fio_read_Bps(work: str) -> float:
    """fio's best sequential O_DIRECT read of 1 MiB and 16 MiB blocks at depth 32 (libaio) over a
    256 MiB file: the device's practical ceiling, as bench_offload.py takes it."""
    from aionvme.bench.peers import fio

    probe = os.path.join(work, "fio.bin")
    size = 256 << 20
    best = max(
        r.nbytes / r.wall_s for r in (fio(probe, "read", bs, 32, "libaio", size) for bs in ("1M", "16M"))
    )
    os.unlink(probe)
    return best


def _rounds(sides: dict[str, Callable[[], dict[str, Any]]], repeat: int) -> list[dict[str, dict[str, Any]]]:
    """Untimed warm-up of each side, then ``repeat`` rounds, the order reversed every other one."""
    for fn in sides.values():
        fn()
    out = []
    names = list(sides)
    for i in range(repeat):
        rd = {}
        for name in names if i % 2 == 0 else names[::-1]:
            rd[name] = sides[name]()
        out.append(rd)
    return out


WARM_MEMORY = 0  # bytes faulted in and freed after each cache drop (main sets it)


def _timed(setup: Callable[[], Any], run: Callable[[Any], Any]) -> dict[str, Any]:
    """One cold pass: the page cache dropped, ``WARM_MEMORY`` bytes of anonymous memory
    faulted in and freed (on this VM, memory the guest handed back to the host, as a cache
    drop does, costs 1-5 s/GiB to fault in again, against 0.1-0.2 s for memory freed a
    moment ago: bench_integrations_io.py's cold() does the same), then ``setup()`` (the
    offload applied to a model already built: it may start reading) and ``run`` on what it
    returns, timed together."""
    cold = drop_caches() is None
    if WARM_MEMORY:
        import numpy as np

        np.ones(WARM_MEMORY, dtype=np.uint8)
    r0 = _read_bytes()
    t0 = time.perf_counter()
    m = setup()
    t1 = time.perf_counter()
    with torch.inference_mode():
        out = run(m)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    t2 = time.perf_counter()
    return {
        "m": m,
        "out": out,
        "s": t2 - t0,
        "pass_s": t2 - t1,
        "read_bytes": _read_bytes() - r0,
        "cold": cold,
    }


def _compare(r: dict[str, Any], want: torch.Tensor) -> dict[str, Any]:
    out = r.pop("out")
    r.pop("m")
    r["equal"] = bool(torch.equal(out, want))
    r["max_diff"] = float((out - want).abs().max())
    return r


# -- accelerate ---------------------------------------------------------------------------------


def _llama_config(total: int) -> Any:
    import transformers

    hidden, inter, vocab = (1024, 2816, 8192) if total < (3 << 30) else (2048, 5632, 16384)
    layer = 4 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(2, round((total - 2 * 4 * vocab * hidden) / layer))
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, tie_word_embeddings=False,
    )  # fmt: skip


def bench_accelerate(args: argparse.Namespace, work: str, fio_Bps: float) -> dict[str, Any]:
    import accelerate
    import transformers
    from accelerate.utils import offload_state_dict

    from aionvme.integrations.accelerate import disk_offload, weights_map_of

    cfg = _llama_config(parse_size(args.model_size))
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    nbytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    budget = nbytes // args.ratio
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(1))
    dev = args.device
    offload_state_dict(os.path.join(work, "accelerate-offload"), ref.state_dict())
    ref.to(dev)
    ids = ids.to(dev)
    with torch.inference_mode():
        want = ref(ids).logits
    folder = os.path.join(work, "accelerate-offload")

    def empty() -> Any:
        with accelerate.init_empty_weights():
            return transformers.LlamaForCausalLM(cfg).eval()

    def theirs() -> dict[str, Any]:
        m = empty()
        r = _timed(lambda: accelerate.disk_offload(m, folder, execution_device=dev), lambda m: m(ids).logits)
        return _compare(r, want)

    def ours() -> dict[str, Any]:
        m = empty()
        r = _timed(
            lambda: disk_offload(m, folder, execution_device=dev, budget=budget, prefetch=args.prefetch),
            lambda m: m(ids).logits,
        )
        w = weights_map_of(m)
        st = w.stats()
        w.close()
        r.update(bytes_read=st["bytes_read"], wait_s=st["wait_s"], peak=st["peak_memory_bytes"])
        r["own_reads"] = st["own_reads"]
        return _compare(r, want)

    def memory() -> dict[str, Any]:
        """The model in memory, in the same rounds: the compute bound under the same load."""
        return _compare(_timed(lambda: ref, lambda m: m(ids).logits), want)

    rounds = _rounds({"accelerate": theirs, "aionvme": ours, "memory": memory}, args.repeat)
    o = [r["aionvme"] for r in rounds]
    a = [r["accelerate"] for r in rounds]
    compute_s = statistics.median(r["memory"]["pass_s"] for r in rounds)
    io_s = statistics.median(x["bytes_read"] for x in o) / fio_Bps
    bound = max(io_s, compute_s)
    ours_s = statistics.median(x["s"] for x in o)
    to_bound = statistics.median(
        max(r["aionvme"]["bytes_read"] / fio_Bps, r["memory"]["pass_s"]) / r["aionvme"]["s"] for r in rounds
    )
    return {
        "device": dev, "model_bytes": nbytes, "layers": cfg.num_hidden_layers, "budget": budget,
        "seq": args.seq,
        "prefetch": args.prefetch, "compute_s": compute_s, "io_s": io_s, "bound_s": bound,
        "fio_read_Bps": fio_Bps,
        "aionvme_s": ours_s, "accelerate_s": statistics.median(x["s"] for x in a),
        "speedup": statistics.median(r["accelerate"]["s"] / r["aionvme"]["s"] for r in rounds),
        "ratio_to_bound": to_bound,
        "bitwise_equal": all(x["equal"] for x in o + a),
        "accelerate_max_diff": max(x["max_diff"] for x in a),
        "aionvme_pass_s": statistics.median(x["pass_s"] for x in o),
        "accelerate_pass_s": statistics.median(x["pass_s"] for x in a),
        "cold": all(x["cold"] for x in o + a),
        "aionvme_bytes_read": statistics.median(x["bytes_read"] for x in o),
        "aionvme_read_bytes_proc": statistics.median(x["read_bytes"] for x in o),
        "accelerate_read_bytes_proc": statistics.median(x["read_bytes"] for x in a),
        "aionvme_wait_s": statistics.median(x["wait_s"] for x in o),
        "peak_memory_bytes": max(x["peak"] for x in o),
        "own_reads": max(x["own_reads"] for x in o),
        "rounds": [{k: r[k]["s"] if k != "memory" else r[k]["pass_s"] for k in r} for r in rounds],
    }  # fmt: skip


# -- diffusers ----------------------------------------------------------------------------------


def _unet(width: int, sample: int) -> Any:
    import diffusers

    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=sample, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(width, 2 * width, 4 * width, 4 * width), norm_num_groups=32,
        down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    ).eval()  # fmt: skip


def bench_diffusers(args: argparse.Namespace, work: str) -> dict[str, Any]:
    from diffusers.hooks import apply_group_offloading as theirs_apply

    from aionvme.integrations.diffusers import apply_group_offloading, remove_group_offloading, stats

    ref = _unet(args.unet_width, args.sample)
    nbytes = sum(t.numel() * t.element_size() for t in (*ref.parameters(), *ref.buffers()))
    x = torch.randn(1, 3, args.sample, args.sample, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([500])
    with torch.inference_mode():
        want = ref(x, t).sample
    kw: dict[str, Any] = {"onload_device": "cpu", "offload_type": "block_level", "num_blocks_per_group": 1}

    def theirs() -> dict[str, Any]:
        m = _unet(args.unet_width, args.sample)
        path = os.path.join(work, "diffusers-theirs")
        r = _timed(lambda: theirs_apply(m, offload_to_disk_path=path, **kw) or m, lambda m: m(x, t).sample)
        return _compare(r, want)

    def ours() -> dict[str, Any]:
        m = _unet(args.unet_width, args.sample)
        path = os.path.join(work, "diffusers-ours")
        r = _timed(
            lambda: apply_group_offloading(m, offload_to_disk_path=path, **kw) or m, lambda m: m(x, t).sample
        )
        st = stats(m)
        remove_group_offloading(m)
        r.update(bytes_read=st["bytes_read"], budget=st["budget"], peak=st["peak_memory_bytes"])
        return _compare(r, want)

    def memory() -> dict[str, Any]:
        return _compare(_timed(lambda: ref, lambda m: m(x, t).sample), want)

    rounds = _rounds({"diffusers": theirs, "aionvme": ours, "memory": memory}, args.repeat)
    compute_s = statistics.median(r["memory"]["pass_s"] for r in rounds)
    o = [r["aionvme"] for r in rounds]
    d = [r["diffusers"] for r in rounds]
    return {
        "model_bytes": nbytes, "compute_s": compute_s, "sample": args.sample,
        "aionvme_s": statistics.median(x["s"] for x in o),
        "diffusers_s": statistics.median(x["s"] for x in d),
        "speedup": statistics.median(r["diffusers"]["s"] / r["aionvme"]["s"] for r in rounds),
        "bitwise_equal": all(x["equal"] for x in o),  # ours against the model in memory
        "diffusers_equal": all(x["equal"] for x in d),
        "diffusers_max_diff": max(x["max_diff"] for x in d),
        "aionvme_pass_s": statistics.median(x["pass_s"] for x in o),
        "diffusers_pass_s": statistics.median(x["pass_s"] for x in d),
        "cold": all(x["cold"] for x in o + d),
        "aionvme_bytes_read": statistics.median(x["bytes_read"] for x in o),
        "aionvme_read_bytes_proc": statistics.median(x["read_bytes"] for x in o),
        "diffusers_read_bytes_proc": statistics.median(x["read_bytes"] for x in d),
        "budget": o[0]["budget"], "peak_memory_bytes": max(x["peak"] for x in o),
        "rounds": [{k: r[k]["s"] if k != "memory" else r[k]["pass_s"] for k in r} for r in rounds],
    }  # fmt: skip


# -- report -------------------------------------------------------------------------------------


def report(acc: dict[str, Any] | None, dif: dict[str, Any] | None) -> str:
    lines = []
    if acc:
        cold = "" if acc["cold"] else " - page cache NOT dropped (not root)"
        lines += [
            f"### accelerate disk offload: Llama {human_bytes(acc['model_bytes'])} fp32 "
            f"({acc['layers']} layers), "
            f"budget {human_bytes(acc['budget'])}, seq {acc['seq']}, {acc['device']}{cold}",
            "",
            "| | seconds (median): offload applied + one pass | note |",
            "|---|---:|---|",
            f"| aionvme `disk_offload` | {acc['aionvme_s']:.3f} | "
            f"read {human_bytes(acc['aionvme_bytes_read'])}, "
            f"waited {acc['aionvme_wait_s']:.3f} s, peak {human_bytes(acc['peak_memory_bytes'])} |",
            f"| accelerate `disk_offload` | {acc['accelerate_s']:.3f} | device reads "
            f"{human_bytes(acc['accelerate_read_bytes_proc'])} (/proc/self/io) |",
            f"| bound max(I/O, compute) | {acc['bound_s']:.3f} | I/O {acc['io_s']:.3f} s at fio "
            f"{acc['fio_read_Bps'] / 1e9:.2f} GB/s, compute in memory "
            f"{acc['compute_s']:.3f} s (median of the rounds) |",
            "",
            f"speed-up **{acc['speedup']:.2f}x** accelerate's own (target >= 1.8), "
            f"**{acc['ratio_to_bound']:.2f}x** "
            f"the bound (median of the rounds' ratios); both sides' logits bitwise those of the model in "
            f"memory: {acc['bitwise_equal']} "
            f"(accelerate's max |diff| {acc['accelerate_max_diff']:.3g}); the passes alone "
            f"{acc['aionvme_pass_s']:.3f} / {acc['accelerate_pass_s']:.3f} s; rounds: "
            + "; ".join(
                f"{r['aionvme']:.3f} / {r['accelerate']:.3f} (memory {r['memory']:.3f})"
                for r in acc["rounds"]
            ),
            "",
        ]
    if dif:
        cold = "" if dif["cold"] else " - page cache NOT dropped (not root)"
        lines += [
            f"### diffusers group offload to disk: UNet2DModel {human_bytes(dif['model_bytes'])}, "
            f"block_level, 1 block per group, sample {dif['sample']}x{dif['sample']}, CPU{cold}",
            "",
            "| | seconds (median): applied + one pass | device reads | note |",
            "|---|---:|---:|---|",
            f"| aionvme `apply_group_offloading` | {dif['aionvme_s']:.3f} | "
            f"{human_bytes(dif['aionvme_read_bytes_proc'])} | streamer read "
            f"{human_bytes(dif['aionvme_bytes_read'])}, budget {human_bytes(dif['budget'])}, "
            f"peak {human_bytes(dif['peak_memory_bytes'])} |",
            f"| diffusers `apply_group_offloading` | {dif['diffusers_s']:.3f} | "
            f"{human_bytes(dif['diffusers_read_bytes_proc'])} | compute in memory {dif['compute_s']:.3f} s |",
            "",
            f"per pass (what each denoising step costs) "
            f"**{dif['diffusers_pass_s'] / dif['aionvme_pass_s']:.2f}x** diffusers' own (target >= 1.5); "
            f"with the one-time apply {dif['speedup']:.2f}x; ours bitwise the model in "
            f"memory: {dif['bitwise_equal']}, diffusers' own: {dif['diffusers_equal']} (max |diff| "
            f"{dif['diffusers_max_diff']:.3g}); the passes alone {dif['aionvme_pass_s']:.3f} / "
            f"{dif['diffusers_pass_s']:.3f} s; rounds: "
            + "; ".join(
                f"{r['aionvme']:.3f} / {r['diffusers']:.3f} (memory {r['memory']:.3f})" for r in dif["rounds"]
            ),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["all", "accelerate", "diffusers"], default="all")
    ap.add_argument("--model-size", default="512M", help="the Llama model's fp32 bytes")
    ap.add_argument("--ratio", type=int, default=4, help="model bytes / memory budget")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--device", default="cpu", help="accelerate's execution device (cuda: the GPU path)")
    ap.add_argument("--unet-width", type=int, default=96, help="the UNet's first block width")
    ap.add_argument("--sample", type=int, default=8, help="the UNet's input height and width")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (on the drive to measure)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--fresh-memory",
        action="store_true",
        help="do not fault in and free memory after each cache drop (see _timed)",
    )
    args = ap.parse_args(argv)
    global WARM_MEMORY
    sizes = [parse_size(args.model_size) if args.workload != "diffusers" else 0, 1 << 30]
    WARM_MEMORY = 0 if args.fresh_memory else max(sizes) * 5 // 4
    work = tempfile.mkdtemp(prefix="aionvme-integrations-", dir=args.dir)
    try:
        acc = dif = None
        if args.workload in ("all", "accelerate"):
            acc = bench_accelerate(args, work, _fio_read_Bps(work))
        if args.workload in ("all", "diffusers"):
            dif = bench_diffusers(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"accelerate": acc, "diffusers": dif}, indent=2) if args.json else report(acc, dif))
    ok = all(r["bitwise_equal"] for r in (acc, dif) if r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
