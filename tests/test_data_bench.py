"""bench/bench_loader.py runs and checks what it claims (tiny sizes; speed is measured in bench/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_loader_smoke(tmp_path):
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "bench_loader.py"),
        "--size",
        "16M",
        "--small-size",
        "4M",
        "--prefetch",
        "32M",
        "--repeat",
        "1",
        "--no-peers",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    tools = {row["tool"]: row for row in rows}
    for name in (
        "aionvme Loader async (uvloop)",
        "aionvme Loader sync for",
        "aionvme Loader sync (batch 1024)",
    ):
        assert tools[name]["ok"] and tools[name]["samples_s"] > 0
    assert tools["aionvme Loader async (uvloop)"]["stall_ms"] is not None
    mem = tools["aionvme Loader (fresh process)"]
    assert mem["samples"] == 128 and mem["within"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("aionvme-bench-loader-")]  # cleaned up
