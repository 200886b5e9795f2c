"""`aionvme info` and `aionvme tune`: the report (table and JSON) says what this
machine offers; a tune run writes a config that Handle, defaults and
DeepSpeed's own config reader take as it is."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aionvme as nvme
from aionvme import Handle, defaults
from aionvme.cli import main

SRC = str(Path(nvme.__file__).parent.parent)


def _cli(*args: str, timeout: int = 300, columns: int = 200) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=SRC, COLUMNS=str(columns))
    return subprocess.run(
        [sys.executable, "-m", "aionvme", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


# -- info -------------------------------------------------------------------------------------


def test_info_json_describes_this_machine(tmp_path):
    r = _cli("info", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kernel_aio"]["available"] is True  # io_setup works on these machines
    assert d["engine"]["engine"] == "aio"
    assert d["path"]["path"] == str(tmp_path)
    assert d["path"]["filesystem"] == "ext4"  # pytest's tmp_path is on ext4 here
    assert d["path"]["o_direct"] is True and d["path"]["roundtrip_ok"] is True
    st = d["path"]["statx_dioalign"]
    assert st is not None and d["path"]["offset_align"] == st["offset_align"] > 0
    assert d["limits"]["aio_max_nr"] == int(Path("/proc/sys/fs/aio-max-nr").read_text())
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert d["limits"]["memlock_soft"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert isinstance(d["limits"]["cap_ipc_lock"], bool)
    assert d["versions"]["aionvme"] == nvme.__version__
    assert d["io_uring"]["io_uring_disabled"] == int(Path("/proc/sys/kernel/io_uring_disabled").read_text())
    disabled = d["io_uring"]["io_uring_disabled"]  # 0: allowed, 1: privileged only, 2: off
    if disabled in (0, 2):
        assert d["io_uring"]["available"] is (disabled == 0)
    assert set(d["gpu"]) == {"cuda", "devices", "source", "details"}
    assert d["defaults"] == defaults.get()
    assert not list(tmp_path.iterdir())  # the probe file is gone


def test_info_table_is_readable(tmp_path):
    r = _cli("info", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for words in ("kernel AIO", "O_DIRECT", "fs.aio-max-nr", "RLIMIT_MEMLOCK", "cuFile", "io_uring", "ext4"):
        assert words in r.stdout, (words, r.stdout)


def test_info_plain_table_without_rich(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)  # as if rich were not installed
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[ok]   kernel AIO" in out and "O_DIRECT" in out


def test_info_reports_a_filesystem_that_refuses_o_direct(ramfs_dir):
    d = nvme.info(str(ramfs_dir))
    assert d["path"]["filesystem"] == "ramfs"
    assert d["path"]["o_direct"] is False and "EINVAL" in d["path"]["how"]


def test_info_reports_why_kernel_aio_is_missing(tmp_path):
    # a seccomp filter that makes io_setup fail with ENOSYS, as gVisor and some
    # container runtimes do: the report says so and names the thread engine
    code = textwrap.dedent(
        """
        import ctypes, json, struct, sys
        PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
        NR_IO_SETUP, ENOSYS = 206, 38
        def ins(code, jt, jf, k): return struct.pack("HBBI", code, jt, jf, k)
        prog = b"".join([
            ins(0x20, 0, 0, 0),                      # ld [nr]
            ins(0x15, 0, 1, NR_IO_SETUP),            # jeq io_setup
            ins(0x06, 0, 0, 0x00050000 | ENOSYS),    # ret ERRNO(ENOSYS)
            ins(0x06, 0, 0, 0x7FFF0000),             # ret ALLOW
        ])
        buf = ctypes.create_string_buffer(prog)
        class Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        fp = Fprog(len(prog) // 8, ctypes.addressof(buf))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
        rc = libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fp), 0, 0)
        assert rc == 0, ctypes.get_errno()
        from aionvme.cli import main
        sys.exit(main(["info", sys.argv[1], "--json"]))
        """
    )
    if os.uname().machine != "x86_64":
        pytest.skip("the seccomp filter here uses x86_64 syscall numbers")
    env = dict(os.environ, PYTHONPATH=SRC)
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kernel_aio"]["available"] is False
    assert d["kernel_aio"]["error"].startswith("ENOSYS")
    assert "seccomp" in d["kernel_aio"]["hint"]
    assert d["engine"]["engine"] == "thread"
    assert d["path"]["roundtrip_ok"] is True  # the worker threads did the probe I/O


def test_info_rejects_a_missing_directory(tmp_path):
    r = _cli("info", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not a directory" in r.stdout


# -- tune ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One small tune run (hidden 'smoke' grid: every stage, a few points, 8 MiB)."""
    d = tmp_path_factory.mktemp("tune")
    out = d / "cfg.json"
    r = _cli(
        "tune",
        "--dir",
        str(d),
        "--grid",
        "smoke",
        "--output",
        str(out),
        "--plot",
        str(d / "p.png"),
        "--gpu",
        columns=80,
    )
    return d, out, r


