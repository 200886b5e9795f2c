"""A replica's bytes on the wire: chunks, a ring of receive buffers, a lost sender.

Two gloo ranks (subprocesses, env:// on 127.0.0.1) as two nodes. With the
chunk size made small (64 KiB), a replicas=2 save sends each rank's file in
many more chunks than the receiver's ring has buffers, so buffers are reused
while earlier chunks are still being written: the copy on the other node is
bitwise the sender's file, and the state loads bitwise from either node
alone; once node 0's directory is gone, rank 0's records come from rank 1
in many chunks, bitwise. A sender that dies after a few chunks makes the receiver raise
CheckpointPeerError (the subprocess timeout bounds it: no hang).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_dcp_dist import _free_port  # noqa: E402

SMALL_CHUNK = 64 << 10


def _state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {
        f"r{rank}.big": torch.randn(300_001, generator=g),  # ~1.2 MiB: 19 chunks of 64 KiB
        f"r{rank}.odd": torch.randn(12_345, generator=g).bfloat16(),
        f"r{rank}.tiny": torch.arange(7, dtype=torch.int64) + rank,
    }


def _worker(scenario: str, rank: int, port: str, base: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import aionvme.dcp
    from aionvme.dcp import _dist, _fetch, _writer
    from aionvme.dcp._common import run

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GROUP_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _dist.CHUNK = _fetch.CHUNK = SMALL_CHUNK
    out: dict[str, object] = {}
    if scenario == "chunks":
        seen: list[int] = []
        real = _dist.recv_head

        def recv_head(src: int) -> object:
            inc = real(src)
            seen.append(len(inc.chunks) if inc is not None else -1)
            return inc

        _writer.recv_head = recv_head  # type: ignore[assignment]
        sd = _state(rank)
        dcp.save(sd, storage_writer=aionvme.dcp.Writer(f"{base}/node{rank}", replicas=2))
        out["chunks"] = seen
        dist.barrier()
        for node in (0, 1):  # each node alone holds everything
            got = {k: torch.zeros_like(v) for r in (0, 1) for k, v in _state(r).items()}
            dcp.load(got, storage_reader=aionvme.dcp.Reader(f"{base}/node{node}"), no_dist=True)
            want = {k: v for r in (0, 1) for k, v in _state(r).items()}
            out[f"node{node}_equal"] = all(torch.equal(got[k], v) for k, v in want.items())
        # node 0 is lost: rank 0 fetches every record from rank 1, in chunks
        served: list[int] = []
        real_serve = _fetch._serve

        async def serve(path: str, chunks: list) -> object:
            served.append(len(chunks))
            return await real_serve(path, chunks)

        _fetch._serve = serve  # type: ignore[assignment]
        dist.barrier()
        if rank == 0:  # its copies, to compare with node 1's files
            names = [n for n in os.listdir(f"{base}/node0") if n.endswith(".distcp")]
            digests = {n: hashlib.sha256(Path(f"{base}/node0/{n}").read_bytes()).hexdigest() for n in names}
            Path(f"{base}/node0.json").write_text(json.dumps(digests))
            shutil.rmtree(f"{base}/node0")
            os.makedirs(f"{base}/node0")
        dist.barrier()
        mine = {k: torch.zeros_like(v) for k, v in _state(rank).items()}
        rd = aionvme.dcp.Reader(f"{base}/node{rank}")
        dcp.load(mine, storage_reader=rd)
        out["lost_equal"] = all(torch.equal(mine[k], v) for k, v in _state(rank).items())
        out["served"] = served
        out["peer_bytes"] = rd.stats["peer_bytes"]
    elif scenario == "lost":
        if rank == 1:  # announce a 4 MiB file, send 3 of its 64 chunks, die
            blob = torch.ones(4 << 20, dtype=torch.uint8)
            works = _dist.send_head([(blob, 0)], len(blob), 0)
            pieces = [(blob[i * SMALL_CHUNK : (i + 1) * SMALL_CHUNK], i * SMALL_CHUNK) for i in range(3)]
            works += _dist.send_file(pieces, 0)
            for w in works:
                w.wait()
            os._exit(0)
        inc = _dist.recv_head(1)
        try:
            run(_writer._write_received(f"{base}/copy.distcp", inc, True))
            out["raised"] = None
        except Exception as e:
            out["raised"] = type(e).__name__
            out["message"] = str(e)
    with open(f"{base}/result-{scenario}-{rank}.json", "w") as fh:
        json.dump(out, fh)
    os._exit(0)  # no destroy_process_group: the peer may be gone


def _run(scenario: str, base: Path) -> list[dict]:
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario, str(r), port, str(base)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=120)[1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), errs
    files = [base / f"result-{scenario}-{r}.json" for r in range(2)]
    return [json.loads(f.read_text()) if f.exists() else {} for f in files]


def test_replica_sent_in_more_chunks_than_the_ring_is_bitwise_the_senders_file(tmp_path: Path) -> None:
    res = _run("chunks", tmp_path)
    for r in res:
        assert len(r["chunks"]) == 1 and r["chunks"][0] > 8, r  # > 2x the ring's 4 buffers
        assert r["node0_equal"] and r["node1_equal"], r
    assert res[0]["lost_equal"] and res[1]["lost_equal"], res
    assert res[0]["peer_bytes"] > 0 and res[1]["peer_bytes"] == 0, res
    assert res[1]["served"][0] > 8, res  # rank 0's records went out in many chunks
    n1 = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "node1").glob("*.distcp")}
    n0 = json.loads((tmp_path / "node0.json").read_text())
    assert len(n1) == 2 and n0 == n1  # every file on both nodes, the same bytes


def test_a_sender_lost_mid_file_raises_checkpoint_peer_error(tmp_path: Path) -> None:
    res = _run("lost", tmp_path)
    assert res[0]["raised"] == "CheckpointPeerError", res[0]
    assert "rank 1" in res[0]["message"], res[0]


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
