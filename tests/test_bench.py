"""The benchmark package (aionvme.bench) and ``aionvme bench``: every workload
runs on a few MiB and verifies its data; the one result type, timer, median
and renderer behave (tables fit 80 columns); the registry runs workloads by
name. Speed itself is measured in bench/, not here."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import aionvme
from aionvme import bench as B
from aionvme.bench import peers, render
from aionvme.cli import main

SRC = str(Path(aionvme.__file__).parent.parent)
IO = ["seqread", "seqwrite", "randread", "randwrite", "manyfiles"]
SMALL = ["--size", "8M", "--ops", "2000", "--nfiles", "20", "--file-size", "64K", "--request-size", "2M"]


def test_pattern_roundtrip():
    buf = np.zeros(4096, np.uint8)
    B.fill_pattern(buf, 8192)
    assert B.check_pattern(buf, 8192)
    assert not B.check_pattern(buf, 0)
    buf[100] ^= 1
    assert not B.check_pattern(buf, 8192)


def test_cli_runs_every_io_workload(tmp_path, capsys):
    rc = main(["bench", "--json", "--dir", str(tmp_path), *SMALL, "--loop", "asyncio", "-w", ",".join(IO)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["workload"], r["params"].get("mode")): r for r in out["results"]}
    assert set(w for w, _ in rows) == set(IO)
    assert ("randread", "gather") in rows and ("randread", "batch") in rows
    for r in rows.values():
        assert r["verified"] is True and r["skipped"] is None
        assert r["mb_s"] > 0 and r["ops"] > 0 and r["cpu_s"] >= 0
        assert r["max_stall_ms"] >= 0
        # every I/O workload measures its latency, seqwrite included (it printed 0 before)
        assert r["p50_us"] > 0 and r["p99_us"] >= r["p50_us"]
    assert rows[("seqread", None)]["nbytes"] == 8 << 20
    assert rows[("seqwrite", None)]["ops"] == 4  # 8 MiB in requests of 2 MiB
    assert rows[("randread", "gather")]["ops"] == 2000


def test_cli_table_fits_80_columns_and_sweep_plot(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("COLUMNS", "80")
    png = tmp_path / "sweep.png"
    long_dir = tmp_path / "a-directory-with-a-rather-long-name-as-people-make-them"
    long_dir.mkdir()
    argv = ["bench", "--dir", str(long_dir), "--size", "4M", "-w", "seqread,seqwrite", "--request-size", "1M"]
    argv += ["--sweep", "block_size=64K,1M"]
    rc = main([*argv, "--plot", str(png), "--loop", "uvloop"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "seqread" in text and "block_size=64K" in text and "block_size=1M" in text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    seqwrite = [line for line in text.splitlines() if line.startswith("seqwrite")]
    assert len(seqwrite) == 2 and all("n/a" not in line for line in seqwrite)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_cli_format_workloads(tmp_path, capsys, monkeypatch):
    pytest.importorskip("safetensors")
    monkeypatch.setenv("COLUMNS", "80")
    argv = [
        "bench",
        "--dir",
        str(tmp_path),
        "--size",
        "8M",
        "-w",
        "safetensors,checkpoint",
        "--loop",
        "asyncio",
    ]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["workload"] for r in out["results"]] == ["safetensors", "checkpoint"]
    for r in out["results"]:
        assert r["verified"] is True and r["mb_s"] > 0
        assert r["figures"]["load_ratio"] > 0 and r["figures"]["save_ratio"] > 0
        assert r["p50_us"] is None  # not measured: shown as n/a
    st = out["results"][0]["figures"]
    if shutil.which("fio"):  # the floor: fio's cold read of the same file + touching the tensors
        assert st["floor_fio_s"] > 0 and st["floor_s"] == pytest.approx(st["floor_fio_s"] + st["touch_s"])
        assert st["floor_ratio"] == pytest.approx(st["floor_s"] / out["results"][0]["wall_s"])
    else:
        assert "floor_s" not in st and any("no floor" in n for n in out["results"][0]["notes"])


def _results() -> list[B.Result]:
    """Results as the workloads make them, with the widest figures they can have."""
    lat = list(np.linspace(1e-4, 9.9, 100))
    rows = [
        B.Result("seqread", 1 << 34, 256, 12.3, 1.2, latencies_s=lat, params=dict(misalign=4104)),
        B.Result("seqwrite", 1 << 34, 256, 9.9, 2.3, latencies_s=lat, max_stall_s=12.345),
        B.Result("randread", 4096 * 10**7, 10**7, 9.0, 88.0, latencies_s=lat, params=dict(mode="gather")),
        B.Result("randread", 4096 * 10**7, 10**7, 9.0, 88.0, verified=False, params=dict(mode="batch")),
        B.Result("manyfiles", 1 << 30, 1000, 1.0, 0.5, latencies_s=lat),
        B.Result.skip("checkpoint", "needs torch (pip install torch)"),
    ]
    fig = dict(load_GBps=1.5, load_safetensors_GBps=0.7, load_ratio=2.1, save_GBps=1.0)
    fig.update(save_safetensors_GBps=0.4, save_ratio=2.5)
    rows.append(
        B.Result("safetensors", 1 << 31, 0, 1.4, 0.7, params=dict(op="load"), figures=fig, notes=["x" * 150])
    )
    return rows


def test_results_table_fits_80_columns():
    title = "aionvme bench on /a/very/long/directory/name/that/goes/on/and/on, loop=uvloop, " * 2
    text = render.results_table(_results(), title, width=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    head = next(line for line in lines if line.startswith("workload"))
    assert head.split() == [
        "workload",
        "MB/s",
        "IOPS",
        "CPU",
        "s/GiB",
        "CPU",
        "µs/op",
        "p50",
        "µs",
        "p99",
        "µs",
        "stall",
        "ms",
        "ok",
    ]
    rows = {line.split()[0] + line.split()[1]: line for line in lines if line.startswith(("safet", "check"))}
    # a format row has its own figures in the columns and its comparisons as notes, no key=value block
    assert "=" not in rows["safetensorsload"] and rows["safetensorsload"].split()[-1] == "yes"
    assert "n/a" in rows["safetensorsload"]
    assert "skipped: needs torch" in text and "checkpoint" in text
    assert any(line.startswith("randread (batch)") and line.endswith("NO") for line in lines)
    # the same table is as wide as it needs to be on a wider terminal, and no wider
    assert max(len(line) for line in render.results_table(_results(), width=200).splitlines()) < 200


def test_table_cuts_only_text_and_wraps_title():
    rows = [["a" * 100, "1.23"], ["b", "4.56"]]
    text = render.table(("name", "GB/s"), rows, title="t " * 60, notes=["n " * 60], width=40)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 40
    assert any(line.endswith("1.23") and "…" in line for line in lines)
    assert any(line.startswith("b ") and line.endswith("4.56") for line in lines)


def test_gpu_table_fits_80_columns():
    rows = [
        B.Result("gpu-read", 4 << 30, 16, 1.0, params=dict(way="host", used="host")),
        B.Result("gpu-read", 4 << 30, 16, 0.5, params=dict(way="bounce", used="bounce")),
        B.Result.skip("gpu-read", "cuFile is not available: libcufile.so.0 was not found " * 2, way="gds"),
    ]
    text = render.gpu_table(rows, "aionvme bench --gpu on NVIDIA H200, 4G per transfer " * 2, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "2.00x" in text and "unavailable: cuFile" in text
    again = [B.Result.from_dict(r.to_dict()) for r in rows]  # as gpu_check.sh reads the JSON back
    assert render.gpu_table(again, width=80) == render.gpu_table(rows, width=80)


def test_median_result():
    runs = [
        B.Result("seqread", 100, 1, wall, 0.1, max_stall_s=stall, latencies_s=[wall], figures={"x": wall})
        for wall, stall in ((1.0, 0.001), (3.0, 0.5), (2.0, 0.002))
    ]
    runs[1].verified = False
    m = B.median_result(runs)
    assert m.wall_s == 2.0 and m.figures["x"] == 2.0 and m.p50_us == pytest.approx(2e6)
    assert m.max_stall_s == 0.5 and m.verified is False and m.runs == 3
    assert B.median([]) == 0.0 and B.spread([3, 1, 2]) == (2, 1, 3)
    with pytest.raises(ValueError):
        B.median_result([])


async def test_timer_sees_a_loop_stall():
    with B.Timer() as t:
        await asyncio.sleep(0.005)
        time.sleep(0.03)  # the loop is blocked: the monitor's callback runs late
        await asyncio.sleep(0.005)
    # uvloop's timers have 1 ms granularity: the two sleeps may end a little early
    assert t.max_stall >= 0.02 and t.wall >= 0.035 and t.cpu >= 0
    r = t.result("x", 1 << 20, 1)
    assert r.max_stall_s == t.max_stall and r.mb_s > 0


async def test_timer_takes_stalls_from_the_reactors(tmp_path):
    # stalls="reactor": the longest of aionvme's callbacks on this loop, of
    # the shared reactor and a Handle's own; a task woken by a read that then
    # blocks the loop is inside such a callback. A stall outside any of them
    # (before the reads) is not counted: no timer wakes the loop.
    path = str(tmp_path / "f.bin")
    B.make_file(path, 1 << 20)
    buf = aionvme.empty(4096)
    with aionvme.open(path) as f, aionvme.Handle(queue_depth=4) as h:
        await f.pread(buf, 0)
        await h.pread(buf, f, 0)
        await asyncio.sleep(0)  # resumed by the loop, no longer inside the wakeup
        with B.Timer(stalls="reactor") as t:
            time.sleep(0.3)  # not in a reactor's callback: not counted
            await f.pread(buf, 4096)
        # a read's own callback: well under 1 ms, tens of ms when the host takes the VM's CPU
        assert t.max_stall < 0.15
        for blocked in ("file", "handle"):
            with B.Timer(stalls="reactor") as t:
                await (f.pread(buf, 8192) if blocked == "file" else h.pread(buf, f, 8192))
                time.sleep(0.3)  # the wakeup runs this task inside the callback
                await asyncio.sleep(0)
            assert t.max_stall >= 0.3, blocked
            assert t.result("x", 4096, 1).max_stall_s == t.max_stall
    with pytest.raises(ValueError, match="stalls"):
        B.Timer(stalls="monitor")


def test_timer_without_a_loop():
    with B.Timer() as t:
        sum(range(100_000))
    assert t.wall > 0 and t.max_stall == 0.0


async def test_registry_runs_a_registered_workload(tmp_path):
    @B.register("test-echo", help="a workload of the test suite", in_all=False)
    async def echo(ctx: B.Context) -> B.Result:
        with B.Timer() as t:
            await aionvme.pwrite(np.full(4096, 7, np.uint8), os.path.join(ctx.workdir, "e.bin"))
        return t.result("test-echo", 4096, 1, params=dict(n=ctx.option("n", 0, int)))

    assert "test-echo" in B.names() and "test-echo" not in B.names(all_only=True)
    r = await B.run("test-echo", B.Context(str(tmp_path), options={"n": "3"}))
    assert r.params == {"n": 3} and (tmp_path / "e.bin").read_bytes() == b"\x07" * 4096
    with pytest.raises(B.UnknownWorkloadError, match="known: seqread") as e:
        B.get("nope")
    assert isinstance(e.value, KeyError) and isinstance(e.value, aionvme.AionvmeError)


def test_cli_runs_a_workload_by_module_path(tmp_path, capsys, monkeypatch):
    (tmp_path / "mywork.py").write_text(
        "from aionvme.bench import Result\n"
        "async def run(ctx):\n"
        "    return Result('mine', 10**6, 1, 0.5, params={'k': ctx.options['k']})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        main(
            ["bench", "--json", "--dir", str(tmp_path), "-w", "mywork:run", "-o", "k=v", "--loop", "asyncio"]
        )
        == 0
    )
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["workload"] == "mine" and r["params"] == {"k": "v"} and r["mb_s"] == 2.0


def test_cli_lists_workloads(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in [*IO, "safetensors", "checkpoint", "gpu-read"]:
        assert name in out


async def test_misaligned_seqread_verifies(tmp_path):
    path = str(tmp_path / "f.bin")
    B.make_file(path, 4 << 20)
    r = await B.seqread(path, request_size=1 << 20, misalign=4104)
    assert r.verified and r.nbytes > (4 << 20) - 8192


def test_bad_workload_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["bench", "-w", "nope", "--dir", str(tmp_path)])
    assert ei.value.code == 2 and "unknown workload 'nope'" in capsys.readouterr().err


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
    p = str(tmp_path / "f.bin")
    B.make_file(p, 4 << 20)
    r = B.run_loop(B.seqread(p, request_size=1 << 20, misalign=5), "asyncio")
    assert r.to_dict()["verified"]
    buf = np.fromfile(p, np.uint8)[5:1005].copy()
    assert B.holds_pattern(buf, 5)
    buf[999] ^= 1
    assert not B.holds_pattern(buf, 5)


def test_the_package_needs_neither_the_cli_nor_torch():
    # the library side of benchmarking: importing it pulls in no CLI and no torch
    code = (
        "import sys, aionvme.bench\n"
        "bad = [m for m in sys.modules if m.startswith(('aionvme.cli', 'torch'))]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=SRC)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr


# -- the peers: fio and DeepSpeed's own op ---------------------------------------------------------


def test_disk_figures_from_device_counters(tmp_path):
    before = [100, 10, 8000, 50, 20, 0, 160, 4] + [0] * 9
    after = [164, 74, 8000 + 2048 * 64, 50 + 2000, 20, 0, 160, 4] + [0] * 9
    fig = peers.disk_figures(before, after, wall_s=0.5)
    assert fig["dev_read_requests"] == 64 and fig["dev_read_merges"] == 64
    assert fig["dev_read_kib_per_request"] == 1024  # 2048 sectors of 512 B
    assert fig["dev_read_avg_queue"] == pytest.approx(4.0)  # 2 s of request time in 0.5 s
    assert "dev_write_requests" not in fig  # no writes in between
    stats = peers.disk_stats(str(tmp_path))  # the device under tmp_path (ext4 here), or None on tmpfs
    assert stats is None or len(stats) >= 11


def test_deepspeed_workload_is_registered():
    assert "deepspeed" in B.names()
    assert B.get("deepspeed").load() is peers.deepspeed_workload
    assert len(peers.DS_GRIDS["full"]) == 27  # block 1M/4M/8M x QD 32/64/128 x IOP 1/4/8


@pytest.mark.slow  # the child imports DeepSpeed: 10-40 s on 2 busy cores
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_child_refuses_aionvme_dropin(tmp_path):
    """What is measured as DeepSpeed must be DeepSpeed's op, never aionvme's drop-in."""
    code = (
        "import aionvme.compat.deepspeed as d; d.install()\n"
        "from aionvme.bench.peers import _child\n"
        f"_child(dict(path={str(tmp_path / 'x')!r}, op='read', points=[[1048576, 8, 1]], buffers=['locked']))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=SRC)
    )
    assert p.returncode != 0 and "install() is in effect" in p.stderr, p.stderr[-2000:]


_DS_WHY = (
    peers.deepspeed_unavailable() if importlib.util.find_spec("deepspeed") else "deepspeed is not installed"
)


@pytest.mark.slow
@pytest.mark.skipif(_DS_WHY is not None, reason=f"DeepSpeed's async_io op cannot run: {_DS_WHY}")
def test_deepspeed_peer_reads_and_writes_with_its_own_op(tmp_path):
    path = str(tmp_path / "r.bin")
    B.make_file(path, 8 << 20)
    points = [(1 << 20, 8, 1), (1 << 20, 4, 2)]
    got = peers.deepspeed_sweep(path, "read", points, ("locked", "plain"))
    assert len(got) == 4, [r.skipped for r in got]
    for r in got:
        assert r.skipped is None and r.verified and r.nbytes == 8 << 20 and r.mb_s > 0
        assert r.params["op_file"].endswith(".so") and "aionvme" not in r.params["op_file"]
    assert {(r.params["buffer"], r.params["intra_op_parallelism"]) for r in got} == {
        (b, p) for b in ("locked", "plain") for p in (1, 2)
    }
    assert peers.best(got) is max(got, key=lambda r: r.mb_s)
    wpath = str(tmp_path / "w.bin")
    (w,) = peers.deepspeed_sweep(wpath, "write", points[:1], ("locked",), size=4 << 20)
    assert w.skipped is None and w.verified and os.path.getsize(wpath) == 4 << 20
    with open(wpath, "rb") as f:
        assert B.check_pattern(np.frombuffer(f.read(), np.uint8).copy(), 0)


_BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("script", sorted(str(p.relative_to(_BENCH)) for p in _BENCH.glob("*/*.py")))
def test_every_bench_script_imports_and_answers_help(script):
    # The scripts import the library's bench package: a rename must not leave one broken.
    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, str(root / "bench" / script), "--help"]
    if script == "probes/cached_reads.py":  # no options: a small run instead
        argv[-1] = "2000"
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")
@pytest.mark.parametrize("mode", ["fio", "loop", "gather"])
def test_aio_shape_runs_each_shape_and_reports_its_longest_step(tmp_path, mode):
    # bench/c/aio_shape.c gives bench/README.md its C figures: it must keep
    # building, reading, and reporting the step line next to the reactor's.
    root = Path(__file__).resolve().parent.parent
    exe = tmp_path / "aio_shape"
    src = str(root / "bench" / "c" / "aio_shape.c")
    subprocess.run(["cc", "-O2", "-o", str(exe), src], check=True, timeout=120)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    env = {**os.environ, "GATHER_BATCH": "4", "RAMP": "2"}
    r = subprocess.run(
        [str(exe), str(path), mode, "8", "2000", "no-such-dev", "100"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if r.returncode != 0 and "Invalid argument" in r.stderr:
        pytest.skip(f"O_DIRECT not supported on {tmp_path}: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    m = re.search(r"(\d+) IOPS\s+cpu ([\d.]+) us/read", r.stdout)
    assert m and int(m.group(1)) > 0, r.stdout
    step = re.search(r"longest step ([\d.]+) ms \(thread cpu ([\d.]+) ms\), steps over 5 ms (\d+)", r.stdout)
    assert step, r.stdout
    longest, cpu = float(step.group(1)), float(step.group(2))
    # 2000 reads with 100 ns of work each: some step took time, and its CPU is within it
    assert longest > 0 and cpu <= longest + 0.05, r.stdout


@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")
def test_seqwrite_alternated_pairs_each_round_and_reports_the_ratios(tmp_path):
    # bench/suites/seqwrite_alternated.py gives bench/README.md its write ratios: every round
    # must hold every writer, and the summary the ratios paired within rounds.
    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, str(root / "bench" / "suites" / "seqwrite_alternated.py")]
    argv += ["--size", "8M", "--rounds", "2", "--pause", "0", "--dir", str(tmp_path), "--seed", "1"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rounds = re.findall(r"^round \d+: (.*)$", r.stdout, re.M)
    assert len(rounds) == 2, r.stdout
    have_ds = "DeepSpeed is left out" not in r.stdout
    for line in rounds:
        rates = dict(re.findall(r"(aionvme|fio libaio bs=8M qd=16|deepspeed [^;]+?) ([\d,]+) MB/s", line))
        assert "aionvme" in rates and "fio libaio bs=8M qd=16" in rates, line
        points = len(peers.DS_GRIDS["quick"]) if have_ds else 0
        assert sum(k.startswith("deepspeed") for k in rates) == points, line
        assert all(float(v.replace(",", "")) > 0 for v in rates.values()), line
    assert re.search(r"aionvme / fio libaio bs=8M qd=16: [\d.]+x \(95% ", r.stdout), r.stdout
    if have_ds:
        assert re.search(r"aionvme / DeepSpeed's best configuration \(deepspeed bs=", r.stdout), r.stdout
    assert os.listdir(tmp_path) == []  # its temp dir and file are gone


def test_refill_thread_bench_runs_each_workload_both_ways(tmp_path):
    # bench/probes/refill_thread.py gives bench/README.md the refill thread's ratios:
    # every workload must run with and without the thread in every round.
    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, str(root / "bench" / "probes" / "refill_thread.py")]
    argv += ["--size", "16M", "--ops", "3000", "--rounds", "2", "--busy-ms", "0.2", "--work-ms", "0.2"]
    argv += ["--dir", str(tmp_path)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rounds = re.findall(r"^round \d+ \(with/without\): (.*)$", r.stdout, re.M)
    assert len(rounds) == 2, r.stdout
    for line in rounds:
        got = dict((n, (a, b)) for n, a, b in re.findall(r"([a-z+]+) ([\d,]+)/([\d,]+)", line))
        assert set(got) == {"gather", "batch", "batch+busy", "loader+gil"}, line
        assert all(int(a.replace(",", "")) > 0 and int(b.replace(",", "")) > 0 for a, b in got.values()), line
    for n in ("gather", "batch", "batch+busy", "loader+gil"):
        assert re.search(rf"^{re.escape(n)} +[\d,]+ +[\d,]+  [\d.]+x \(95% .*2 rounds\)$", r.stdout, re.M), (
            r.stdout
        )
    assert os.listdir(tmp_path) == []
