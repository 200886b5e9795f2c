"""One rank of a real gloo process group for tests/test_dcp_dist.py.

Run as ``python dcp_worker.py SCENARIO RANK WORLD PORT DIR``; every rank
writes ``DIR/result-SCENARIO-RANK.json`` when all its checks passed (a failed
check exits non-zero with the traceback on stderr).

The state dict has every kind of item DCP saves: a replicated plain tensor,
DTensors sharded on dim 0 and dim 1 with sizes that do not divide evenly, a
bf16 DTensor, a 4 MiB DTensor (the direct-read path), a ShardedTensor, and
non-tensor values. Every value is a function of its name, so any rank count
can check what it loaded.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import aionvme.dcp

warnings.filterwarnings("ignore")

SHAPES = {
    "dt0": ((10, 6), torch.float32, 0),  # 10 rows over 4 ranks: 3, 3, 3, 1
    "dt1": ((8, 13), torch.float16, 1),
    "bf": ((7, 5), torch.bfloat16, 0),
    "big": ((2048, 512), torch.float32, 0),
}


def full(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 1000 + step)
    if name == "st":
        return torch.randn(12, 6, generator=g)
    if name == "rep":
        return torch.randn(5, 9, generator=g).double()
    shape, dtype, _ = SHAPES[name]
    return torch.randn(*shape, generator=g).to(dtype)


def sharded(mesh: Any, name: str, step: int, dim: int | None = None) -> DTensor:
    d = SHAPES[name][2] if dim is None else dim
    return distribute_tensor(full(name, step), mesh, [Shard(d)])


def make_sharded_tensor(world: int, step: int, empty: bool = False) -> Any:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.zeros(spec, 12, 6)
    if not empty:
        src = full("st", step)
        for shard in st.local_shards():
            o = shard.metadata.shard_offsets
            n = shard.metadata.shard_sizes
            shard.tensor.copy_(src[o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
    return st


def state(mesh: Any, world: int, step: int, layout: str = "saved") -> dict[str, Any]:
    """The state dict of ``step``; layout 'resharded' shards dt0/dt1 on the other dim."""
    other = layout == "resharded"
    return {
        "model": {
            "rep": full("rep", step),
            "dt0": sharded(mesh, "dt0", step, 1 if other else None),
            "dt1": sharded(mesh, "dt1", step, 0 if other else None),
            "bf": sharded(mesh, "bf", step),
            "big": sharded(mesh, "big", step),
            "st": make_sharded_tensor(world, step),
            "repdt": distribute_tensor(full("dt0", step + 1), mesh, [Replicate()]),
        },
        "extra": {"step": step, "name": f"run-{step}", "lst": [1, "two", 3.0, [step]]},
    }


def zeroed(sd: Any, world: int) -> Any:
    if isinstance(sd, dict):
        return {
            k: (make_sharded_tensor(world, 0, empty=True) if k == "st" else zeroed(v, world))
            for k, v in sd.items()
        }
    if isinstance(sd, DTensor):
        return DTensor.from_local(
            torch.zeros_like(sd.to_local()),
            sd.device_mesh,
            sd.placements,
            shape=sd.size(),
            stride=sd.stride(),
        )
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def check(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got)
        for k in want:
            check(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, DTensor):
        assert torch.equal(got.to_local(), want.to_local()), where
    elif (isinstance(want, torch.Tensor) and hasattr(want, "local_shards")) or hasattr(want, "local_shards"):
        for a, b in zip(got.local_shards(), want.local_shards()):
            assert torch.equal(a.tensor, b.tensor), where
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, (where, got, want)


def load_and_check(path: str, sd_want: dict[str, Any], world: int, reader: str) -> None:
    got = zeroed(sd_want, world)
    rd = aionvme.dcp.Reader(path) if reader == "ours" else dcp.FileSystemReader(path)
    dcp.load(got, storage_reader=rd)
    check(got, sd_want, f"{path}[{reader}]")


def async_save_and_check(mesh: Any, world: int, path: str) -> float:
    """dcp.async_save with our writer as the stager: the caller may change the
    state as soon as it returns; the checkpoint holds the state of the call."""
    sd2 = state(mesh, world, 200)
    want2 = state(mesh, world, 200)
    dist.barrier()
    t0 = time.perf_counter()
    fut = dcp.async_save(sd2, storage_writer=aionvme.dcp.Writer(path))
    blocked = time.perf_counter() - t0
    for v in sd2["model"].values():
        local = v.to_local() if isinstance(v, DTensor) else v
        if hasattr(local, "local_shards"):
            for s in local.local_shards():
                s.tensor.zero_()
        else:
            local.zero_()
    sd2["extra"]["lst"].append("changed")
    fut.result()
    load_and_check(path, want2, world, "torch")
    return blocked


def _audit(others: list[str]) -> list[str]:
    """Record the paths in the directories ``others`` (the other nodes')
    this process opens, lists or makes."""
    seen: list[str] = []
    others = [os.path.realpath(o) for o in others]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in ("open", "os.listdir", "os.scandir", "os.mkdir") and args:
            p = args[0]
            if isinstance(p, bytes):
                p = os.fsdecode(p)
            if isinstance(p, str) and os.path.isabs(p):
                p = os.path.realpath(p)
                if any(p == o or p.startswith(o + os.sep) for o in others):
                    seen.append(p)

    sys.addaudithook(hook)
    return seen


def _missing_error(exc: BaseException) -> Any:
    if isinstance(exc, aionvme.dcp.CheckpointMissingError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, aionvme.dcp.CheckpointMissingError):
            return inner
    return None


def nodes_main() -> None:
    """Under torchrun: ``dcp_worker.py nodes SCENARIO BASE DIR0,DIR1,...``;
    the node directory is DIRS[GROUP_RANK]."""
    scenario, base, dirs = sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    node = int(os.environ["GROUP_RANK"])
    own = dirs[node]
    foreign = _audit([d for d in dirs if d != own])
    # DCP_BACKEND=nccl (bench/gpu_check.sh, 2+ GPUs): an NCCL-only default
    # group, so the checkpoint's bytes travel on the gloo group aionvme makes;
    # the state is DTensors on the GPUs (no ShardedTensor: its spec is CPU).
    backend = os.environ.get("DCP_BACKEND", "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world,))

    def state(mesh: Any, world: int, step: int, layout: str = "saved") -> dict[str, Any]:
        sd = globals()["state"](mesh, world, step, layout)
        if backend == "nccl":
            del sd["model"]["st"]
            sd["model"]["rep"] = sd["model"]["rep"].cuda()
        return sd

    out: dict[str, Any] = {"node": node, "world": world}
    if scenario == "save":
        dcp.save(state(mesh, world, 100), storage_writer=aionvme.dcp.Writer(f"{own}/r2", replicas=2))
        dcp.save(state(mesh, world, 101), storage_writer=aionvme.dcp.Writer(f"{own}/r1"))
        # async_save: our writer stages, the replicated save runs on DCP's thread
        sd = state(mesh, world, 102)
        fut = dcp.async_save(sd, storage_writer=aionvme.dcp.Writer(f"{own}/async", replicas=2))
        sd["model"]["rep"].zero_()  # training goes on: the checkpoint holds the values of the call
        fut.result()
        out["files"] = {d: sorted(os.listdir(f"{own}/{d}")) for d in ("r2", "r1")}
    elif scenario == "load":
        want = state(mesh, world, 100, layout="resharded")
        got = zeroed(want, world)
        rd = aionvme.dcp.Reader(f"{own}/r2")
        dcp.load(got, storage_reader=rd)
        check(got, want, "r2")
        out["stats"] = rd.stats
        want = state(mesh, world, 102)
        got = zeroed(want, world)
        dcp.load(got, storage_reader=aionvme.dcp.Reader(f"{own}/async"))
        check(got, want, "async")
        if world == 4:  # the replicas=1 checkpoint lost node 0's files: a typed error on every rank
            try:
                rd1 = aionvme.dcp.Reader(f"{own}/r1")
                dcp.load(zeroed(state(mesh, world, 101), world), storage_reader=rd1)
            except BaseException as e:
                err = _missing_error(e)
                if err is None:
                    raise
                out["missing"] = sorted(err.missing)
                out["missing_fqns"] = sorted(f for fqns in err.missing.values() for f in fqns)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    dist.barrier()
    dist.destroy_process_group()
    out["foreign"] = list(foreign)
    with open(f"{base}/result-{scenario}-{world}-{rank}.json", "w") as fh:
        json.dump(out, fh)


def main() -> None:
    if sys.argv[1] == "nodes":
        nodes_main()
        return
    scenario, rank, world, port, base = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    if scenario == "quick2":
        sd = state(mesh, world, 100)
        dcp.save(sd, storage_writer=aionvme.dcp.Writer(f"{base}/q2"))
        load_and_check(f"{base}/q2", state(mesh, world, 100, layout="resharded"), world, "torch")
        rd = aionvme.dcp.Reader(f"{base}/q2")
        want = state(mesh, world, 100, layout="resharded")
        got = zeroed(want, world)
        dcp.load(got, storage_reader=rd)
        check(got, want)
        out["stats"] = rd.stats
        out["async_block_s"] = async_save_and_check(mesh, world, f"{base}/q2async")
    elif scenario == "save4":
        sd = state(mesh, world, 100)
        dcp.save(sd, storage_writer=aionvme.dcp.Writer(f"{base}/ours4"))
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{base}/torch4"))
        for d in ("ours4", "torch4"):
            for reader in ("ours", "torch"):
                load_and_check(f"{base}/{d}", sd, world, reader)
        out["async_block_s"] = async_save_and_check(mesh, world, f"{base}/async4")
    elif scenario == "load2":
        for d, step in (("ours4", 100), ("torch4", 100), ("async4", 200)):
            want = state(mesh, world, step, layout="resharded")
            for reader in ("ours", "torch"):
                load_and_check(f"{base}/{d}", want, world, reader)
        sd = state(mesh, world, 300)
        dcp.save(sd, storage_writer=aionvme.dcp.Writer(f"{base}/ours2"))
        load_and_check(f"{base}/ours2", state(mesh, world, 300, layout="resharded"), world, "torch")
        rd = aionvme.dcp.Reader(f"{base}/ours2")
        got = zeroed(sd, world)
        dcp.load(got, storage_reader=rd)
        check(got, sd)
        out["stats"] = rd.stats
    elif scenario == "nodefail":
        # one rank per "node" (GROUP_RANK = rank), replicas=2: a save whose
        # write fails on one rank raises on every rank and commits nowhere
        import errno as _errno

        from aionvme.dcp import _writer

        os.environ["GROUP_RANK"] = str(rank)
        own = f"{base}/node{rank}"
        sd = state(mesh, world, 100)
        dcp.save(sd, storage_writer=aionvme.dcp.Writer(own, replicas=2))
        before = sorted(os.listdir(own))
        real = _writer._write_file
        if rank == world - 1:

            async def full(*args: Any) -> None:
                raise OSError(_errno.ENOSPC, "No space left on device (injected)", args[0])

            _writer._write_file = full  # type: ignore[assignment]
        try:
            dcp.save(state(mesh, world, 200), storage_writer=aionvme.dcp.Writer(own, replicas=2))
        except BaseException as e:
            out["failed"] = type(e).__name__ + ": " + str(e)
        _writer._write_file = real  # type: ignore[assignment]
        out["kept"] = sorted(n for n in before if n not in os.listdir(own))  # files the failed save removed
        load_and_check(own, state(mesh, world, 100, layout="resharded"), world, "ours")
        dcp.save(state(mesh, world, 300), storage_writer=aionvme.dcp.Writer(own, replicas=2))
        load_and_check(own, state(mesh, world, 300), world, "ours")
        out["after"] = len([n for n in os.listdir(own) if n.endswith(".distcp")])
    elif scenario == "splitcommit":
        # one rank per "node": a crash after node 0 committed step 200 but
        # before node 1 did leaves node 1 with step 100's .metadata; every
        # rank must load the newest complete checkpoint (200), the same one
        os.environ["GROUP_RANK"] = str(rank)
        own = f"{base}/node{rank}"
        dcp.save(state(mesh, world, 100), storage_writer=aionvme.dcp.Writer(own, replicas=2))
        late = aionvme.dcp.Writer(own, replicas=2)
        if rank == 1:
            late._commit = lambda *args, **kwargs: None  # type: ignore[method-assign]
        dcp.save(state(mesh, world, 200), storage_writer=late)
        with open(f"{own}/.metadata", "rb") as fh:
            out["own_step"] = pickle.load(fh).storage_meta.save_id
        load_and_check(own, state(mesh, world, 200, layout="resharded"), world, "ours")
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{base}/result-{scenario}-{rank}.json", "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
