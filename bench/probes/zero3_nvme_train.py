"""ZeRO-3 training with the optimizer state offloaded to NVMe, on aionvme's
DeepSpeed drop-in (no libaio, no async_io op build).

    python3 bench/probes/zero3_nvme_train.py --nvme /nvme/ds_swap --steps 20    # one GPU, no launcher
    deepspeed bench/probes/zero3_nvme_train.py --nvme /nvme/ds_swap --steps 20  # or through the launcher

A Llama-style model from a config with random weights (nothing downloaded),
trained for ``--steps`` steps on random tokens with ZeRO stage 3,
``offload_optimizer: {device: nvme}`` (and ``--offload-param`` for
parameters too). DeepSpeed's swappers read and write the optimizer state
through ``AsyncIOBuilder().load()``, which ``aionvme.compat.deepspeed.install()``
makes aionvme's op. Prints the loss per step, the step time, and aionvme's
engine counters (proof that the swaps went through aionvme); exits non-zero if
the loss is not finite or did not go down.

Needs a CUDA GPU (ZeRO-3 with NVMe offload runs DeepSpeedCPUAdam, whose op
DeepSpeed builds at first use: a C++ compiler and ninja).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme", required=True, help="swap directory on the NVMe drive")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--offload-param", action="store_true", help="parameters to NVMe too")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("zero3_nvme_train: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import aionvme.compat.deepspeed

    aionvme.compat.deepspeed.install()  # before DeepSpeed loads its async_io op
    import deepspeed
    import transformers

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(args.local_rank)
    os.makedirs(args.nvme, exist_ok=True)
    aio = {
        "block_size": 1 << 20,
        "queue_depth": 32,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
    }
    nvme = {"device": "nvme", "nvme_path": args.nvme, "pin_memory": True, "buffer_count": 4}
    zero: dict[str, object] = {
        "stage": 3,
        "offload_optimizer": dict(nvme),
        "stage3_param_persistence_threshold": 0,
    }
    if args.offload_param:
        zero["offload_param"] = {**nvme, "buffer_count": 5, "buffer_size": 1 << 26, "max_in_cpu": 0}
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "aio": aio,
        "steps_per_print": 10**9,
    }
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq,
    )
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = transformers.LlamaForCausalLM(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (4, args.batch, args.seq), generator=g)  # 4 batches, repeated
    losses = []
    times = []
    for step in range(args.steps):
        ids = data[step % len(data)].to(engine.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(f"step {step:3d} loss {losses[-1]:.4f} {times[-1]:.2f} s", flush=True)
    counters = aionvme.compat.deepspeed.stats() if hasattr(aionvme.compat.deepspeed, "stats") else {}
    summary = {
        "steps": args.steps,
        "median_step_s": sorted(times)[len(times) // 2],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "aionvme_op": aionvme.compat.deepspeed.installed(),
        "swap_files": sum(len(fs) for _, _, fs in os.walk(args.nvme)),
        "counters": counters,
    }
    print(json.dumps(summary, default=str))
    ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
