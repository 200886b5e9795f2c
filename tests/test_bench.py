"""Smoke tests of the bench tool: every workload runs on a few MiB, verifies
its data and reports sane figures (speed itself is measured in bench/)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from aionvme import benchmark as B
from aionvme.cli import main


def test_pattern_roundtrip():
    buf = np.zeros(4096, np.uint8)
    B.fill_pattern(buf, 8192)
    assert B.check_pattern(buf, 8192)
    assert not B.check_pattern(buf, 0)
    buf[100] ^= 1
    assert not B.check_pattern(buf, 8192)


def test_cli_runs_every_io_workload(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--json",
            "--dir",
            str(tmp_path),
            "--size",
            "8M",
            "--ops",
            "2000",
            "--nfiles",
            "20",
            "--file-size",
            "64K",
            "--request-size",
            "2M",
            "--loop",
            "asyncio",
            "-w",
            "seqread,seqwrite,randread,randwrite,manyfiles",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["workload"], (r.get("params") or {}).get("mode")): r for r in out["results"]}
    assert set(w for w, _ in rows) == {"seqread", "seqwrite", "randread", "randwrite", "manyfiles"}
    assert ("randread", "gather") in rows and ("randread", "batch") in rows
    for r in rows.values():
        assert r["verified"] is True
        assert r["mb_s"] > 0 and r["ops"] > 0 and r["cpu_s"] >= 0
        assert r["max_stall_ms"] >= 0
    assert rows[("seqread", None)]["nbytes"] == 8 << 20
    assert rows[("randread", "gather")]["ops"] == 2000


def test_cli_table_and_sweep_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    rc = main(
        [
            "bench",
            "--dir",
            str(tmp_path),
            "--size",
            "4M",
            "-w",
            "seqread",
            "--request-size",
            "1M",
            "--sweep",
            "block_size=64K,1M",
            "--plot",
            str(png),
            "--loop",
            "uvloop",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "seqread" in text and "block_size=64K" in text and "block_size=1M" in text
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_format_workloads(tmp_path, capsys):
    pytest.importorskip("safetensors")
    rc = main(
        [
            "bench",
            "--json",
            "--dir",
            str(tmp_path),
            "--size",
            "8M",
            "-w",
            "safetensors,checkpoint",
            "--loop",
            "asyncio",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["workload"] for r in out["results"]] == ["safetensors", "checkpoint"]


async def test_misaligned_seqread_verifies(tmp_path):
    path = str(tmp_path / "f.bin")
    B.make_file(path, 4 << 20)
    r = await B.seqread(path, request_size=1 << 20, misalign=4104)
    assert r.verified and r.nbytes > (4 << 20) - 8192


def test_bad_workload_name(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "-w", "nope", "--dir", str(tmp_path)])


def test_make_file_never_overwrites_another_programs_file(tmp_path):
    p = tmp_path / "model.bin"
    p.write_bytes(b"precious weights" * 1000)
    with pytest.raises(FileExistsError):
        B.make_file(str(p), 1 << 20)
    assert p.read_bytes() == b"precious weights" * 1000
    with pytest.raises(SystemExit, match="--overwrite"):
        main(["bench", "--file", str(p), "--size", "1M", "-w", "seqread", "--loop", "asyncio"])
    assert p.read_bytes() == b"precious weights" * 1000
    # a benchmark file of another size is ours to rewrite; --overwrite takes any file
    B.make_file(str(p), 1 << 20, overwrite=True)
    B.make_file(str(p), 2 << 20)
    assert p.stat().st_size == 2 << 20
    assert B.holds_pattern(np.fromfile(p, np.uint8)[13:9000], 13)


def test_misaligned_seqread_checks_every_byte(tmp_path):
    import asyncio

    p = str(tmp_path / "f.bin")
    B.make_file(p, 4 << 20)
    r = asyncio.run(B.seqread(p, request_size=1 << 20, misalign=5))
    assert r.summary()["verified"]
    buf = np.fromfile(p, np.uint8)[5:1005].copy()
    assert B.holds_pattern(buf, 5)
    buf[999] ^= 1
    assert not B.holds_pattern(buf, 5)