def test_tune_runs_every_stage_and_ranks(tuned):
    d, out, r = tuned
    assert r.returncode == 0, r.stdout + r.stderr
    for stage in ("1. block size", "2. queue depth x intra-op parallelism", "3. submit modes", "4. the best"):
        assert stage in r.stdout
    assert "best: block=" in r.stdout and "read" in r.stdout
    # writes are durable in-place overwrites; a fresh file's write (seqwrite's, the demo's) is shown too
    words = " ".join(r.stdout.split())
    assert "(in place, then fsync)" in words and "into a fresh file" in words
    # the headers, the table and the messages fit an 80-column terminal
    assert max(len(line) for line in r.stdout.splitlines()) <= 80, r.stdout
    assert [p.name for p in d.iterdir() if p.name.startswith("aionvme-")] == []  # scratch removed


def test_tune_gpu_and_plot_degrade_with_a_message(tuned):
    d, _, r = tuned
    if importlib.util.find_spec("torch") is None or not __import__("torch").cuda.is_available():
        assert "--gpu skipped: " in r.stdout
    if importlib.util.find_spec("matplotlib") is None:
        assert "--plot: plotting needs matplotlib" in r.stdout and not (d / "p.png").exists()
    else:
        assert (d / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_tune_config_loads_into_handle_defaults_and_deepspeed(tuned):
    _, out, r = tuned
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = json.loads(out.read_text())
    best = cfg["tune"]["measured"][0]
    assert best["ranked"] is True and best["runs"] == 2  # the smoke grid measures the best 2 once more
    ranked = [m for m in cfg["tune"]["measured"] if m["ranked"]]
    assert len(ranked) == 2 and all(m["runs"] == 2 for m in ranked)
    assert all(m["runs"] == 1 for m in cfg["tune"]["measured"] if not m["ranked"])
    h = Handle.from_config(out)
    assert (h.block_size, h.queue_depth, h.single_submit, h.overlap_events) == (
        best["block_size"],
        best["queue_depth"],
        best["single_submit"],
        best["overlap_events"],
    )
    assert h.intra_op_parallelism == best["intra_op_parallelism"]
    assert h.config() == cfg["aionvme"]
    with defaults.load_config(out):
        assert defaults.get("block_size") == best["block_size"]
        assert defaults.get("max_inflight") == best["intra_op_parallelism"]
    # DeepSpeed's section: exactly the keys its runtime reads, real JSON booleans
    assert set(cfg["aio"]) == set(defaults.DEEPSPEED_AIO_DEFAULTS)
    assert isinstance(cfg["aio"]["single_submit"], bool) and isinstance(cfg["aio"]["overlap_events"], bool)
    # DeepSpeed runs one request at a time: its queue depth is what the device had in flight
    in_flight = min(best["queue_depth"], 4 * (best["intra_op_parallelism"] or best["queue_depth"]))
    assert cfg["aio"] == {**h.deepspeed_config(), "queue_depth": in_flight}
    assert cfg["tune"]["chunks_in_flight"] == in_flight
    assert len(cfg["tune"]["measured"]) >= 5 and cfg["tune"]["filesystem"] == "ext4"
    assert cfg["tune"]["write_fresh_GBps"] > 0


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_tune_config_is_read_by_deepspeeds_own_parser(tuned):
    _, out, _ = tuned
    code = textwrap.dedent(
        f"""
        import json
        from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
        cfg = json.load(open({str(out)!r}))
        print(json.dumps(get_aio_config(cfg)))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    parsed = json.loads(r.stdout.strip().splitlines()[-1])
    cfg = json.loads(out.read_text())
    for key, value in cfg["aio"].items():  # every key we write is one DeepSpeed reads
        assert parsed[key] == value, key


def test_tune_rejects_a_missing_dir(tmp_path):
    r = _cli("tune", "--dir", str(tmp_path / "nope"), "--quick")
    assert r.returncode == 2 and "not a directory" in r.stdout


# -- tune's ranking, with a measurement function that cannot be lucky ------------------------------


def _fake_measure(first: dict, again: float):
    """A measurement whose first run of a point gives ``first[knobs]`` GB/s
    (both ways) and every later run ``again``: the sweep's choice is then
    decided by the ranking rule alone."""
    from aionvme.bench import Result

    seen: dict = {}

    async def measure(k):
        n = seen[k] = seen.get(k, 0) + 1
        gbps = first(k) if n == 1 else again
        r = Result("tune-read", 10**9, 4, 1 / gbps)
        return r, Result("tune-write", 10**9, 4, 1 / gbps)

    return measure, seen


def test_tune_ranks_only_the_remeasured_points():
    from aionvme.bench import run_loop
    from aionvme.bench.tune import GRIDS, Sweep

    # first runs: the larger the block and the depth, the faster; a lucky first
    # run for the top points, which then measure 1 GB/s; every other point was
    # measured once, at up to 9.x GB/s: it must not win over a median of runs
    def first(k):
        return 5 + k.block_size / (8 << 20) + k.queue_depth / 1000 + (not k.single_submit) + k.overlap_events

    measure, seen = _fake_measure(first, again=1.0)
    grid = GRIDS["quick"]
    stages = []
    sweep = Sweep(measure, grid, on_stage=lambda title, n: stages.append((title, n)))
    best = run_loop(sweep.run(), "asyncio")
    ranked = sweep.ranked()
    assert len(ranked) == grid.repeat_top == len(sweep.remeasured)
    assert all(p.runs == 1 + grid.repeats for p in ranked)
    assert best is ranked[0] and best.runs == 3 and best.combined == pytest.approx(1.0)
    # every point measured once beat it on its single run: the old rule would have picked one of them
    once = sweep.unranked()
    assert once and all(p.runs == 1 and p.combined > best.combined for p in once)
    assert {k for k, n in seen.items() if n > 1} == set(sweep.remeasured)
    assert stages[-1] == (f"4. the best {grid.repeat_top} again", grid.repeat_top * grid.repeats)


def test_tune_picks_the_best_median_among_the_remeasured():
    from aionvme.bench import Result, run_loop
    from aionvme.bench.tune import GRIDS, Knobs, Sweep

    grid = GRIDS["smoke"]
    runs: dict = {}
    # the point that is fastest on its first run is the slowest on the next: the winner is the other one
    table = {256 << 10: [9.0, 1.0], 1 << 20: [8.0, 7.0]}

    async def measure(k: Knobs):
        n = runs[k] = runs.get(k, 0) + 1
        speeds = table.get(k.block_size, [0.5])
        gbps = speeds[min(n, len(speeds)) - 1] if k.queue_depth == 8 and k.intra_op_parallelism == 0 else 0.5
        if not (k.overlap_events and not k.single_submit):
            gbps = 0.5
        return Result("r", 10**9, 1, 1 / gbps), Result("w", 10**9, 1, 1 / gbps)

    sweep = Sweep(measure, grid)
    best = run_loop(sweep.run(), "asyncio")
    assert best.knobs.block_size == 1 << 20 and best.read == pytest.approx(7.5)
    assert [p.knobs.block_size for p in sweep.ranked()] == [1 << 20, 256 << 10]


def test_tune_table_fits_80_columns():
    from aionvme.bench import Result, render
    from aionvme.bench.tune import Knobs, Point

    pts = [
        Point(
            Knobs(8 << 20, 256, 16, True, False),
            [Result("r", 10**9, 1, 0.01)] * 3,
            [Result("w", 10**9, 1, 0.02)] * 3,
        )
    ] * 10
    text = render.tune_table(
        pts, "aionvme tune: the best 10 of 123 points, measured again (medians of 3 runs)", 80
    )
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "100.00" in text and "8M" in text and "single" in text


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is not None and not __import__("torch").cuda.is_available(),
    reason="no CUDA device",
)
@pytest.mark.gpu
def test_tune_gpu_times_the_gpu_path(tmp_path):
    # the GPU measurement moves CUDA tensors through aionvme (cuFile or the bounce pipeline)
    from aionvme import gpu
    from aionvme.bench import run_loop
    from aionvme.bench.tune import Knobs, TuneFile

    tf = TuneFile(str(tmp_path / "t.bin"), 8 << 20, gpu=True)
    try:
        before = gpu.stats()
        read, write = run_loop(tf.measure(Knobs(1 << 20, 8, 0)), "asyncio")
        after = gpu.stats()
    finally:
        tf.close()
    moved = sum(after[k] - before[k] for k in ("gds_requests", "bounce_requests"))
    assert moved >= 8 and read.gb_s > 0 and write.gb_s > 0


# -- demo --------------------------------------------------------------------------------------

_NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoTorch())
import aionvme
from aionvme.cli import main
rc = main(sys.argv[1:])
assert "torch" not in sys.modules
sys.exit(rc)
"""


def test_demo_runs_without_torch(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC, COLUMNS="80")
    cmd = [
        sys.executable,
        "-c",
        _NO_TORCH,
        "demo",
        "--size",
        "8M",
        "--dir",
        str(tmp_path),
        "--loop",
        "asyncio",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify   ok" in r.stdout
    io_line = next(line for line in r.stdout.splitlines() if line.startswith("I/O"))
    assert io_line.split()[1:3] == ["ext4,", "O_DIRECT"] and "O_DIRECT: O_DIRECT" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines() if not line.startswith("file ")) <= 80
    assert not list(tmp_path.iterdir())  # the temp file is gone
