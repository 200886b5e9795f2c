"""Node-local DCP checkpoints with replicas: aionvme.dcp against fio and torch.

    python3 bench/suites/bench_dcp_nodes.py                    # 2 GiB state
    python3 bench/suites/bench_dcp_nodes.py --size 512M        # smaller, for a small machine

Four gloo ranks (subprocesses, env:// on 127.0.0.1) as two nodes (``GROUP_RANK``
0 for ranks 0-1, 1 for ranks 2-3), each node with its own directory (both on
this machine's one disk). The page cache is dropped before every step (run as
root); times are wall seconds from a barrier before the step to one after it.

- save: ``aionvme.dcp.Writer(node_dir, replicas=2)``: every byte is written
  twice (each node: its ranks' files and the other node's), so the rate is
  all bytes written, against fio writing the same bytes sequentially (4 jobs,
  O_DIRECT, ``end_fsync``, best of bs 4M/64M at QD 16) and against torch's
  ``FileSystemWriter`` (``thread_count`` 1 and 4, the best) writing one copy
  to a shared directory, per byte.
- load after a lost node: node 0's directory is deleted; two ranks as two
  nodes (one each) load the whole state (new rank 0 the old ranks 0-1's
  tensors, new rank 1 those of 2-3): rank 0's come from node 1 over the
  process group. The rate is the bytes read from disk (all on node 1) against
  fio reading as many (2 jobs); the bytes fetched from peers are reported.
- transport: each rank's bytes to the other node with plain gloo
  isend/irecv, twice: the first receives into fresh memory (page faults in
  the socket copy), the second into the same, now faulted-in buffers (the
  steady-state ceiling).
- ``dcp.async_save`` blocking time, 4 ranks: aionvme's writer (replicas=2)
  as its own stager against ``FileSystemWriter`` with torch's default stager.

Prints a Markdown table (``--json`` for the raw figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aionvme.bench import drop_caches
from bench_dcp import FIO_POINTS, _fio, _free_port, _state


def _files_bytes(d: str) -> int:
    return (
        sum(e.stat().st_size for e in os.scandir(d) if e.name.endswith(".distcp")) if os.path.isdir(d) else 0
    )


def _worker(rank: int, world: int, port: str, base: str, per_rank: int, phase: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import aionvme.dcp

    warnings.filterwarnings("ignore")
    per_node = 2 if phase == "save" else 1
    node = rank // per_node
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(node)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    own = f"{base}/node{node}"
    res: dict[str, Any] = {}

    def step(name: str, fn: Any) -> Any:
        dist.barrier()
        if rank == 0:
            drop_caches()
        dist.barrier()
        t0 = time.perf_counter()
        value = fn()
        dist.barrier()
        res[name] = time.perf_counter() - t0
        return value

    def gather(x: Any) -> list[Any]:
        got: list[Any] = [None] * world
        dist.all_gather_object(got, x)
        return got

    if phase == "save":
        sd = _state(rank, per_rank)
        tiny = {f"rank{rank}.warm": torch.zeros(1024)}  # a process's first save pays DCP's imports
        dcp.save(tiny, storage_writer=aionvme.dcp.Writer(f"{own}/warm", replicas=2))
        dcp.save(tiny, storage_writer=dcp.FileSystemWriter(f"{base}/warm_torch"))
        one = aionvme.dcp.Writer(f"{own}/one", replicas=1)
        step("save_aionvme_r1", lambda: dcp.save(sd, storage_writer=one))
        dist.barrier()
        if rank % per_node == 0:
            shutil.rmtree(f"{own}/one")
        ours = aionvme.dcp.Writer(f"{own}/ckpt", replicas=2)
        step("save_aionvme", lambda: dcp.save(sd, storage_writer=ours))
        for tc in (1, 4):
            p = f"{base}/torch{tc}"
            step(
                f"save_torch_t{tc}",
                lambda p=p, tc=tc: dcp.save(sd, storage_writer=dcp.FileSystemWriter(p, thread_count=tc)),
            )
            dist.barrier()
            if rank == 0:
                shutil.rmtree(p)
        # The transport's ceiling: each rank's bytes to the other node over
        # gloo, as the replicas go (plain isend/irecv of one tensor). The
        # first transfer receives into fresh memory (page faults inside the
        # socket copy); the ceiling is the second, into the same buffers.
        blob = torch.ones(per_rank, dtype=torch.uint8)
        into = torch.empty(per_rank, dtype=torch.uint8)
        peer = (rank + 2) % world

        def p2p() -> None:
            works = [dist.irecv(into, peer), dist.isend(blob, peer)]
            for w in works:
                w.wait()

        step("gloo_p2p_cold", p2p)
        step("gloo_p2p", p2p)
        del blob, into
        for name, make in (
            ("aionvme", lambda p: aionvme.dcp.Writer(p, replicas=2)),
            ("torch", lambda p: dcp.FileSystemWriter(p)),
        ):
            p = f"{own}/async_{name}" if name == "aionvme" else f"{base}/async_torch"
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=make(p))
            blocked = time.perf_counter() - t0
            fut.result()
            res[f"async_block_{name}"] = max(gather(blocked))
    else:
        want = {k: v for r in (2 * rank, 2 * rank + 1) for k, v in _state(r, per_rank).items()}
        got = {k: (torch.ones_like(v) if isinstance(v, torch.Tensor) else None) for k, v in want.items()}
        rd = aionvme.dcp.Reader(f"{own}/ckpt")
        step("load_aionvme", lambda: dcp.load(got, storage_reader=rd))
        bad = [k for k, v in want.items() if isinstance(v, torch.Tensor) and not torch.equal(got[k], v)]
        if bad:
            raise SystemExit(f"rank {rank}: loaded wrong data for {bad[:3]}")
        stats = gather(rd.stats)
        res["peer_bytes"] = sum(s["peer_bytes"] for s in stats)
        # bytes read from disk: each rank's own reads, and what it read to serve others
        res["local_read_bytes"] = sum(
            s["direct_bytes"] + s["scratch_bytes"] + s["served_bytes"] for s in stats
        )
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(res, fh)


def _ranks(world: int, base: str, per_rank: int, phase: str) -> dict[str, Any]:
    out = os.path.join(base, f"{phase}.json")
    port = _free_port()
    args = [str(world), port, base, str(per_rank), phase, out]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), *args]) for r in range(world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{phase}: a rank failed ({codes})")
    with open(out) as fh:
        res: dict[str, Any] = json.load(fh)
    return res


def _fio_best(d: str, rw: str, jobs: int, nbytes: int) -> float:
    best = []
    for bs, qd in FIO_POINTS:
        drop_caches()
        best.append(_fio(d, rw, jobs, nbytes // jobs, bs, qd))
    return min(best)


def run(size: int, parent: str | None) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="aionvme-dcpnodes-", dir=parent)
    try:
        res = _ranks(4, base, size // 4, "save")
        res["written_aionvme"] = sum(_files_bytes(f"{base}/node{n}/ckpt") for n in (0, 1))
        res["state_bytes"] = res["written_aionvme"] // 2
        shutil.rmtree(f"{base}/node0")  # node 0 is lost
        res.update(_ranks(2, base, size // 4, "load"))
        if shutil.which("fio"):
            fio_dir = os.path.join(base, "fio")
            os.makedirs(fio_dir)
            res["fio_write"] = _fio_best(fio_dir, "write", 4, res["written_aionvme"])
            res["fio_read"] = _fio_best(fio_dir, "read", 2, res["local_read_bytes"])
        res["bytes"] = size
        return res
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report(r: dict[str, Any]) -> str:
    gb, nan = 1e9, float("nan")
    written, state = r["written_aionvme"], r["state_bytes"]
    ours_w = written / r["save_aionvme"]
    tc = min((1, 4), key=lambda t: r[f"save_torch_t{t}"])
    torch_w = state / r[f"save_torch_t{tc}"]
    fio_w, fio_r = r.get("fio_write", nan), r.get("fio_read", nan)
    local, peer = r["local_read_bytes"] / 2**30, r["peer_bytes"] / 2**30
    blk_ours, blk_torch = r["async_block_aionvme"], r["async_block_torch"]
    p2p, cold = r["gloo_p2p"], r.get("gloo_p2p_cold", nan)
    rows = [
        "| workload | aionvme | baseline | ratio | target |",
        "|---|---|---|---|---|",
        f"| save, {state / 2**30:.2f} GiB state, 4 ranks as 2 nodes, replicas=2 "
        f"({written / 2**30:.2f} GiB written) | {r['save_aionvme']:.2f} s ({ours_w / gb:.2f} GB/s written) "
        f"| fio seq write of the same bytes: {fio_w:.2f} s | {fio_w / r['save_aionvme']:.2f}x | >= 0.85x |",
        f"| same state, replicas=1 (node-local, one copy) | {r['save_aionvme_r1']:.2f} s "
        f"({state / r['save_aionvme_r1'] / gb:.2f} GB/s) | fio seq write of those bytes: ~{fio_w / 2:.2f} s "
        f"| {fio_w / 2 / r['save_aionvme_r1']:.2f}x | - |",
        f"| same save, per byte written | {ours_w / gb:.2f} GB/s | torch FileSystemWriter, one copy, "
        f"shared dir (t={tc}): {torch_w / gb:.2f} GB/s | {ours_w / torch_w:.2f}x | >= 1.5x |",
        f"| load 4 -> 2 ranks after losing node 0 ({local:.2f} GiB read from disk, {peer:.2f} GiB fetched "
        f"from peers) | {r['load_aionvme']:.2f} s | fio read of the locally read bytes: {fio_r:.2f} s "
        f"| {fio_r / r['load_aionvme']:.2f}x | >= 0.8x |",
        f"| transport: each rank's bytes to the other node, gloo isend/irecv into buffers already "
        f"received into once | {p2p:.2f} s ({state / p2p / gb:.2f} GB/s) | the save above "
        f"| {p2p / r['save_aionvme']:.2f}x | (ceiling of the save's network part) |",
        f"| same, the first transfer, into fresh memory | {cold:.2f} s ({state / cold / gb:.2f} GB/s) "
        f"| the save above | {cold / r['save_aionvme']:.2f}x | report |",
        f"| `dcp.async_save` blocking, 4 ranks | {blk_ours:.3f} s | torch's stager (FileSystemWriter): "
        f"{blk_torch:.3f} s | {blk_torch / blk_ours:.2f}x | report |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        r, world, port, base, per_rank, phase, out = argv[1:8]
        _worker(int(r), int(world), port, base, int(per_rank), phase, out)
        return 0
    from aionvme.defaults import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2G", help="state dict bytes over the 4 ranks (default 2G)")
    ap.add_argument("--dir", default=None, help="where the node directories go (default: the temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run(parse_size(args.size), args.dir)
    print(json.dumps(res, indent=1) if args.json else report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
