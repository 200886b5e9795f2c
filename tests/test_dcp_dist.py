"""aionvme.dcp in real gloo process groups (subprocesses, env:// on 127.0.0.1).

Each group runs many checks (tests/dcp_worker.py), because starting a torch
process costs seconds here. The 2-rank test is the quick one; the 4 -> 2 -> 1
resharding matrix (both writers x both readers, async_save) is slow.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import aionvme.dcp  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import dcp_worker  # noqa: E402

WORKER = Path(__file__).with_name("dcp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(scenario: str, world: int, base: Path) -> list[dict]:
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(r), str(world), port, str(base)],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        errs.append(err)
    failed = [(r, e[-4000:]) for r, (p, e) in enumerate(zip(procs, errs)) if p.returncode != 0]
    assert not failed, f"{scenario}: ranks failed: {failed}"
    return [json.loads((base / f"result-{scenario}-{r}.json").read_text()) for r in range(world)]


def _load_one_process(path: Path, step: int, reader: str) -> None:
    """Resharding to one process, no process group: every item into plain tensors."""
    want = {
        "model": {
            "rep": dcp_worker.full("rep", step),
            "dt0": dcp_worker.full("dt0", step),
            "dt1": dcp_worker.full("dt1", step),
            "bf": dcp_worker.full("bf", step),
            "big": dcp_worker.full("big", step),
            "st": dcp_worker.full("st", step),
            "repdt": dcp_worker.full("dt0", step + 1),
        },
        "extra": {"step": step, "name": f"run-{step}", "lst": [1, "two", 3.0, [step]]},
    }
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "extra": {}}
    got["extra"] = {"step": None, "name": None, "lst": None}
    rd = aionvme.dcp.Reader(path) if reader == "ours" else dcp.FileSystemReader(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=rd)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), (path, reader, k)
    assert got["extra"] == want["extra"]


def test_two_ranks_save_load_reshard_async(tmp_path: Path) -> None:
    res = _group("quick2", 2, tmp_path)
    assert all(r["async_block_s"] > 0 for r in res)
    for r in res:
        assert r["stats"]["requests"] == r["stats"]["files"], r["stats"]  # one batched request per file
        assert r["stats"]["fallbacks"] == 0
    for reader in ("ours", "torch"):
        _load_one_process(tmp_path / "q2", 100, reader)
        _load_one_process(tmp_path / "q2async", 200, reader)


@pytest.mark.slow
def test_four_ranks_to_two_to_one(tmp_path: Path) -> None:
    res = _group("save4", 4, tmp_path)
    assert all(r["async_block_s"] > 0 for r in res)
    _group("load2", 2, tmp_path)
    for d, step in (("ours4", 100), ("torch4", 100), ("async4", 200), ("ours2", 300)):
        for reader in ("ours", "torch"):
            _load_one_process(tmp_path / d, step, reader)
