"""Lightning checkpoints and transformers cold loads through aionvme, side by side with the frameworks' own.

    python3 bench/suites/bench_integrations_io.py     # 1.13 GiB checkpoint, 0.75 GiB model, 2 rounds
    python3 bench/suites/bench_integrations_io.py --ckpt-size 2G --model-size 1.5G --repeat 3 --json

Lightning: a checkpoint shaped as Lightning's ``dump_checkpoint`` makes it (a model
state dict, one real AdamW step's optimizer state: 3x the parameters' bytes, loops
and callbacks state), ``--ckpt-size`` in all. Per round, in alternating order:
``TorchCheckpointIO().save_checkpoint`` (torch.save to a buffer, then one write; no
fsync) and ours (``aionvme.integrations.lightning.CheckpointIO``: atomic, fsynced);
``TorchCheckpointIO`` + an fsync of its file is shown too (what durability costs it).
Then each file is loaded cold (page cache dropped) by its own plugin, and the two
loaded checkpoints are compared bitwise. The async rows give how long
``save_checkpoint`` blocks training: ours (snapshot into one buffer) against
Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())`` (a clone of every tensor);
both writes are waited for before the next step.

transformers: a Llama-style model with random weights (nothing downloaded), fp32,
about ``--model-size``, saved by ``save_pretrained`` in 200 MB shards. Cold loads:
``LlamaForCausalLM.from_pretrained(path)``; ours,
``aionvme.integrations.transformers.from_pretrained``; fastsafetensors (on CPU with
``nogds=True``) reading the shards into a state dict handed to transformers the way
ours is. transformers maps the shards and reads them lazily, so every load is timed
until each weight is in memory (one byte read per page of every parameter, the same
for all); the call alone is printed beside it. Before every cold load (Lightning's too)
the page cache is dropped and 1.25x the bytes of anonymous memory faulted in and freed,
so no side pays this VM's cost of memory returned to the host (see ``cold``).
Every model's state dict is checked bitwise against the first. ``--device cuda``
loads to the GPU (``device_map``; fastsafetensors with cuFile) and adds
InstantTensor, which loads to CUDA devices only ("InstantTensor only supports CUDA
devices for now"): bench/gpu_check.sh.

Run as root so the page cache is dropped before every cold load.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from aionvme.bench import drop_caches, evict, scratch_dir
from aionvme.defaults import parse_size

WARM_MEMORY = True


def cold(paths: list[str], memory: int = 0) -> None:
    """Drop the page cache, then fault in and free ``memory`` bytes of anonymous
    memory: on this VM (Firecracker, free page reporting) memory the guest has
    handed back to the host costs 1-5 s/GiB to fault in again, against 0.1-0.2 s
    for memory freed a moment ago (src/aionvme/formats/_prefault.py); whoever
    loads next would pay that first. Each side gets recently freed memory."""
    drop_caches()
    evict(*paths)
    if memory and WARM_MEMORY:
        import numpy as np

        np.ones(memory, dtype=np.uint8)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


# -- Lightning -------------------------------------------------------------------------


def lightning_checkpoint(total: int) -> dict[str, Any]:
    """Lightning's checkpoint of a stack of 4096x4096 (or smaller) linear layers
    after one AdamW step: parameters plus two state tensors each, ``total`` bytes."""
    per = total // 3
    width = 4096 if per >= 4096 * 4096 * 4 else 1024
    layers = max(1, per // (width * width * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None, "dirpath": "/x"}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def bench_lightning(work: str, size: int, repeat: int) -> dict[str, Any]:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO as TheirAsync

    from aionvme.integrations.lightning import AsyncCheckpointIO, CheckpointIO

    ckpt = lightning_checkpoint(size)
    nbytes = sum(t.nbytes for t in _tensors(ckpt))
    ours_p, torch_p = os.path.join(work, "ours.ckpt"), os.path.join(work, "torch.ckpt")
    rows: dict[str, list[float]] = collections.defaultdict(list)
    sides = {
        "TorchCheckpointIO save": lambda: TorchCheckpointIO().save_checkpoint(ckpt, torch_p),
        "aionvme CheckpointIO save (fsynced)": lambda: CheckpointIO().save_checkpoint(ckpt, ours_p),
    }
    for r in range(repeat):
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
            cold([p for p in (ours_p, torch_p) if os.path.exists(p)])
            dt, _ = timed(sides[name])
            rows[name].append(dt)
            if name.startswith("Torch"):
                dt_sync, _ = timed(lambda: _fsync(torch_p))
                rows["TorchCheckpointIO save + fsync"].append(dt + dt_sync)
        loads = {
            "TorchCheckpointIO load (cold)": lambda: TorchCheckpointIO().load_checkpoint(torch_p),
            "aionvme CheckpointIO load (cold)": lambda: CheckpointIO().load_checkpoint(ours_p),
        }
        got = {}
        for name in list(loads)[:: 1 if r % 2 == 0 else -1]:
            cold([ours_p, torch_p], memory=nbytes * 5 // 4)
            dt, got[name] = timed(loads[name])
            rows[name].append(dt)
        a, b = got.values()
        if not same(a, b):
            raise SystemExit("the two plugins loaded different checkpoints")
        del got, a, b
        gc.collect()
        # how long save_checkpoint blocks the training step; each write awaited before the next
        ours_async, theirs_async = AsyncCheckpointIO(), TheirAsync(TorchCheckpointIO())
        for name, plugin, path in (
            ("aionvme AsyncCheckpointIO blocks", ours_async, ours_p),
            ("Lightning AsyncCheckpointIO blocks", theirs_async, torch_p),
        ):
            dt, _ = timed(lambda plugin=plugin, path=path: plugin.save_checkpoint(ckpt, path))
            rows[name].append(dt)
            plugin.teardown()
    return {"bytes": nbytes, "rows": rows}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


# -- transformers ----------------------------------------------------------------------


def save_model(path: str, size: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter = 1024, 2816
    per_layer = 4 * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * inter + 2 * hidden)
    embed = 2 * 4 * 32000 * hidden
    layers = max(1, (size - embed) // per_layer)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=int(layers),
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02, generator=g)
    model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.nbytes for p in model.parameters())


def resident(model: Any) -> None:
    """Read one byte of every page of every parameter (transformers' weights
    may still be file mappings that fault in on first use)."""
    for p in model.parameters():
        flat = p.detach().reshape(-1).view(torch.uint8)
        flat[::4096].sum()


def bench_transformers(work: str, size: int, repeat: int, device: str = "cpu") -> dict[str, Any]:
    """Cold loads of one saved model by each side; ``device="cuda"`` puts the
    model on the GPU (``device_map="cuda"``) and adds InstantTensor."""
    from transformers import LlamaForCausalLM

    from aionvme.integrations import transformers as T

    path = os.path.join(work, "model")
    nbytes = save_model(path, size)
    files = [os.path.join(path, f) for f in os.listdir(path)]
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    where: dict[str, Any] = {} if device == "cpu" else {"device_map": device}

    def handed(state: dict[str, Any]) -> Any:  # a state dict given to transformers as ours is
        return LlamaForCausalLM.from_pretrained(None, config=path, state_dict=state, **where)

    sides: dict[str, Callable[[], Any]] = {
        "transformers from_pretrained": lambda: LlamaForCausalLM.from_pretrained(path, **where),
        "aionvme from_pretrained": lambda: T.from_pretrained(LlamaForCausalLM, path, **where),
    }
    try:
        from fastsafetensors import fastsafe_open

        def fst() -> Any:
            with fastsafe_open(shards, device=device, nogds=device == "cpu") as f:
                return handed({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (not a dict)

        sides["fastsafetensors + state_dict="] = fst
    except ImportError as e:
        print(f"fastsafetensors: not installed ({e})", file=sys.stderr)
    if device != "cpu":
        try:
            import instanttensor

            def it() -> Any:
                with instanttensor.safe_open(shards, framework="pt", device=torch.device(device)) as f:
                    return handed(dict(f.tensors()))

            sides["InstantTensor + state_dict="] = it
        except ImportError as e:
            print(f"InstantTensor: not installed ({e})", file=sys.stderr)
    rows: dict[str, list[float]] = collections.defaultdict(list)
    T.from_pretrained(LlamaForCausalLM, path)  # untimed: imports, the background loop, the engine
    for r in range(repeat):
        ref = None
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
            cold(files, memory=nbytes * 5 // 4)
            t = time.perf_counter()
            model = sides[name]()
            call = time.perf_counter() - t
            resident(model)
            if device != "cpu":
                torch.cuda.synchronize()
            rows[name].append(time.perf_counter() - t)
            rows[name + " (call alone)"].append(call)
            sd = {k: v.cpu() for k, v in model.state_dict().items()}
            if ref is None:
                ref = sd
            elif list(ref) != list(sd) or not all(torch.equal(ref[k], sd[k]) for k in ref):
                raise SystemExit(f"{name}: a different model")
            del model, sd
            gc.collect()
    return {"bytes": nbytes, "rows": rows}


# -- report ----------------------------------------------------------------------------


def report(title: str, res: dict[str, Any], pairs: list[tuple[str, str]]) -> None:
    gb = res["bytes"] / 1e9
    print(f"\n{title} ({res['bytes'] / 2**30:.2f} GiB)")
    for name, ts in res["rows"].items():
        med = sorted(ts)[len(ts) // 2]
        print(
            f"  {name:<48} {med:7.3f} s  {gb / med:6.2f} GB/s   rounds: {', '.join(f'{t:.3f}' for t in ts)}"
        )
    for ours, theirs in pairs:
        if ours in res["rows"] and theirs in res["rows"]:
            ratios = [b / a for a, b in zip(res["rows"][ours], res["rows"][theirs])]
            per = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"  {ours} vs {theirs}: {geomean(ratios):.2f}x (per round: {per})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="where the files go (default: a scratch directory on a local disk)")
    ap.add_argument("--ckpt-size", default="1200M", help="Lightning checkpoint bytes (default 1200M)")
    ap.add_argument("--model-size", default="768M", help="transformers model bytes, fp32 (default 768M)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds, sides alternating in order (default 2)")
    ap.add_argument("--only", choices=["lightning", "transformers"], help="one workload")
    ap.add_argument(
        "--device", default="cpu", help="transformers: where the model goes (cuda: + InstantTensor)"
    )
    ap.add_argument(
        "--fresh-memory",
        action="store_true",
        help="do not fault in and free memory before each cold load (see cold(): on this VM "
        "the first side to allocate then pays for memory returned to the host)",
    )
    ap.add_argument("--json", action="store_true", help="print the rounds as JSON too")
    args = ap.parse_args()
    global WARM_MEMORY
    WARM_MEMORY = not args.fresh_memory
    why = drop_caches()
    if why:
        print(f"note: {why}", file=sys.stderr)
    out: dict[str, Any] = {}
    with scratch_dir(args.dir) as work:
        if args.only in (None, "lightning"):
            out["lightning"] = res = bench_lightning(work, parse_size(args.ckpt_size), args.repeat)
            report(
                "Lightning checkpoint",
                res,
                [
                    ("aionvme CheckpointIO save (fsynced)", "TorchCheckpointIO save"),
                    ("aionvme CheckpointIO save (fsynced)", "TorchCheckpointIO save + fsync"),
                    ("aionvme CheckpointIO load (cold)", "TorchCheckpointIO load (cold)"),
                    ("aionvme AsyncCheckpointIO blocks", "Lightning AsyncCheckpointIO blocks"),
                ],
            )
            for f in os.listdir(work):
                os.remove(os.path.join(work, f))
        if args.only in (None, "transformers"):
            out["transformers"] = res = bench_transformers(
                work, parse_size(args.model_size), args.repeat, args.device
            )
            report(
                "transformers cold load, sharded safetensors, until every weight is in memory",
                res,
                [
                    ("aionvme from_pretrained", "transformers from_pretrained"),
                    ("aionvme from_pretrained", "fastsafetensors + state_dict="),
                    ("aionvme from_pretrained", "InstantTensor + state_dict="),
                ],
            )
    if args.json:
        print(json.dumps({k: {"bytes": v["bytes"], "rows": v["rows"]} for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
