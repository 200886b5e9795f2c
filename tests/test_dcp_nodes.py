"""aionvme.dcp on node-local directories, with real torchrun launches.

Two ``torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d`` launches
on this machine are 4 gloo ranks on 2 "nodes", each node with its own
checkpoint directory. A replicas=2 save puts every rank's file on both
nodes and ``.metadata`` on each; after node 0's directory is deleted, 4 ranks
load it (node 0's ranks get the metadata and every record from node 1's
ranks over the process group) and so do 2 ranks (one launch, ``--nnodes=1``,
on node 1's directory), bitwise. A replicas=1 save gathered into one
directory loads with torch's FileSystemReader; once node 0's directory is
gone it raises CheckpointMissingError naming node 0's files. Every rank
records (audit hook) the paths it opens or lists: none is another node's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import aionvme.dcp  # noqa: E402
from test_dcp_dist import _free_port, _group, _load_one_process  # noqa: E402

WORKER = Path(__file__).with_name("dcp_worker.py")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _torchrun(
    nnodes: int, scenario: str, base: Path, dirs: list[Path], backend: str = "gloo"
) -> list[dict[str, Any]]:
    port = _free_port()
    env = {
        **os.environ,
        "DCP_BACKEND": backend,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={scenario}{nnodes}",
        "--max-restarts=0",
        "--local-addr=127.0.0.1",
        str(WORKER),
        "nodes",
        scenario,
        str(base),
        ",".join(map(str, dirs)),
    ]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(nnodes)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n\n".join(o[-6000:] for o in outs)
    world = 2 * nnodes
    res = [json.loads((base / f"result-{scenario}-{world}-{r}.json").read_text()) for r in range(world)]
    for r in res:
        assert r["foreign"] == [], f"a rank of node {r['node']} touched another node's files: {r['foreign']}"
    return res


def test_replicas_need_a_process_group(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replicas must be"):
        aionvme.dcp.Writer(tmp_path, replicas=0)
    with pytest.raises(dcp.api.CheckpointException) as info:
        dcp.save({"w": torch.ones(4)}, storage_writer=aionvme.dcp.Writer(tmp_path, replicas=2))
    assert "replicas=2 needs a save by every rank" in str(info.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                not (torch.cuda.is_available() and torch.cuda.device_count() >= 4),
                reason="4 ranks on an NCCL-only default group need 4 GPUs; bench/gpu_check.sh runs it",
            ),
        ),
    ],
)
def test_replicas_survive_a_lost_node_and_load_at_four_and_two_ranks(tmp_path: Path, backend: str) -> None:
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    saved = _torchrun(2, "save", tmp_path, dirs, backend)
    for d in dirs:  # every node: .metadata and all four ranks' files (its own two and the other's)
        names = sorted(os.listdir(d / "r2"))
        assert ".metadata" in names and len([n for n in names if n.endswith(".distcp")]) == 4, names
        one = sorted(os.listdir(d / "r1"))
        assert ".metadata" in one and len([n for n in one if n.endswith(".distcp")]) == 2, one
    assert {r["node"] for r in saved} == {0, 1}
    # replicas=1 is today's format: the nodes' directories gathered into one load with torch's reader
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for d in dirs:
        for f in (d / "r1").iterdir():
            shutil.copy(f, gathered / f.name)
    for reader in ("torch", "ours"):
        _load_one_process(gathered, 101, reader)
    lost = {n for n in os.listdir(dirs[0] / "r1") if n.endswith(".distcp")}

    shutil.rmtree(dirs[0])  # node 0 is lost
    four = _torchrun(2, "load", tmp_path, dirs, backend)
    for r in four:
        assert r["missing"] == sorted(lost), (r["missing"], lost)
        assert r["missing_fqns"], r
        if r["node"] == 0:  # everything came from node 1
            assert r["stats"]["peer_bytes"] > 0 and r["stats"]["files"] == 0, r["stats"]
        else:
            assert r["stats"]["peer_bytes"] == 0, r["stats"]
    assert sum(r["stats"]["served_bytes"] for r in four) == sum(r["stats"]["peer_bytes"] for r in four)
    two = _torchrun(1, "load", tmp_path, [dirs[1]], backend)
    assert all(r["stats"]["peer_bytes"] == 0 for r in two)


def test_a_rank_failing_its_write_fails_the_save_everywhere_and_commits_nowhere(tmp_path: Path) -> None:
    """Two ranks as two nodes, replicas=2: the last rank's write fails
    (ENOSPC, injected) while the other's succeeds; both ranks' saves raise
    (the peer's error named), neither directory's checkpoint changes (it
    loads as before, nothing of it removed), and the next save cleans up."""
    res = _group("nodefail", 2, tmp_path)
    for r in res:
        assert "ENOSPC" in r["failed"] or "No space left" in r["failed"], r["failed"]
        assert r["kept"] == [], r
        assert r["after"] == 2, r  # its own file and the other node's copy, nothing left over


def test_replica_placement_is_a_ring_over_node_directories() -> None:
    from aionvme.dcp._dist import Topology

    def topo(nodes: list[str], places: list[list[int]]) -> Topology:
        place_of = [next(g for g, p in enumerate(places) if r in p) for r in range(len(nodes))]
        return Topology(0, nodes, places, place_of, [min(p) for p in places], 0, [None] * len(nodes))

    t = topo(["0", "0", "1", "1", "2", "2"], [[0, 1], [2, 3], [4, 5]])
    assert [t.targets(r, 2) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert [t.targets(r, 3) for r in range(2)] == [[2, 4], [3, 5]]
    assert t.sources(0, 3) == [2, 4]
    t.check_replicas(3, "/ckpt")
    with pytest.raises(ValueError, match="replicas=4 needs 4 node-local directories"):
        t.check_replicas(4, "/ckpt")
    uneven = topo(["0", "0", "0", "1"], [[0, 1, 2], [3]])  # 3 ranks send to one: it takes them all
    assert [uneven.targets(r, 2) for r in range(4)] == [[3], [3], [3], [0]]
    with pytest.raises(ValueError, match="share the directory"):
        topo(["0", "1", "2"], [[0, 1], [2]]).check_replicas(2, "/ckpt")
    with pytest.raises(ValueError, match="name different directories"):
        topo(["0", "0", "1"], [[0], [1], [2]]).check_replicas(2, "/ckpt")


def test_nodes_whose_commits_a_crash_split_load_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    """Node 1 never committed the second save (as if it crashed between the
    nodes' commits): its .metadata is the first save's. Both ranks load the
    second (its data was on both nodes before the first commit)."""
    res = _group("splitcommit", 2, tmp_path)
    assert res[0]["own_step"] > res[1]["own_step"]  # the directories did disagree
