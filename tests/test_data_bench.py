"""bench/suites/bench_loader.py runs and checks what it claims (tiny sizes; speed is measured in bench/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import aionvme as nvme

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_loader_smoke(tmp_path):
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "suites" / "bench_loader.py"),
        "--size",
        "16M",
        "--small-size",
        "4M",
        "--prefetch",
        "32M",
        "--repeat",
        "2",
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
    a = tools["aionvme Loader async (uvloop)"]
    assert a["stall_ms"] is not None and a["stall_max_ms"] >= a["stall_ms"] and a["loop_cpu_ms"] > 0
    assert a["runs"] == 2 and a["slabs"] >= 1
    qd = nvme.defaults.settings.queue_depth
    for name in (
        f"fio randread bs=128k QD {qd} (the loader's depth)",
        f"fio replay QD {qd}: loader's offsets, shuffled",
        f"fio replay QD {qd}: loader's offsets, sorted/batch",
    ):
        assert tools[name]["ok"] and tools[name]["MB_s"] > 0  # a replay read every one of the 128 samples
    mem = tools["aionvme Loader (fresh process)"]
    assert mem["samples"] == 128 and mem["within"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("aionvme-bench-loader-")]  # cleaned up


def test_cli_bench_loader_workload(tmp_path, capsys):
    """``aionvme bench -w loader``: one verified epoch as one result (medians of repetitions)."""
    import aionvme.bench as B
    from aionvme.cli import main

    assert "loader" in B.names() and B.get("loader").load().__name__ == "loader_workload"
    argv = ["bench", "--json", "--dir", str(tmp_path), "--size", "2M", "-w", "loader", "--loop", "asyncio"]
    assert main([*argv, "-o", "sample=64K", "-o", "batch=8", "--repeat", "2"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["workload"] == "loader" and r["verified"] is True and r["skipped"] is None and r["runs"] == 2
    assert r["ops"] == 32 and r["nbytes"] == 32 * (64 << 10)  # every sample once, checked
    assert r["params"] == {"mode": "async", "sample": 64 << 10, "batch": 8, "prefetch": 4 * 8 * (64 << 10)}
    fig = r["figures"]
    assert fig["samples_s"] > 0 and fig["cpu_us_per_sample"] > 0 and fig["loop_cpu_max_ms"] > 0
    assert 1 <= fig["slabs"] <= 4
    if shutil.which("fio"):
        assert fig["fio_MB_s"] > 0 and fig["vs_fio"] > 0


async def test_loader_workload_sync_and_damaged_samples(tmp_path):
    """The sync mode, and the workload's check is real: a sample whose bytes
    changed on disk fails verification."""
    import aionvme.bench as B
    from aionvme.bench.loader import sample_bytes

    ctx = B.Context(str(tmp_path), size=256 << 10, options={"sample": "8K", "batch": "4", "fio": "0"})
    r = await B.run("loader", ctx)
    assert r.verified and r.ops == 32 and r.params["mode"] == "async" and "loop_cpu_max_ms" in r.figures
    ctx.options["mode"] = "sync"  # a plain for on the loader's own loop thread
    r = await B.run("loader", ctx)
    assert r.verified and r.ops == 32 and r.params["mode"] == "sync"
    assert "loop_cpu_max_ms" not in r.figures and "fio_MB_s" not in r.figures
    ds = nvme.data.Dataset(tmp_path / f"loader-{8 << 10}")
    x = ds.layout.fields["x"]
    bad = sample_bytes(5, 8 << 10)
    bad[8] ^= 1  # sample 5's pattern, one byte off; its size and index stay
    with open(ds.layout.files[int(x.file[5])], "r+b") as f:
        f.seek(int(x.offset[5]))
        f.write(bad.tobytes())
    r = await B.run("loader", ctx)
    assert not r.verified and r.ops == 32
